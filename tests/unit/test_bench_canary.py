"""bench/canary.py's pure parts: peak NIC rate, bytes per iteration, the target lines, the
Canary colayer options."""

from __future__ import annotations

import math

from bench import canary as b


def _node(points, accs=None, **extra):
    """points: (time, {nic: sent bytes}) cumulative; ``extra`` in every record (a strategy's)."""
    accs = accs or {}
    return [{"time": t, "step": i, "nics": {k: {"sent": v} for k, v in nics.items()},
             **({"accuracy": accs[i]} if i in accs else {}), **extra} for i, (t, nics) in enumerate(points)]


def test_peak_rate_takes_the_busiest_nic_over_one_second_windows():
    recs = _node([(0.0, {"l0": 0, "l1": 0}), (0.5, {"l0": 100, "l1": 0}), (1.0, {"l0": 100, "l1": 50}),
                  (2.0, {"l0": 100, "l1": 1050}), (3.0, {"l0": 2100, "l1": 1050})])
    assert b.peak_rate(recs) == 2000.0  # l0 between 2.0 s and 3.0 s
    assert b.peak_rate(recs[:2]) == 0.0  # no window of a second yet


def test_analyse_counts_bytes_per_iteration_and_the_median_node():
    nodes = [_node([(0.0, {"l0": 0}), (1.0, {"l0": 1000}), (2.0, {"l0": 2000})], {2: 0.95}) for _ in range(3)]
    nodes.append(_node([(0.0, {"l0": 0}), (1.0, {"l0": 1000}), (9.0, {"l0": 2000})], {2: 0.5}))
    o = b.analyse(b.CONFIGS[1], "2x2", nodes, 0.9, nic_mbps=0.008)  # 1000 bytes/s capacity
    assert o.to_target == 2.0 and o.iterations == 12 and o.bytes_per_iter == 1000  # steps 1 (of 0-2)
    assert o.peak_util == 1.0 and math.isclose(o.final_acc, (0.95 * 3 + 0.5) / 4)


def test_bytes_per_iteration_leave_out_the_first_and_last_steps():
    """The start's broadcast (step 0) and a stop's state averaging (the last step) are shown
    apart, per node; with fewer than three records everything counts."""
    recs = _node([(0.0, {"l0": 5000, "l1": 0}), (1.0, {"l0": 5100, "l1": 100}), (2.0, {"l0": 5200, "l1": 200}),
                  (3.0, {"l0": 5300, "l1": 300}), (4.0, {"l0": 9000, "l1": 3000})])
    assert b.steady(recs) == (600, 3, 12000 - 600)  # steps 1-3
    assert b.steady(recs[:2]) == (5200, 2, 0) and b.steady([]) == (0, 0, 0)
    o = b.analyse(b.CONFIGS[1], "2x2", [recs, recs], 0.9, nic_mbps=1.0)
    assert o.bytes_per_iter == 200 and o.iterations == 10 and o.ends_bytes == 11400
    table = b.report([o], 0.9).splitlines()
    col = table[0].split(" | ").index("first + last step (MB per node)")
    assert table[2].split(" | ")[col] == "0.0"  # 11400 bytes


def test_target_lines():
    bsp = b.Outcome(b.CONFIGS[0], "2x2", 10.0, 0.95, 1e6, 0.9, 100)
    can = b.Outcome(b.CONFIGS[1], "2x2", 5.0, 0.948, 2e5, 0.3, 300)
    lines = b.targets([bsp, can])
    assert "Canary (sketch): traffic per iteration 80% below" in lines[0] and lines[0].endswith("PASS")
    assert "2.00x sooner" in lines[1] and lines[1].endswith("PASS")
    assert "(0.2 points below BSP;" in lines[2] and lines[2].endswith("PASS")
    better = b.Outcome(b.CONFIGS[1], "2x2", 5.0, 0.958, 2e5, 0.3, 300)
    assert "(0.8 points above BSP;" in b.targets([bsp, better])[2]
    level = b.Outcome(b.CONFIGS[1], "2x2", 5.0, 0.95, 1.5e6, 0.3, 300)
    assert "(level with BSP;" in b.targets([bsp, level])[2]
    assert "traffic per iteration 50% above BSP's" in b.targets([bsp, level])[0]
    slow = b.Outcome(b.CONFIGS[1], "2x2", math.inf, 0.90, 9e5, 0.3, 300)
    assert b.targets([bsp, slow])[0].endswith("FAIL") and "not reached by Canary" in b.targets([bsp, slow])[1]
    six = b.Outcome(next(c for c in b.CONFIGS if c.label == "Canary (6-bit sketch)"), "2x2", 6.0, 0.95, 1e5, 0.2, 280)
    assert [ln.split(":")[0] for ln in b.targets([bsp, can, six])][3:] == ["- BCube(2x2) Canary (6-bit sketch)"] * 3


def test_canary_runs_with_several_colayers_and_a_p_below_their_number():
    """The MLP's two layers, one colayer each (the automatic rule makes one: nothing to
    pipeline), and p = round(0.6 k) within [1, k]: 1 of 2 (the paper's 6 of 10)."""
    assert b.colayer_opts(2, None) == ["--opt", "colayers=2", "--opt", "p=1"]
    assert b.colayer_opts(10, None)[-1] == "p=6" and b.colayer_opts(1, None)[-1] == "p=1"
    assert b.colayer_opts(2, 2)[-1] == "p=2"
    assert b.colayer_opts(0, None) == []  # Canary's automatic rule and default p
    assert all(c.argv[:2] == b.CANARY for c in b.CONFIGS[1:]) and b.CONFIGS[0].argv[:2] != b.CANARY
    assert any(c.argv[-2:] == ("--codec", "sketch8p") for c in b.CONFIGS)  # the paper's sketch has a row
    # the Canary rows take --colayers (default: Canary's automatic rule); the last row is split
    split = b.CONFIGS[-1]
    assert b.config_opts(split, 0, None) == b.config_opts(split, 1, 1) == ["--opt", "colayers=2", "--opt", "p=1"]
    assert b.config_opts(b.CONFIGS[1], 0, None) == [] and b.config_opts(b.CONFIGS[0], 2, None) == []
    assert b.config_opts(b.CONFIGS[1], 2, None) == ["--opt", "colayers=2", "--opt", "p=1"]


def test_the_table_shows_colayers_and_decisions():
    nodes = [_node([(0.0, {"l0": 0}), (1.0, {"l0": 1000})], {1: 0.9}, colayers=2, branches={"A": 5, "B": k, "C": 1})
             for k in (0, 2)]
    o = b.analyse(b.CONFIGS[1], "2x2", nodes, 0.95, nic_mbps=1.0)
    assert o.colayers == 2 and o.branches == {"A": 10, "B": 2, "C": 2}
    bsp = b.analyse(b.CONFIGS[0], "2x2", [_node([(0.0, {"l0": 0}), (1.0, {"l0": 3000})], {1: 0.9})], 0.95, 1.0)
    rows = b.report([bsp, b.combine([o, o])], 0.95).splitlines()
    assert rows[2].endswith("| - | - |") and rows[3].endswith("| 2 | 20/4/4 |")
