"""The piece machine's decisions, without IO: a table of cases per decision (which payload a
send takes and how it is checked, what becomes of an arrived piece, what a completed step
releases, when the owner seals), whole walks of real schedules, and a lockstep simulation of
every node of a plan driven by the machines alone, whose sums must be the allreduce's."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.collectives.piece_machine import (
    Apply, Check, Exchange, Expect, Hold, Payload, PieceMachine, Release, Seal, Verdict,
)
from p2psync.collectives.plan import Transfer, make_plan
from p2psync.collectives.schedule import Step, schedule
from p2psync.topology import mesh, ring, star


def _step(phase: str = "rs0", sends: tuple[bool, ...] = (), incoming: tuple[tuple[int, bool], ...] = (),
          defer: bool = False) -> Step:
    """A step of node 0 for piece 0: one send per entry of ``sends`` (its ``reduce``)."""
    ts = tuple(Transfer(0, d + 1, "eth0", 0, 1, reduce=r) for d, r in enumerate(sends))
    return Step(phase=phase, sends=ts, send_suffix=f".{phase}.0.0", incoming=incoming,
                expects=tuple(Expect(s, f".{phase}.{s}.0", r) for s, r in incoming), defer=defer)


def _machine(steps: tuple[Step, ...], *, lossy: bool = False, fused: bool = True, fresh: bool = False,
             seal: bool = False, clean: bool = False, cached: bool = False, held: bool = False) -> PieceMachine:
    m = PieceMachine(steps, lossy=lossy, fused=fused, fresh=fresh, seal=seal)
    m.clean, m.cached, m.held = clean, cached, held
    return m


# -- which payload a send takes, and how its values are checked ----------------------------

SEND_CASES = [
    # (lossy, fresh, held, clean, cached, reduce) -> (payload, check)
    pytest.param(False, True, False, False, False, True, Payload.OWN_FILL, Check.YES, id="fresh: own fill"),
    pytest.param(False, True, False, False, False, False, Payload.OWN_FILL, Check.YES, id="fresh copy: own fill"),
    pytest.param(False, False, True, False, False, True, Payload.SUM_FILL, Check.YES, id="held: sum fill"),
    pytest.param(False, True, True, False, False, True, Payload.SUM_FILL, Check.YES, id="held and fresh: sum fill"),
    pytest.param(False, False, False, True, False, True, Payload.ENCODE, Check.YES, id="lossless clean: no scan"),
    pytest.param(False, False, False, False, False, True, Payload.ENCODE, Check.SCAN, id="lossless unknown: scan"),
    pytest.param(True, False, False, False, False, True, Payload.ENCODE, Check.NO, id="lossy: transport scans"),
    pytest.param(True, False, False, True, False, False, Payload.ENCODE, Check.NO, id="lossy uncached copy"),
    pytest.param(True, False, False, False, True, False, Payload.CACHED, Check.NO, id="lossy cached copy"),
    pytest.param(True, False, False, False, True, True, Payload.ENCODE, Check.NO, id="lossy cached reduce: encode"),
]


@pytest.mark.parametrize("lossy,fresh,held,clean,cached,reduce,payload,check", SEND_CASES)
def test_send_payload_and_check(lossy, fresh, held, clean, cached, reduce, payload, check):
    m = _machine((_step(sends=(reduce, reduce)),), lossy=lossy, fused=not lossy, fresh=fresh, clean=clean,
                 cached=cached, held=held)
    ex = m.next()
    assert isinstance(ex, Exchange)
    assert [(s.payload, s.check) for s in ex.sends] == [(payload, check)] * 2
    assert ex.fill is (payload if payload in (Payload.OWN_FILL, Payload.SUM_FILL) else None)
    assert ex.base_mine is fresh and not ex.single


def test_a_scan_that_finds_the_piece_finite_makes_it_clean_for_the_next_step():
    m = _machine((_step(sends=(True,)), _step("rs1", sends=(True,))))
    assert m.next().sends[0].check is Check.SCAN
    m.scanned(True)
    m.exchanged(False)
    assert m.next().sends[0].check is Check.YES


def test_a_scan_that_finds_a_nan_leaves_the_piece_unknown():
    m = _machine((_step(sends=(True,)), _step("rs1", sends=(True,))))
    m.next()
    m.scanned(False)
    m.exchanged(False)
    assert m.next().sends[0].check is Check.SCAN


# -- what becomes of an arrived piece ------------------------------------------------------

ARRIVE_CASES = [
    # (lossy, fused, defer, fresh, reduce) -> action, clean after (None: as reported by applied())
    pytest.param(False, True, True, True, True, Hold(), None, id="deferred partial sum: held"),
    pytest.param(False, True, False, True, True, Apply(True, True, False, Verdict.SCAN), None,
                 id="fused first sum: onto own values, scanned"),
    pytest.param(False, True, False, False, True, Apply(True, False, False, Verdict.SCAN), None,
                 id="fused sum: scanned"),
    pytest.param(False, True, False, True, False, Apply(False, True, False, Verdict.SCAN), None,
                 id="fused copy: scanned"),
    pytest.param(False, False, False, False, True, Apply(True, False, False, Verdict.DIRTY), False,
                 id="checked lossless sum: dirty"),
    pytest.param(False, False, False, False, False, Apply(False, False, False, Verdict.CLEAN), True,
                 id="checked lossless copy: clean"),
    pytest.param(True, False, False, False, False, Apply(False, False, True, Verdict.CLEAN), True,
                 id="lossy copy: cached, clean"),
    pytest.param(True, False, False, False, True, Apply(True, False, False, Verdict.DIRTY), False,
                 id="lossy sum: not cached, dirty"),
]


@pytest.mark.parametrize("lossy,fused,defer,fresh,reduce,action,clean", ARRIVE_CASES)
def test_arrived(lossy, fused, defer, fresh, reduce, action, clean):
    m = _machine((_step(incoming=((1, reduce),), defer=defer),), lossy=lossy, fused=fused, fresh=fresh,
                 clean=not clean if clean is not None else True)
    ex = m.next()
    assert ex.expects == (Expect(1, ".rs0.1.0", reduce),) and ex.single
    m.exchanged(False)
    got = m.arrived(ex.expects[0])
    assert got == action
    if isinstance(got, Hold):
        assert m.held and m.fresh is fresh
        return
    assert not m.fresh
    assert m.cached is got.cache
    if clean is None:
        for finite in (True, False):
            m.applied(finite)
            assert m.clean is finite
    else:
        assert m.clean is clean


# -- what a completed step does to the piece -----------------------------------------------

EXCHANGED_CASES = [
    # (fresh, held, fill owned) -> (release, fresh after, clean after)
    pytest.param(True, False, True, False, False, True, id="own fill into buf: clean, not fresh"),
    pytest.param(True, False, False, False, True, False, id="own fill into a ring: still fresh"),
    pytest.param(False, True, True, True, False, True, id="sum fill into buf: release, clean"),
    pytest.param(True, True, False, True, False, False, id="sum fill into a ring: release, not fresh"),
]


@pytest.mark.parametrize("fresh,held,owned,release,fresh_after,clean_after", EXCHANGED_CASES)
def test_exchanged(fresh, held, owned, release, fresh_after, clean_after):
    m = _machine((_step(sends=(True,)),), fresh=fresh, held=held)
    ex = m.next()
    assert ex.sends[0].payload in (Payload.OWN_FILL, Payload.SUM_FILL)
    assert (m.exchanged(owned) == Release()) is release
    assert (m.fresh, m.clean, m.held) == (fresh_after, clean_after, False)


def test_a_step_without_a_fill_releases_nothing_and_changes_nothing():
    m = _machine((_step(sends=(True,)),), clean=True)
    m.next()
    assert m.exchanged(True) is None
    assert (m.fresh, m.clean) == (False, True)


def test_several_sends_and_receives_are_gathered():
    m = _machine((_step(sends=(False, False), incoming=((3, True), (5, True))),))
    ex = m.next()
    assert not ex.single and len(ex.sends) == 2 and [e.src for e in ex.expects] == [3, 5]


# -- sealing -------------------------------------------------------------------------------

SEAL_CASES = [
    # phases of the piece's steps, seal -> the actions' kinds in order
    pytest.param(("rs0", "ag0"), True, ["rs0", "seal", "ag0"], id="before the first allgather step"),
    pytest.param(("rs0", "rs1", "ag0", "ag1"), True, ["rs0", "rs1", "seal", "ag0", "ag1"], id="once"),
    pytest.param(("rs0",), True, ["rs0", "seal"], id="no allgather step: at the end"),
    pytest.param((), True, ["seal"], id="no step at all"),
    pytest.param(("rs0", "ag0"), False, ["rs0", "ag0"], id="not the owner"),
]


@pytest.mark.parametrize("phases,seal,want", SEAL_CASES)
def test_seal(phases, seal, want):
    m = _machine(tuple(_step(ph, sends=(ph.startswith("rs"),)) for ph in phases), lossy=True, fused=False,
                 seal=seal)
    got = []
    while (act := m.next()) is not None:
        got.append("seal" if isinstance(act, Seal) else act.phase)
        if isinstance(act, Exchange):
            if act.phase.startswith("ag"):  # what the owner sealed is what it sends
                assert (act.sends[0].payload is Payload.CACHED) is seal
            m.exchanged(False)
    assert got == want


# -- whole schedules -----------------------------------------------------------------------

def test_a_fused_ring_sends_own_values_and_partial_sums_straight_on():
    """Ring of 3, fused, every node and piece: the walks send pieces from the caller's values
    (own fill), hold received partial sums and send them on added in (sum fill), and copy the
    final values over the working buffer."""
    topo = ring(3)
    plan = make_plan(topo, (0, 1, 2), 3, "ring")
    kinds = set()
    for me in range(3):
        sched = schedule(plan, me, 3, ("rs", "ag"), fused=True)
        for steps in sched.pieces:
            m = PieceMachine(steps, lossy=False, fused=True, fresh=True, seal=False)
            while (ex := m.next()) is not None:
                kinds.update(s.payload for s in ex.sends)
                m.exchanged(True)
                for e in ex.expects:
                    act = m.arrived(e)
                    kinds.add(type(act).__name__ if isinstance(act, Hold) else (act.reduce, act.base_mine))
                    if isinstance(act, Apply):
                        m.applied(True)
            assert not m.held
    assert {Payload.OWN_FILL, Payload.SUM_FILL, "Hold", (False, False)} <= kinds


def _simulate(plan, pieces: int, *, lossy: bool, fused: bool, fresh: bool, seed: int = 0) -> list[np.ndarray]:
    """Every node of ``plan`` driven by its machines alone, in lockstep: a send computes its
    values from what the actions say (own values, held sum plus base, the buffer, the cache);
    an arrival is applied as the machine says. Returns every node's buffer."""
    group = plan.group
    rng = np.random.default_rng(seed)
    n = pieces * 2
    bounds = np.linspace(0, n, pieces + 1).astype(int)
    src = {me: rng.integers(-50, 50, n).astype(np.float64) for me in group}
    buf = {me: (np.zeros(n) if fresh else src[me].copy()) for me in group}
    cache: dict[tuple[int, int], np.ndarray] = {}
    mailbox: dict[str, np.ndarray] = {}
    state = {}
    for me in group:
        sched = schedule(plan, me, pieces, ("rs", "ag"), fused=fused)
        for k, steps in enumerate(sched.pieces):
            state[me, k] = [PieceMachine(steps, lossy=lossy, fused=fused, fresh=fresh, seal=lossy and k in sched.owned),
                            None, None]  # machine, pending exchange, held values

    def piece(me, k):
        return buf[me][bounds[k]:bounds[k + 1]]

    def mine(me, k):
        return src[me][bounds[k]:bounds[k + 1]]

    for _ in range(10 * len(state)):
        progressed = False
        for (me, k), st in state.items():
            m, ex, held = st
            if ex is None:
                act = m.next()
                if act is None:
                    continue
                progressed = True
                if isinstance(act, Seal):
                    cache[me, k] = piece(me, k).copy()
                    continue
                ex = st[1] = act
                for s in ex.sends:
                    if s.payload is Payload.OWN_FILL:
                        vals = mine(me, k).copy()
                    elif s.payload is Payload.SUM_FILL:
                        vals = (mine(me, k) if ex.base_mine else piece(me, k)) + held
                    elif s.payload is Payload.CACHED:
                        vals = cache[me, k]
                    else:
                        vals = piece(me, k).copy()
                    mailbox[f"{ex.send_suffix}>{s.transfer.dst}"] = vals
                    if s.check is Check.SCAN:
                        m.scanned(True)
                fills = [s for s in ex.sends if s.payload in (Payload.OWN_FILL, Payload.SUM_FILL)]
                if fills:  # a fill computes into the buffer
                    piece(me, k)[...] = vals
            keys = [f"{e.suffix}>{me}" for e in ex.expects]
            if not all(key in mailbox for key in keys):
                continue
            progressed = True
            st[1] = None
            if isinstance(m.exchanged(True), Release):
                st[2] = None
            for e, key in zip(ex.expects, keys):
                vals = mailbox.pop(key)
                act = m.arrived(e)
                if isinstance(act, Hold):
                    st[2] = vals
                    continue
                if act.reduce:
                    np.add(mine(me, k) if act.base_mine else piece(me, k), vals, out=piece(me, k))
                else:
                    piece(me, k)[...] = vals
                if act.cache:
                    cache[me, k] = vals
                if act.verdict is Verdict.SCAN:
                    m.applied(True)
        if not progressed:
            break
    assert not mailbox and all(st[1] is None and st[0].next() is None for st in state.values())
    for (me, k), st in state.items():
        if st[0].fresh:
            piece(me, k)[...] = mine(me, k)
    return [buf[me] for me in group], sum(src.values())


@pytest.mark.parametrize("topo,algo", [(ring(4), "ring"), (mesh(4), "mesh"), (star(4), "star"), (ring(5), "tree")])
@pytest.mark.parametrize("lossy,fused,fresh", [(False, True, True), (False, True, False), (False, False, False),
                                               (True, False, False)])
def test_the_machines_alone_make_an_allreduce(topo, algo, lossy, fused, fresh):
    group = tuple(range(len(topo.nodes)))
    pieces = 2 * len(group)
    plan = make_plan(topo, group, pieces, algo)
    bufs, want = _simulate(plan, pieces, lossy=lossy, fused=fused, fresh=fresh)
    for b in bufs:
        np.testing.assert_array_equal(b, want)
