"""bench/wan.py's pure parts: WAN profiles, the Table 1 model, and measuring a (fake) run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import wan
from p2psync.topology import load
from p2psync.training.metrics import MetricsWriter
from p2psync.transport.shaping import load_wan_profile

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "topologies" / "ring-4.json"


def test_uniform_and_scaled_profiles_load_as_one_way_latency(tmp_path):
    topo = load(RING)
    path = tmp_path / "u.json"
    path.write_text(json.dumps(wan.scale_profile(wan.uniform_profile(200.0), 5.0)))
    specs = load_wan_profile(path, topo)
    assert {round(s.latency_s, 9) for s in specs.values()} == {0.04}
    assert wan.model_comm_s(path, topo, "auto") == pytest.approx(6 * 0.04)  # 2(N-1) hops
    assert wan.model_comm_s(path, topo, "tree") is None


def test_presets_load():
    topo = load(RING)
    paper = load_wan_profile(ROOT / "topologies" / "wan-paper-200ms.json", topo)
    assert {s.latency_s for s in paper.values()} == {0.2}
    regions = {k: v.latency_s for k, v in load_wan_profile(ROOT / "topologies" / "wan-4-regions.json", topo).items()}
    # ring 0-1-2-3-0 one way: 105, 65, 25, 77.5 ms; the slowest 6 consecutive hops start at 3-0
    assert wan.ring_comm_s(regions, [0, 1, 2, 3]) == pytest.approx(0.0775 + 0.105 + 0.065 + 0.025 + 0.0775 + 0.105)


def test_table1_model_matches_spec_examples():
    # shared/specs/dts.md §2.2: T_compute 300 ms, T_comm 479 ms
    assert wan.table1_scalability(0.3, 0.479, wan.Config("ssgd")) == pytest.approx(0.385, abs=1e-3)
    assert wan.table1_scalability(0.3, 0.479, wan.Config("dts", 1, 4)) == pytest.approx(0.870, abs=1e-3)
    assert wan.table1_scalability(0.3, 0.479, wan.Config("dts", 2, 1)) == 1.0


def test_expected_bytes_and_cli():
    assert [c.expected_bytes_ratio(0.9) for c in wan.CONFIGS] == [1.0, 1.0, 0.5, 0.5]
    assert wan.Config("dts", 0, 4).expected_bytes_ratio(0.0) == 0.25
    assert wan.Config("dts", 4, 4).cli() == ["--strategy", "dts", "--opt", "t=4", "--opt", "p=4"]


def test_steady_window():
    assert wan.steady_window(range(1, 33), 8, 4) == (8, 28)  # the last step (flush, eval) is left out
    assert wan.steady_window(range(1, 6), 8, 4) == (1, 4)
    with pytest.raises(ValueError):
        wan.steady_window([1, 2], 0, 1)


def test_measure_fake_run(tmp_path):
    for node in range(2):
        w = MetricsWriter(tmp_path / f"node-{node}.jsonl")
        for step in range(1, 13):
            w.write({"node": node, "step": step, "time": 0.5 * step + (3.0 if step == 12 else 0.0),
                     "nics": {"a": {"sent": 1000 * step + 7 * node}, "b": {"sent": 10 * step}}})
        w.close()
    (tmp_path / "summary.json").write_text(json.dumps({"nodes": {"0": {"final_accuracy": 0.9},
                                                                 "1": {"final_accuracy": 0.8}}}))
    m = wan.measure(tmp_path, [0, 1], warmup=3, period=4)
    assert m.step_s == pytest.approx(0.5) and m.bytes_per_step == pytest.approx(1010)
    assert m.accuracy == pytest.approx(0.85) and m.acc_spread == pytest.approx(0.1)
    assert wan.scalability(m, 0.25) == pytest.approx(0.5)


def test_preflight_names_what_the_cli_rejects():
    assert wan.preflight(["run", str(RING), "--codec", "fp16"]) is None
    assert "codec" in (wan.preflight(["run", str(RING), "--codec", "no-such-codec"]) or "")


def test_a_language_model_runs_with_momentum_sgd_and_compares_validation_bpb(tmp_path):
    """``--model lm-tiny``: the CLI gets the model, its corpus and plain momentum SGD (DTS's
    compensation is defined for it only) and no ``--lr`` (the model's own); the run's final
    ``val_bpb`` is what is measured, and lower is better in the comparison."""
    args = wan.build_parser().parse_args(["--model", "lm-tiny", "--scale", "5"])
    argv = wan.common_argv(args, tmp_path, "x", 10)
    assert argv[argv.index("--model") + 1] == "lm-tiny" and argv[argv.index("--data") + 1] == "pysource"
    assert argv[argv.index("--optimizer") + 1] == "sgd" and "--lr" not in argv
    assert wan.preflight(argv) is None
    assert wan.t_compute_s(args) == pytest.approx(0.3) and wan.metric(args) == "val_bpb"
    mlp = wan.build_parser().parse_args([])
    assert "--lr" in wan.common_argv(mlp, tmp_path, "x", 10) and wan.t_compute_s(mlp) == pytest.approx(0.06)
    w = MetricsWriter(tmp_path / "node-0.jsonl")
    for step in range(1, 6):
        w.write({"node": 0, "step": step, "time": float(step), "nics": {"a": {"sent": step}}})
    w.close()
    (tmp_path / "summary.json").write_text(json.dumps({"nodes": {"0": {"final_accuracy": 0.1,
                                                                       "final_val_bpb": 3.5}}}))
    assert wan.measure(tmp_path, [0], warmup=1, period=1, metric="val_bpb").accuracy == pytest.approx(3.5)
    assert wan.accuracy_delta(3.6, 3.5, lm=True)[1] and not wan.accuracy_delta(3.7, 3.5, lm=True)[1]
    assert wan.accuracy_delta(3.0, 3.5, lm=True)[1]  # lower bpb is better
    assert wan.accuracy_delta(0.896, 0.9, lm=False)[1] and not wan.accuracy_delta(0.89, 0.9, lm=False)[1]
