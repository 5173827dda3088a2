"""bench/preduce.py's pure parts: time to target, updates at a time, medians, the target lines."""

from __future__ import annotations

import math

from bench import preduce as b

AR, CON3, DYN3, CON5 = b.CONFIGS[0], b.CONFIGS[1], b.CONFIGS[2], b.CONFIGS[3]


def _node(times_accs, key="last_op", start=0):
    return [{"time": t, "step": i + 1, key: start + 2 * (i + 1), **({"accuracy": a} if a is not None else {})}
            for i, (t, a) in enumerate(times_accs)]


def test_first_reach_and_updates_at():
    recs = _node([(1.0, 0.5), (2.0, None), (3.0, 0.95), (4.0, 0.99)])
    assert b.first_reach(recs, 0.9) == 3.0 and b.first_reach(recs, 0.999) == math.inf
    nodes = [recs, _node([(1.5, 0.9), (2.5, 0.92)], start=10)]
    assert b.updates_at(nodes, 2.6, preduce=True) == 14  # the largest P-reduce number joined by then
    assert b.updates_at(nodes, 2.6, preduce=False) == 2  # AR: steps
    assert b.updates_at(nodes, math.inf, preduce=True) is None
    # a record's "op" (the group it just joined) counts even where "last_op" lags or is absent
    assert b.updates_at([[{"time": 1.0, "step": 1, "op": 7}], [{"time": 1.0, "step": 1, "last_op": 5}]],
                        1.0, preduce=True) == 7


def test_analyse_takes_the_lower_median_node_and_per_update_time():
    nodes = [_node([(1.0, 0.95)]), _node([(2.0, 0.95)]), _node([(3.0, 0.95)]), _node([(9.0, 0.5)])]
    o = b.analyse(CON3, 3, nodes, 0.9)
    assert o.to_target == 2.0 and o.all_target == math.inf and o.updates == 2
    assert o.per_update_s == 1.0
    assert b.combine([o, b.analyse(CON3, 3, [_node([(4.0, 0.95)])] * 4, 0.9)]).to_target == 3.0


def test_step_times_give_hl_workers_a_shared_device():
    assert b.step_times(4, 3, 0.05) == "0:0.05,1:0.15,2:0.15,3:0.15"
    assert b.step_times(4, 1, 0.05) == "0:0.05,1:0.05,2:0.05,3:0.05"


def test_target_lines():
    res = [b.Outcome(AR, 3, 9.0, 9.0, 45, 0.95), b.Outcome(CON3, 3, 3.0, 4.0, 100, 0.95),
           b.Outcome(DYN3, 3, 3.5, 4.0, 90, 0.95), b.Outcome(CON5, 3, 4.0, 4.0, 60, 0.95)]
    lines = "\n".join(b.targets(res))
    assert "3.00x faster than AR" in lines and "PASS" in lines.splitlines()[0]
    assert "DYN P=3 90 vs CON P=3 100 (DYN <= CON): PASS" in lines
    assert "per-update 30 -> 67 ms (rises), updates 100 -> 60 (fall): PASS" in lines
    assert "not reached" in b.report([b.Outcome(CON3, 1, math.inf, math.inf, None, 0.5)], 0.9)
