"""ζ and the GEI masks under out-of-order arrivals (spec ../shared/specs/canary.md §4.3-§4.4,
§6.5), through the exchange's real receive path (wire messages, ``Exchange._ingest``, the
routing of ``strategies/canary/flow.py``) and the strategy's header fold (``GEIMatrix.heard``).

Node 0 of a 4-node mesh, at iteration 6, three colayers cut into several slots each, takes the
messages of one round from its three peers in many random orders: data and empty packets of
several sender iterations, for every colayer and both steps (a peer's push and its reply to
node 0's push), and adds its own gradient at a random moment among them. Whatever the order:

* ``ζ`` = max(own iteration, every header's iteration and relayed ζ), empty packets included
  (§4.4 item 6), and the node at ζ is the lowest id of those seen there (§5.4's tie rule);
* ``r^[z]`` of row 6 (the receiver's iteration, §4.4 item 5, whatever the senders') = the AND
  over the colayer's slots of the OR of the contributors' masks that reached each slot (§4.4
  items 2-3), own bit included (item 4); an empty packet sets no bit (§6.5).

The staleness threshold is far away here: data older than ``ζ − s`` is dropped on receipt
(§6.5), which depends on whether the header that raised ζ came first — by design.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from p2psync.strategies.canary.flow import Datum
from p2psync.strategies.canary.plan import Slot, layout_for
from p2psync.compress import get_codec
from p2psync.strategies.canary.exchange import Exchange, Progress
from p2psync.strategies.canary.gei import GEIMatrix, full_mask, node_bit
from p2psync.strategies.canary.wire import Header, pack
from p2psync.topology import mesh
from p2psync.transport import Mailbox
from p2psync.wire import Message, decode, encode

ME, T, PEERS = 0, 6, (1, 2, 3)
SIZES = [7, 12, 5]  # three colayers; pieces of 2 elements: several slots each


@dataclass(frozen=True)
class Sent:
    """One message to node 0: sender ``y``, colayer ``z``, step ``k``, the header's iteration
    and relayed ζ, and its data (none: an empty packet)."""

    y: int
    z: int
    k: int
    it: int
    zeta: int
    zn: int
    data: tuple[tuple[Slot, Datum], ...]

    def message(self) -> Message:
        entries, arrays, _ = pack(self.data, get_codec("none"))
        meta = Header(self.y, 0, 0, self.z, 0, self.k, self.it, self.zeta, self.zn, False, "none").meta()
        meta["d"] = entries
        return decode(encode(kind="data", src=self.y, tag="canary.p", arrays=arrays, meta=meta))


def _exchange(gei: GEIMatrix) -> Exchange:
    topo = mesh(4)
    progress = Progress(iteration=lambda: T, zeta=lambda: (gei.zeta, gei.zeta_node), stopping=lambda: False,
                        on_header=lambda h: gei.heard(h.origin, h.it, h.zeta, h.zeta_node))
    return Exchange(transport=SimpleNamespace(node_id=ME, incarnation=1, scope=Mailbox().scope), fwd=None,  # type: ignore[arg-type]
                    layout=layout_for(topo, topo.ids), sizes=SIZES, codec=get_codec("none"), mode="native",
                    staleness=100.0, timeout=1.0, epoch=0, plan=0, progress=progress, piece=2)


def _round(rng: random.Random, ex: Exchange) -> list[Sent]:
    """A round's messages to node 0. Node 1 and node 2 are ahead (both reached iteration 9,
    which only their empty packets say), node 3 behind (iterations 4-5, relaying the ζ it
    heard). Step 0 brings a peer's own gradient of the slots node 0 owns (maybe two iterations
    summed), step 1 an owner's total of its slots (the contributions it holds, node 0's own
    left out: every peer's in colayer 0, a random part of them in the others)."""
    iters = {1: (7, 8), 2: (8, 8), 3: (4, 5)}
    knows = {1: (8, 2), 2: (8, 2), 3: (7, 2)}
    out = []
    for y in PEERS:
        for z in range(len(SIZES)):
            for k in (0, 1):
                slots = ex.flows[z].recv_slots(0, k, y)
                assert slots  # every (peer, step) carries slots of every colayer here
                it = rng.choice(iters[y])
                data = []
                for s in slots:
                    if k == 0:
                        n = rng.choice((1, 2))
                        mask, newest, oldest = node_bit(y), it, it - n + 1
                    else:
                        who = [p for p in PEERS if p == y or z == 0 or rng.random() < 0.6]
                        n, mask = len(who), sum(node_bit(p) for p in who)
                        newest, oldest = it, min(iters[p][0] for p in who)
                    vec = np.array([rng.randint(-9, 9) for _ in range(s.size)], np.float32)
                    data.append((s, Datum(vec, n, mask, newest, oldest)))
                out.append(Sent(y, z, k, it, *knows[y], tuple(data)))
                if y != 3 and rng.random() < 0.5:  # the fast ones: "already exchanged" empties at 9
                    out.append(Sent(y, z, k, 9, 9, y, ()))
                elif y == 3 and rng.random() < 0.3:  # the slow one: "still computing"
                    out.append(Sent(y, z, k, 5, 7, 2, ()))
    # both fast nodes announce iteration 9 at least once, so the tie at ζ is always there
    out += [Sent(1, 0, 1, 9, 9, 1, ()), Sent(2, 2, 0, 9, 9, 2, ())]
    return out


def _own(z: int) -> np.ndarray:
    return np.arange(SIZES[z], dtype=np.float32) * (z + 1)


def _expected(sent: list[Sent]) -> tuple[int, int, list[int], list[np.ndarray]]:
    """The spec's definitions, computed from the messages alone."""
    seen = [(T, ME)] + [(m.it, m.y) for m in sent] + [(m.zeta, m.zn) for m in sent]
    zeta = max(i for i, _ in seen)
    masks, sums = [], []
    ex = _exchange(GEIMatrix(len(SIZES), me=ME))
    for z, n in enumerate(SIZES):
        per_slot = {s.index: node_bit(ME) for s in ex.flows[z].slots}
        total = _own(z).astype(np.float64)
        for m in sent:
            for s, d in m.data:
                if m.z == z:
                    per_slot[s.index] |= d.mask
                    total[s.lo:s.hi] += d.vec
        r = -1
        for bits in per_slot.values():
            r &= bits
        masks.append(r)
        sums.append(total)
    return zeta, min(n for i, n in seen if i == zeta), masks, sums


def _play(order: list[Sent | int]) -> tuple[GEIMatrix, Exchange, list[np.ndarray]]:
    gei = GEIMatrix(len(SIZES), me=ME)
    gei.see(T)
    ex = _exchange(gei)
    for item in order:
        if isinstance(item, int):  # node 0's backward produced colayer ``item``
            ex.contribute(item, T, _own(item))
        else:
            ex._ingest(item.message(), item.z, 0, item.k, item.y)
    sums = []
    for z in range(len(SIZES)):
        s, _, mask, _ = ex.collect(z)
        gei.record(T, z, mask)
        sums.append(s)
    return gei, ex, sums


@pytest.mark.parametrize("seed", range(3))
def test_zeta_and_masks_do_not_depend_on_the_order_of_arrival(seed):
    rng = random.Random(seed)
    sent = _round(rng, _exchange(GEIMatrix(len(SIZES))))
    zeta, fastest, masks, sums = _expected(sent)
    empties = sum(1 for m in sent if not m.data)
    assert zeta == 9 and fastest == 1  # nodes 1 and 2 both reached 9: the lowest id
    assert all(m.it < 9 and m.zeta < 9 for m in sent if m.data)  # only empty packets said 9
    assert masks[0] == full_mask(4) and any(r != full_mask(4) for r in masks)  # complete and incomplete colayers
    items: list[Sent | int] = [*sent, *range(len(SIZES))]
    for _ in range(60):
        rng.shuffle(items)
        gei, ex, got = _play(items)
        assert (gei.zeta, gei.zeta_node) == (zeta, fastest)
        assert gei.row(T) == masks and set(gei.rows) == {T}  # every contribution in the receiver's row
        assert all(r & node_bit(ME) for r in masks)  # its own bit: its gradient is in every slot
        for g, want in zip(got, sums):
            assert np.array_equal(g, want)
        assert ex.stats.empties_recv == empties and ex.stats.stale == 0


def test_an_empty_packet_raises_zeta_and_sets_no_bit():
    """§6.5: "EMPTY messages carry iter (it feeds ζ) and no payload, and they set no GEI bit"."""
    gei, ex, sums = _play([*range(len(SIZES)), Sent(3, 1, 0, 11, 11, 3, ())])
    assert (gei.zeta, gei.zeta_node) == (11, 3)
    assert gei.row(T) == [node_bit(ME)] * len(SIZES)  # its own contribution only
    assert ex.stats.empties_recv == 1
    assert all(np.array_equal(s, _own(z)) for z, s in enumerate(sums))
