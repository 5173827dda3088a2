"""What a Canary reply carries (paper ../shared/papers/canary.md §4.4.2, spec
../shared/specs/canary.md §6.5), through the exchange's real receive path (``Exchange._answer``:
a wire message in, the reply the exchange sends out).

Node 0 of a 4-node mesh holds data for node 1 (its own gradient's piece that node 1 owns,
waiting in the step-0 outbox). Node 1 pushes its step 0.

* ``replies=round`` (§4.4.2 read literally: "an empty packet when it is still under
  computation or has exchanged current gradient in prior communication"): outside node 0's own
  round of that colayer the reply is empty and the data stays for node 0's next push (counted in
  ``held``); during the round, or once node 0 has stopped computing, the reply carries it.
* ``replies=held`` (the default, the spec's reading): the reply carries whatever is waiting, at
  any time.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from p2psync.strategies.canary.flow import Datum
from p2psync.strategies.canary.plan import layout_for
from p2psync.compress import get_codec
from p2psync.strategies.canary.exchange import Exchange, Progress
from p2psync.strategies.canary.gei import node_bit
from p2psync.strategies.canary.wire import Header, pack
from p2psync.topology import mesh
from p2psync.transport import Mailbox
from p2psync.wire import Message, decode, encode

ME, PEER, T = 0, 1, 4


class Recorder:
    """Stands in for the forwarder: keeps what the exchange sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, list[np.ndarray], dict[str, Any]]] = []
        self.arrived = asyncio.Event()

    async def send(self, to: int, tag: str, arrays: list[np.ndarray], meta: dict[str, Any],
                   timeout: float | None = None) -> None:
        self.sent.append((to, tag, arrays, meta))
        self.arrived.set()


def _exchange(replies: str, stopping: bool = False) -> tuple[Exchange, Recorder]:
    topo = mesh(4)
    rec = Recorder()
    progress = Progress(iteration=lambda: T, zeta=lambda: (T, ME), stopping=lambda: stopping,
                        on_header=lambda h: None)
    ex = Exchange(transport=SimpleNamespace(node_id=ME, incarnation=1, scope=Mailbox().scope), fwd=rec,  # type: ignore[arg-type]
                  layout=layout_for(topo, topo.ids), sizes=[8], codec=get_codec("none"), mode="native",
                  staleness=100.0, timeout=1.0, epoch=0, plan=0, progress=progress, piece=2,
                  replies=replies)  # type: ignore[arg-type]
    return ex, rec


def _push(ex: Exchange) -> Message:
    """Node 1's step-0 push to node 0 (its own piece of the slot node 0 owns)."""
    slots = ex.flows[0].recv_slots(0, 0, PEER)
    data = [(s, Datum(np.ones(s.size, np.float32), 1, node_bit(PEER), T, T)) for s in slots]
    entries, arrays, _ = pack(data, get_codec("none"))
    meta = Header(PEER, 0, 0, 0, 0, 0, T, T, PEER, False, "none").meta()
    meta["d"] = entries
    meta["rq"] = f"canary.r.{PEER}.1.1.7.p{ME}"
    return decode(encode(kind="data", src=PEER, tag="canary.p", arrays=arrays, meta=meta))


async def _reply(ex: Exchange, rec: Recorder) -> list[np.ndarray]:
    ex._answer(_push(ex))
    await asyncio.wait_for(rec.arrived.wait(), 5)
    rec.arrived.clear()
    to, tag, arrays, meta = rec.sent[-1]
    assert to == PEER and tag == f"canary.r.{PEER}.1.1.7.p{ME}"
    assert len(meta["d"]) == len(arrays)
    return arrays


def _own(ex: Exchange) -> np.ndarray:
    g = np.arange(8, dtype=np.float32) + 1
    ex.contribute(0, T, g)  # into the outboxes, as a round does first
    return g


def _owned_by_peer(ex: Exchange, g: np.ndarray) -> np.ndarray:
    return np.concatenate([g[s.lo:s.hi] for s in ex.flows[0].send_slots(0, 0, PEER)])


async def test_round_policy_replies_empty_while_computing_and_the_data_waits_for_the_push() -> None:
    ex, rec = _exchange("round")
    try:
        g = _own(ex)
        assert await _reply(ex, rec) == []  # not in a round: "still under computation"
        assert ex.stats.held == 1 and ex.stats.empties_sent == 1
        assert ex.flows[0].holds(0, PEER, ex.flows[0].send_slots(0, 0, PEER))
        ex._in_round[0] = 1  # node 0's round of colayer 0 is running: the reply carries the data
        arrays = await _reply(ex, rec)
        assert np.concatenate(arrays).tobytes() == _owned_by_peer(ex, g).tobytes()
        assert not ex.flows[0].holds(0, PEER, ex.flows[0].send_slots(0, 0, PEER))
        assert await _reply(ex, rec) == []  # "has exchanged current gradient": nothing left
        assert ex.stats.held == 1
    finally:
        await ex._tasks.close()


async def test_held_policy_replies_with_whatever_waits() -> None:
    ex, rec = _exchange("held")
    try:
        g = _own(ex)
        arrays = await _reply(ex, rec)  # no round running: sent anyway
        assert np.concatenate(arrays).tobytes() == _owned_by_peer(ex, g).tobytes()
        assert ex.stats.held == 0
    finally:
        await ex._tasks.close()


async def test_round_policy_a_stopped_node_replies_with_its_data() -> None:
    ex, rec = _exchange("round", stopping=True)
    try:
        g = _own(ex)
        arrays = await _reply(ex, rec)  # it computes no more: what it holds leaves now
        assert np.concatenate(arrays).tobytes() == _owned_by_peer(ex, g).tobytes()
    finally:
        await ex._tasks.close()


async def test_a_round_is_marked_while_it_runs_and_unmarked_when_it_ends_or_fails() -> None:
    ex, rec = _exchange("round")
    seen: list[int] = []

    async def step(z: int, th: int, t: int) -> None:
        seen.append(ex._in_round.get(z, 0))
    ex._thread = step  # type: ignore[method-assign]
    await ex.round(0, T, np.zeros(8, np.float32))
    assert seen == [1] and ex._in_round[0] == 0

    async def fail(z: int, th: int, t: int) -> None:
        raise RuntimeError("boom")
    ex._thread = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await ex.round(0, T, np.zeros(8, np.float32))
    assert ex._in_round[0] == 0


async def test_a_round_cancelled_while_it_waits_is_unmarked() -> None:
    ex, rec = _exchange("round")
    waiting = asyncio.Event()

    async def hang(z: int, th: int, t: int) -> None:
        waiting.set()
        await asyncio.Event().wait()  # an answer that never comes
    ex._thread = hang  # type: ignore[method-assign]
    task = asyncio.ensure_future(ex.round(0, T, np.zeros(8, np.float32)))
    await asyncio.wait_for(waiting.wait(), 5)
    assert ex._in_round[0] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ex._in_round[0] == 0


def test_an_unknown_reply_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="replies"):
        _exchange("sometimes")
