"""bench/faults.py's and bench/_netns.py's pure parts: processes and wall times from records,
recovery after a heal, the coordinators' declarations and the launcher's restarts in logs, the
veths of a ring link."""

from __future__ import annotations

import pytest

from bench import faults as b
from bench._netns import link_ends
from p2psync.topology import ring


def _rec(t, step, samples=0):
    return {"time": t, "step": step, "samples": samples}


def test_incarnations_split_where_time_goes_back_and_take_the_earliest_start():
    seen = [(100.3, _rec(0.2, 1)), (100.9, _rec(0.5, 2)), (101.0, _rec(0.9, 3)),  # seen late, then at once
            (120.0, _rec(0.1, 50)), (120.5, _rec(0.6, 51))]  # a new process (its time starts again)
    incs = b.incarnations(seen)
    assert [len(i) for i in incs] == [3, 2]
    assert [round(w, 3) for w, _ in incs[0]] == [100.3, 100.6, 101.0]  # start 100.1 (from the last)
    assert [round(w, 3) for w, _ in incs[1]] == [120.0, 120.5]


def test_recovery_counts_a_restarted_node_from_its_new_process():
    heal = 50.0
    procs = {
        0: [[(49.0, _rec(9.0, 90)), (50.4, _rec(10.4, 91))]],
        1: [[(49.5, _rec(9.5, 95)), (51.0, _rec(11.0, 96))]],
        # node 2: its old process stepped once after the heal (void), its new one at 57
        2: [[(40.0, _rec(1.0, 10)), (50.2, _rec(11.2, 11))], [(57.0, _rec(0.5, 96)), (57.1, _rec(0.6, 97))]],
    }
    assert b.recovery_s(procs, {0, 1, 2}, heal) == pytest.approx(7.0)
    assert b.recovery_s(procs, {0, 1}, heal) == pytest.approx(1.0)
    assert b.recovery_s(procs, {0, 1, 3}, heal) is None  # a finished node without records
    assert b.recovery_s({0: [[(49.0, _rec(9.0, 90))]]}, {0}, heal) is None  # no step after the heal
    assert b.total_samples({0: [[(1.0, _rec(1, 1, 16)), (2.0, _rec(2, 2, 32))], [(3.0, _rec(1, 3, 16))]]}) == 48


def test_declared_failed_and_restarts_from_logs():
    logs = ["x\ncoordinator 0: nodes [2] silent for [2.1] s: declared failed; view epoch 7 members [0, 1, 3]\n",
            "coordinator 1: nodes [0, 3] reported failed by node 2: declared failed; view epoch 9 members [1, 2]\n"
            "node 1: peer 0 failed (at 12.5)\n"]
    assert b.declared_failed(logs) == [2, 0, 3]
    err = ("node 2 was removed from the run (node 2 was removed from the run: coordinator 0 answered ...); "
           "starting it again (1/3): it rejoins with the majority's state\n"
           "node 3 was removed from the run (fenced); starting it again (1/3): it rejoins\n")
    assert b.restarts(err) == [2, 3]
    assert b.Case("ssgd", b.FAULTS["split-2-2"], declared=[2]).false_detections == 0  # cut off from node 0
    assert b.Case("ssgd", b.FAULTS["split-2-2"], declared=[1]).false_detections == 1  # on its side
    assert b.Case("ssgd", b.FAULTS["split-3-1"], declared=[3, 3, 0]).false_detections == 1


def test_link_ends_name_both_veths_of_a_ring_link():
    topo = ring(4, subnet="198.18.0.0/16")
    ends = link_ends(topo, 3, 0, "p2p")
    assert [ns for ns, _ in ends] == ["p2pn3", "p2pn0"]
    for ns, dev in ends:
        node = int(ns[len("p2pn"):])
        j = int(dev.split("v")[1])
        nic = topo.node(node).nics[j]
        assert set(topo.members(nic.network)) == {0, 3}
    with pytest.raises(ValueError):
        link_ends(topo, 0, 2, "p2p")

