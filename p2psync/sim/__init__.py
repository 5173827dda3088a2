"""Deterministic simulation: the real runtime of many nodes in one process, in virtual time.

* :mod:`p2psync.sim.loop`: the virtual-time event loop (:class:`~p2psync.sim.loop.VirtualLoop`),
  which jumps its time to the next timer instead of sleeping, and holds and releases actors
  (nodes) as ``SIGSTOP`` / ``SIGCONT`` would.
* :mod:`p2psync.sim.medium`: the simulated medium (:class:`~p2psync.sim.medium.SimHub`,
  :class:`~p2psync.sim.medium.SimTransport`): per-link latency, cut and slowed links, and the
  express path of relayed control messages.
* :mod:`p2psync.sim.cluster`: :class:`~p2psync.sim.cluster.SimCluster`, every node of a
  topology running the real membership, failure detector and failover over the in-memory
  transport (per-link latency), with faults (:mod:`p2psync.sim.faults`: kill, restart,
  pause, partition, slow links) at given virtual times, summarized with the invariants of
  :mod:`p2psync.sim.invariants`.
* :mod:`p2psync.sim.training`: :class:`~p2psync.sim.training.TrainingCluster`, the same with a
  strategy on every node (its real steps and collectives) over the numpy replica of
  :mod:`p2psync.sim.replica`, and the invariants ``strategy_finished`` and
  ``same_model_at_end``.

Layer: above the coordinator, transport, topology, collectives and strategies (it runs their
real code); below ``cli``.
"""
