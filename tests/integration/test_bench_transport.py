"""bench.transport's round-trip harness: three rows in alternating turns, each with its server
in a child process that serves exactly the round trips asked for (or a join would hang)."""

from __future__ import annotations

import pytest

from bench.transport import round_trips

pytestmark = pytest.mark.timeout(120)


async def test_round_trips_measures_every_row_in_turns():
    raw, endpoint, rpc = await round_trips(7, rounds=3, warm=2)
    for times in (raw, endpoint, rpc):
        assert len(times) == 7 and all(0 < t < 30 for t in times)
