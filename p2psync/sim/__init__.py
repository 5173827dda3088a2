"""Deterministic simulation: the real runtime of many nodes in one process, in virtual time.

* :mod:`p2psync.sim.loop`: the virtual-time event loop (:class:`~p2psync.sim.loop.VirtualLoop`),
  which jumps its time to the next timer instead of sleeping, and holds and releases actors
  (nodes) as ``SIGSTOP`` / ``SIGCONT`` would.

Layer: above the coordinator, transport and topology (it runs their real code); below ``cli``.
"""
