"""Deterministic simulation: the real runtime of many nodes in one process, in virtual time.

* :mod:`p2psync.sim.loop`: the virtual-time event loop (:class:`~p2psync.sim.loop.VirtualLoop`),
  which jumps its time to the next timer instead of sleeping, and holds and releases actors
  (nodes) as ``SIGSTOP`` / ``SIGCONT`` would.
* :mod:`p2psync.sim.cluster`: :class:`~p2psync.sim.cluster.SimCluster`, every node of a
  topology running the real membership, failure detector and failover over the in-memory
  transport (per-link latency), with faults (:mod:`p2psync.sim.faults`: kill, restart,
  pause, partition, slow links) at given virtual times, summarized with the invariants of
  :mod:`p2psync.sim.invariants`.

Layer: above the coordinator, transport and topology (it runs their real code); below ``cli``.
"""
