"""Canary (Zhou et al.): the strategy and its parts, one module per concept.

* ``strategy.py`` — the :class:`Canary` strategy: colayers exchanged during backward, the
  GEI-gated apply, re-forming over views (registered as ``--strategy canary``);
* ``colayers.py`` — how the model's layers are grouped into colayers (pure);
* ``plan.py`` — the BCube slot layout and routing of one colayer's exchange (pure);
* ``flow.py`` — what one node holds of one exchange: results and outboxes (pure);
* ``exchange.py`` — one colayer's exchange over the transport (IO);
* ``gei.py`` — GEI bitmaps, proportions and staleness (pure);
* ``wire.py`` — the exchange's message header.
"""

from p2psync.strategies.canary.strategy import Canary, CanaryOptions, sketch_codec

__all__ = ["Canary", "CanaryOptions", "sketch_codec"]
