"""bench/diloco.py's pure parts: a row from node records, the table and the target lines."""

from __future__ import annotations

from bench.diloco import configs, reduce, report


def _node(bytes_per_step: float, acc: list[float], *, waits: list[float], dt: float = 0.1) -> list[dict]:
    recs, cum = [], 0.0
    for i, w in enumerate(waits):
        cum += w
        rec = {"step": i + 1, "time": dt * (i + 1), "wait_s": cum, "comm_s": cum,
               "nics": {"a": {"sent": int(bytes_per_step * (i + 1))}}}
        if i < len(acc):
            rec["accuracy"] = acc[i]
        recs.append(rec)
    return recs


def test_rows_ratios_and_verdicts():
    ssgd = reduce("ssgd", 200.0, [_node(1000, [0.5, 0.9], waits=[0.3] * 4)] * 2, 0.02)
    e3 = reduce("diloco-e3m0", 200.0, [_node(2.5, [0.9, 0.91], waits=[0.0, 0.0, 0.05, 3.0])] * 2, 0.02)
    assert ssgd.bytes_per_step == 1000 and ssgd.waited == 1.0 and ssgd.quality == 0.9 and ssgd.metric == "accuracy"
    assert e3.waited == 1 / 3 and e3.steps == 4  # the last step's final full sync is not counted
    table, lines = report([ssgd, e3], 50)
    assert "400x" in table and "2.00x" in table  # bytes ratio; reached 0.9 at 0.1 s vs 0.2 s
    assert any("400x over the whole run" in ln and ln.endswith("PASS") for ln in lines)  # (no steady window in 4 steps)
    assert any(ln.startswith("diloco-e3m0 accuracy at ssgd's 4 steps") and ln.endswith("PASS") for ln in lines)


def test_every_configuration_names_its_strategy():
    keys = [c.key for c in configs(50, 0.003)]
    assert keys[:2] == ["ssgd", "dts"] and "hetero-dylu" in keys
    assert all("--strategy" in c.args for c in configs(50, 0.003))


def test_a_language_model_is_judged_by_validation_bits_per_byte_lower_is_better():
    def node(bpbs):
        return [{"step": i + 1, "time": 0.1 * (i + 1), "wait_s": 0.0, "comm_s": 0.0, "val_bpb": v,
                 "nics": {"a": {"sent": 100 * (i + 1)}}} for i, v in enumerate(bpbs)]

    ssgd = reduce("ssgd", 0.0, [node([3.5, 3.0])], 0.02)
    dl = reduce("diloco", 0.0, [node([3.2, 3.05])], 0.02)
    assert ssgd.metric == dl.metric == "val_bpb" and dl.quality == 3.05
    table, lines = report([ssgd, dl], 50)
    assert "final val_bpb" in table
    assert any(ln.startswith("diloco val_bpb at ssgd's 2 steps") and "+1.7 % worse" in ln and ln.endswith("PASS") for ln in lines)


def test_the_steady_state_leaves_out_the_start_and_the_stop():
    """A run of 400 steps syncing every 50: the window runs from step 75 to step 375 (six whole
    intervals, one sync each), so the first broadcast and the final sync are not in it."""
    from bench.diloco import steady_bytes, steady_window

    assert steady_window(400, 50) == (75.0, 375.0)
    assert steady_window(100, 50) is None  # not one whole interval between the start and the stop
    sent, recs = 4_000_000, []  # the start: the first broadcast of the model
    for step in range(1, 401):
        sent += 1000 if step % 50 == 0 else 10  # one sync per interval, heartbeats between
        if step == 400:
            sent += 2_000_000  # the stop: the final full sync
        recs.append({"step": step, "time": step * 0.1, "nics": {"a": {"sent": sent}}})
    assert steady_bytes(recs, 50) == (6 * 1000 + 294 * 10) / 300
    row = reduce("diloco", 0.0, [recs], 0.02, 50)
    assert row.steady_per_step == steady_bytes(recs, 50) and row.bytes_per_step > 100 * row.steady_per_step


def test_a_run_of_more_steps_is_judged_at_ssgds_steps_and_by_its_time_to_ssgds_quality():
    """``--steps-factor 2``: DiLoCo trains twice SSGD's steps; its quality is compared at SSGD's
    last step (equal tokens), its time to SSGD's final quality over the whole run."""
    def node(bpbs, dt):
        return [{"step": i + 1, "time": dt * (i + 1), "wait_s": 0.0, "comm_s": 0.0, "val_bpb": v,
                 "nics": {"a": {"sent": 100 * (i + 1)}}} for i, v in enumerate(bpbs)]

    ssgd = reduce("ssgd", 200.0, [node([3.5, 3.0], 1.0)] * 2, 0.02)
    dl = reduce("diloco-e3m0", 200.0, [node([3.6, 3.2, 3.1, 2.9], 0.1)] * 2, 0.02)
    table, lines = report([ssgd, dl], 50, tau=8)
    assert "| 3.200 |" in table  # at ssgd's 2 steps
    assert any(ln.startswith("diloco-e3m0 val_bpb at ssgd's 2 steps") and "+6.7 % worse" in ln
               and ln.endswith("FAIL") for ln in lines)
    assert any(ln.startswith("diloco-e3m0 at 200 ms: 5.00x sooner") and ln.endswith("PASS") for ln in lines)


def test_dylu_is_judged_by_the_time_to_the_worse_final_quality_of_the_two_runs():
    """dylu ends with fewer tokens (its slow nodes take fewer steps): the verdict compares the
    times to the quality both runs reach, not the wall times of the whole runs."""
    def node(evals):
        return [{"step": i + 1, "time": t, "wait_s": 0.0, "comm_s": 0.0, "val_bpb": v,
                 "nics": {"a": {"sent": 100 * (i + 1)}}} for i, (t, v) in enumerate(evals)]

    fixed = reduce("hetero", 0.0, [node([(10.0, 4.0), (20.0, 3.9), (30.0, 3.8)])] * 4, 0.02)
    dylu = reduce("hetero-dylu", 0.0, [node([(5.0, 4.0), (15.0, 3.9)])] * 4, 0.02)
    _, lines = report([fixed, dylu], 20)
    line = next(ln for ln in lines if ln.startswith("1:1:2:4 devices"))
    assert "1.33x sooner with dylu to val_bpb 3.900 (20.0 s fixed H, 15.0 s dylu" in line and line.endswith("PASS")
    assert "2.00x" in line  # the whole runs' wall times, shown beside


def test_the_peak_is_the_most_bytes_sent_in_one_step_between_the_start_and_the_stop():
    """Every 50 steps one sync of 1000 bytes (DiLoCo) or two of 500 bytes 25 steps apart
    (two fragments): the same bytes per step, half the peak."""
    from bench.diloco import peak_bytes

    def node(sizes):
        sent, recs = 4_000_000, []
        for step in range(1, 401):
            sent += sizes.get(step % 50, 10)
            recs.append({"step": step, "time": float(step), "nics": {"a": {"sent": sent}}})
        return recs

    assert peak_bytes(node({0: 1000}), 50) == 1000
    assert peak_bytes(node({0: 500, 25: 500}), 50) == 500
    assert peak_bytes(node({0: 1000})[:60], 50) is None  # no steady window in 60 steps


def test_the_plot_shows_quality_against_time_and_against_inner_steps(tmp_path, monkeypatch):
    from bench.diloco import curve, plot

    recs = _node(10, [0.5, 0.9], waits=[0.0] * 4)
    assert curve(recs, "accuracy") == [(0.1, 0.5), (0.2, 0.9)]
    assert curve(recs, "accuracy", "step") == [(1.0, 0.5), (2.0, 0.9)]
    saved = {}

    def save_png(fig, name):
        saved["axes"] = [(ax.get_xlabel(), len(ax.get_lines())) for ax in fig.axes]
        return tmp_path / name

    monkeypatch.setattr("bench.diloco.save_png", save_png)
    rows = [reduce(k, lat, [recs], 0.02) for k in ("ssgd", "diloco") for lat in (0.0, 200.0)]
    plot(rows)
    assert ("seconds", 2) in saved["axes"] and ("inner steps (equal tokens)", 2) in saved["axes"]
    assert sum(1 for x, _ in saved["axes"] if x == "inner steps (equal tokens)") == 2  # one per latency


def test_the_default_workload_is_the_language_model_and_unset_options_take_its_defaults():
    import argparse

    from bench.diloco import DEFAULTS, resolve

    def ns(**kw):
        base = dict(model="lm-tiny", quick=False, steps=None, inner_steps=None, lr=None, tau=None, steps_factor=None,
                    pretrain_steps=None, slowdown_mode=None, timeout=None, latencies=None, configs=None)
        return argparse.Namespace(**{**base, **kw})

    lm = resolve(ns())
    assert (lm.steps, lm.inner_steps, lm.tau, lm.pretrain_steps, lm.slowdown_mode) == (150, 20, 8, 300, "compute")
    assert lm.latencies == [0.0, 50.0, 200.0]
    mlp = resolve(ns(model="mlp", tau=3))
    assert (mlp.steps, mlp.inner_steps, mlp.tau, mlp.pretrain_steps) == (400, 50, 3, 0)  # a set option stays
    quick = resolve(ns(quick=True))
    assert (quick.steps, quick.inner_steps, quick.tau, quick.pretrain_steps, quick.latencies) == (60, 10, 1, 0, [0.0])
    assert set(DEFAULTS["lm"]) == set(DEFAULTS["mlp"])
