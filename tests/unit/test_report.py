"""p2psync report on a run folder written by the real metrics writer."""

from __future__ import annotations

from p2psync.cli.main import main
from p2psync.training.metrics import MetricsWriter


def test_report_table_and_plot(tmp_path, capsys):
    for node in (0, 1):
        w = MetricsWriter(tmp_path / f"node-{node}.jsonl")
        for step in range(1, 6):
            w.write({"node": node, "step": step, "time": step * 0.1, "loss": 1.0 / step,
                     "compute_s": 0.01 * step, "comm_s": 0.0, "wait_s": 0.0, "samples_per_s": 100.0,
                     "nics": {"eth0": {"sent": 1000 * step, "recv": 900 * step}},
                     **({"accuracy": 0.5 + 0.1 * step} if step % 2 == 0 else {})})
        w.close()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 5 | 0.5 | 0.2000 | 0.9000 |" in out and "| 1 | 5 |" in out
    assert (tmp_path / "report.png").stat().st_size > 1000
    assert main(["report", str(tmp_path / "missing")]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2


def test_report_of_a_script_run_with_missing_values(tmp_path, capsys):
    """A script's records: no loss logged (a record without the key, or null), no evaluation
    (accuracy null or absent), a final record with only node/step/time: '-' in the table, and
    the plot still written."""
    w = MetricsWriter(tmp_path / "node-0.jsonl")
    w.write({"node": 0, "step": 1, "time": 0.1, "loss": None, "accuracy": None, "samples_per_s": 0.0,
             "nics": {"eth0": {"sent": 10, "recv": 5}}})
    w.write({"node": 0, "step": 2, "time": 0.2, "nics": {"eth0": {"sent": 20, "recv": 9}}})
    w.write({"node": 0, "step": 2, "time": 0.3})
    w.close()
    w = MetricsWriter(tmp_path / "node-1.jsonl")
    w.write({"node": 1, "step": 1, "time": 0.1, "loss": 0.5, "accuracy": None})
    w.close()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 2 | 0.3 | - | - | - | - | - | - | - |" in out, out
    assert "| 1 | 1 | 0.1 | 0.5000 | - |" in out, out
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_report_names_what_a_step_counts(tmp_path, capsys):
    """ESync's records count rounds (several local steps each): the column says so."""
    import json

    w = MetricsWriter(tmp_path / "node-0.jsonl")
    w.write({"node": 0, "step": 1, "time": 0.1, "loss": 0.5, "n_local": 6})
    w.close()
    (tmp_path / "config.json").write_text(json.dumps({"strategy": "esync"}))
    assert main(["report", str(tmp_path)]) == 0
    assert "| node | rounds | time s |" in capsys.readouterr().out
    (tmp_path / "summary.json").write_text(json.dumps({"strategy": "ssgd"}))  # summary.json first
    assert main(["report", str(tmp_path)]) == 0
    assert "| node | steps | time s |" in capsys.readouterr().out
    (tmp_path / "summary.json").write_text(json.dumps({"strategy": ["odd"]}))
    (tmp_path / "config.json").unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert "| node | steps | time s |" in capsys.readouterr().out


def test_a_plot_that_cannot_be_written_is_a_clear_error(tmp_path, capsys):
    w = MetricsWriter(tmp_path / "node-0.jsonl")
    w.write({"node": 0, "step": 1, "time": 0.1, "loss": 0.5})
    w.close()
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert main(["report", str(tmp_path), "-o", str(blocked / "report.png")]) == 2
    captured = capsys.readouterr()
    assert "| 0 | 1 |" in captured.out  # the table is still there
    assert f"cannot write the plot {blocked / 'report.png'}: Not a directory (ENOTDIR)" in captured.err
