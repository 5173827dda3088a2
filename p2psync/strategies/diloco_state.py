"""DiLoCo's pure parts under one name: the outer step and merge (:mod:`.diloco.outer`), the
schedule (:mod:`.diloco.schedule`), the fragment map (:mod:`.diloco.fragments`) and the state
vector a member behind adopts (:mod:`.diloco.state`). Unit-tested against worked examples
computed by hand (tests/unit/test_diloco_state.py)."""

from __future__ import annotations

from p2psync.strategies.diloco.fragments import Ranges, fragment_map, indices, map_digest
from p2psync.strategies.diloco.outer import eager_gradient, late_part, merge, others_mean, outer_step, own_term
from p2psync.strategies.diloco.schedule import Cursor, Schedule, dylu_interval
from p2psync.strategies.diloco.state import COUNTERS, Counters, pack_state, state_size, unpack_state

__all__ = ["COUNTERS", "Counters", "Cursor", "Ranges", "Schedule", "dylu_interval", "eager_gradient", "fragment_map",
           "indices", "late_part", "map_digest", "merge", "others_mean", "outer_step", "own_term", "pack_state",
           "state_size", "unpack_state"]
