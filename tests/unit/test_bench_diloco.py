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
    e3 = reduce("diloco-e3m0", 200.0, [_node(2.5, [0.9, 0.91], waits=[0.0, 0.0, 0.05, 0.0])] * 2, 0.02)
    assert ssgd.bytes_per_step == 1000 and ssgd.waited == 1.0 and ssgd.quality == 0.9 and ssgd.metric == "accuracy"
    assert e3.waited == 0.25 and e3.steps == 4
    table, lines = report([ssgd, e3], 50)
    assert "400x" in table and "2.00x" in table  # bytes ratio; reached 0.9 at 0.1 s vs 0.2 s
    assert any("400x fewer" in ln and ln.endswith("PASS") for ln in lines)
    assert any(ln.startswith("diloco-e3m0 final accuracy") and ln.endswith("PASS") for ln in lines)


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
    assert any(ln.startswith("diloco final val_bpb") and "+1.7 % worse" in ln and ln.endswith("PASS") for ln in lines)
