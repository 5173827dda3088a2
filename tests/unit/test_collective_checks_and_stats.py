"""Collectives: the arrival check of lossless pieces is fused with the add (issue 17): a NaN
from a peer is still rejected and blamed on that peer, and a node's own NaN still raises
Diverged before it is sent; allreduce_with_stats returns the operation's own stats (issue 18b)."""

import asyncio
from typing import Any

import numpy as np
import pytest

from p2psync.collectives import Collectives
from p2psync.errors import Diverged, NonFinitePiece
from p2psync.topology import ring
from p2psync.transport.memory import MemoryHub
from tests.helpers import forge_nan_sends


async def _run(bad: int, *, forge: bool, at: int = 150) -> tuple[list[Any], dict[int, Any]]:
    hub = MemoryHub(ring(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    if forge:  # a modified node: a NaN in every piece it sends, after its own checks
        forge_nan_sends(eps[bad])
    cs = [Collectives(eps[i], timeout=1, piece_bytes=64, algo="ring") for i in range(3)]
    xs = [np.ones(200, np.float32) for _ in range(3)]
    if not forge:
        xs[bad][at] = np.nan
    try:
        res = await asyncio.gather(*(c.allreduce(x, tag="t.1") for c, x in zip(cs, xs)), return_exceptions=True)
        return list(res), {i: dict(e.offences) for i, e in eps.items()}
    finally:
        for e in eps.values():
            await e.close()


async def test_a_forged_nan_piece_is_blamed_on_its_sender() -> None:
    res, offences = await _run(1, forge=True)
    blamed = [r for r in res if isinstance(r, NonFinitePiece)]
    assert blamed and all(r.peers == (1,) for r in blamed)
    assert any(o.get(1) for i, o in offences.items() if i != 1)
    assert not any(o.get(0) or o.get(2) for o in offences.values())


@pytest.mark.parametrize("at", [10, 80, 150])  # in each of the three chunks
async def test_an_own_nan_raises_diverged_and_blames_nobody(at: int) -> None:
    res, offences = await _run(2, forge=False, at=at)
    assert isinstance(res[2], Diverged)
    assert not any(offences.values())


async def test_finite_results_are_unchanged() -> None:
    hub = MemoryHub(ring(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    try:
        cs = [Collectives(eps[i], timeout=5, piece_bytes=64, algo="ring") for i in range(3)]
        xs = [np.random.default_rng(i).standard_normal(1000).astype(np.float32) for i in range(3)]
        res = await asyncio.gather(*(c.allreduce(x, tag="t.2") for c, x in zip(cs, xs)))
        for r in res:
            np.testing.assert_allclose(r, sum(xs), rtol=1e-5, atol=1e-6)
    finally:
        for e in eps.values():
            await e.close()


async def test_allreduce_with_stats_returns_this_operations_stats() -> None:
    hub = MemoryHub(ring(3))
    eps = {i: hub.endpoint(i) for i in range(3)}
    for e in eps.values():
        await e.start()
    try:
        cs = [Collectives(eps[i], timeout=5, piece_bytes=64) for i in range(3)]
        xs = [np.full(100, float(i), np.float32) for i in range(3)]
        res = await asyncio.gather(*(c.allreduce_with_stats(x, tag="s.1", codec="fp16") for c, x in zip(cs, xs)))
        for (out, st), c in zip(res, cs):
            np.testing.assert_allclose(out, 3.0)
            assert st is c.stats_for("s.1") and st.tag == "s.1" and st.codec == "fp16"
            assert st.wire_bytes > 0 and st.compression > 1.9
        res = await asyncio.gather(*(c.allreduce_with_stats(x, tag="s.2", codec="topk:0.9") for c, x in zip(cs, xs)))
        for (_out, st), c in zip(res, cs):  # top-k that would not save traffic runs dense
            assert st.tag == "s.2" and st.wire_bytes == c.stats_for("s.2").wire_bytes > 0
    finally:
        for e in eps.values():
            await e.close()
