"""Checkpoint files (issue 16): what they hold, read back without pickle, written atomically
(a process killed while writing one leaves the previous one loadable)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from p2psync.api import checkpoint
from p2psync.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return checkpoint.snapshot(p2psync={"step": step, "samples": 7 * step, "strategy": "ssgd", "run_id": "r",
                                        "node": 0, "strategy_state": {"in_sync": True}},
                               model=model, optimizer=opt, extra={"sampler": {"batches_done": step}})


def test_round_trip_and_rng_states(tmp_path: Path) -> None:
    path = checkpoint.node_checkpoint(tmp_path, 3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    st = _state(5)
    checkpoint.save_atomic(path, st)
    assert path == tmp_path / "node-3" / "checkpoint.pt"
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    back = checkpoint.load(path)
    assert back["step"] == 5 and back["extra"] == {"sampler": {"batches_done": 5}}
    torch.testing.assert_close(back["model"]["weight"], st["model"]["weight"])
    checkpoint.restore_rng(back["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint"):
        checkpoint.load(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        checkpoint.load(bad)
    torch.save({"format": 99, "step": 1}, bad)
    with pytest.raises(ConfigError, match="not a p2psync checkpoint"):
        checkpoint.load(bad)


def test_initial_weights_come_from_a_checkpoint_or_a_state_dict_and_a_misfit_loads_nothing(tmp_path: Path) -> None:
    st = _state(5)
    path = checkpoint.node_checkpoint(tmp_path, 0)
    checkpoint.save_atomic(path, st)
    plain = tmp_path / "weights.pt"
    torch.save(st["model"], plain)
    for source in (path, plain):
        torch.manual_seed(9)
        model = torch.nn.Linear(4, 3)
        checkpoint.load_weights(source, model)
        for k, v in model.state_dict().items():
            assert torch.equal(v, st["model"][k]), (source, k)
    other = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ConfigError, match=r"weights.pt: model.weight: shape \(3, 4\)"):
        checkpoint.load_weights(plain, other)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    with pytest.raises(ConfigError, match="no such file"):
        checkpoint.load_weights(tmp_path / "missing.pt", other)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ConfigError, match="not a readable weights file"):
        checkpoint.load_weights(tmp_path / "junk.pt", other)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="not a state dict"):
        checkpoint.load_weights(tmp_path / "list.pt", other)


def test_process_killed_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "node-0" / "checkpoint.pt"
    checkpoint.save_atomic(path, _state(1))
    # a writer that stops (and is killed) after the new checkpoint's bytes went out, before
    # they were synced and renamed into place
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.unit.test_checkpoint import _state
        from p2psync.api import checkpoint
        def stuck(fd):
            print("writing", flush=True)
            sys.stdin.read()
        os.fsync = stuck
        checkpoint.save_atomic({str(path)!r}, _state(2))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert (path.parent / ".checkpoint.pt.tmp").stat().st_size > 0
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert checkpoint.load(path)["step"] == 1
    checkpoint.save_atomic(path, _state(3))  # the stale temporary file is simply replaced
    assert checkpoint.load(path)["step"] == 3 and not (path.parent / ".checkpoint.pt.tmp").exists()


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    """Checkpoints and key files are written through a temporary file created exclusively,
    never through a link someone left at its name (it would overwrite the link's target)."""
    from p2psync.transport.keys import generate, key_file, write_key_dir
    from p2psync.topology import mesh

    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = checkpoint.node_checkpoint(tmp_path, 0)
    path.parent.mkdir(parents=True)
    (path.parent / ".checkpoint.pt.tmp").symlink_to(victim)
    checkpoint.save_atomic(path, _state(1))
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / f".{key_file(keys, 0).name}.tmp").symlink_to(victim)
    write_key_dir(keys, generate(mesh(2)))
    assert victim.read_text() == "keep" and checkpoint.load(path)["step"] == 1
    assert oct(key_file(keys, 0).stat().st_mode & 0o777) == "0o600"


def test_a_cpu_model_captures_no_cuda_generator() -> None:
    before = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    st = _state(1)
    # on a GPU machine another test in this worker may have initialised CUDA already
    assert "cuda" not in st["rng"] and torch.cuda.is_initialized() == before  # type: ignore[no-untyped-call]


def _big_state(step: int) -> dict:
    return {**_state(step), "blob": torch.zeros(15_000)}  # ~60 KiB: two do not fit in 100 KiB


def test_a_full_disk_raises_its_os_error_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """torch.save reports a failed write as a RuntimeError naming neither file nor reason; the
    checkpoint writer raises the disk's own error, removes its temporary file and leaves the
    previous checkpoint loadable."""
    import errno

    from tests.helpers import tiny_filesystem

    with tiny_filesystem(tmp_path / "disk", 100) as disk:
        path = checkpoint.node_checkpoint(disk, 0)
        checkpoint.save_atomic(path, _big_state(1))
        with pytest.raises(OSError) as ei:
            checkpoint.save_atomic(path, _big_state(2))
        assert ei.value.errno == errno.ENOSPC
        assert checkpoint.load(path)["step"] == 1
        assert os.listdir(path.parent) == ["checkpoint.pt"]


def test_a_read_only_folder_raises_its_os_error(tmp_path: Path) -> None:
    from tests.helpers import read_only_folder

    with read_only_folder(tmp_path / "ro") as ro:
        with pytest.raises(OSError):
            checkpoint.save_atomic(ro / "checkpoint.pt", _state(1))


def test_write_failures_are_said_once_per_kind_with_path_and_reason(caplog) -> None:
    import errno
    import logging

    from p2psync.files import WriteFailures

    wf = WriteFailures("node 2")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with caplog.at_level(logging.WARNING, "p2psync.files"):
        for _ in range(5):
            with wf.guard("checkpoint", "/runs/r/node-2/checkpoint.pt", "the previous checkpoint is kept"):
                raise full
        wf.failed("metrics record", "/runs/r/node-2.jsonl", OSError(errno.EROFS, os.strerror(errno.EROFS)))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("node 2: cannot write the checkpoint /runs/r/node-2/checkpoint.pt: No space left "
                               "on device (ENOSPC); the previous checkpoint is kept; the run goes on")
    assert "Read-only file system (EROFS)" in lines[1]
    assert wf.as_dict() == {"checkpoint": 5, "metrics record": 1}


def test_metrics_records_on_a_disk_that_fails_are_counted_not_raised(tmp_path: Path) -> None:
    from p2psync.files import WriteFailures
    from p2psync.training.metrics import MetricsWriter

    blocked = tmp_path / "file"
    blocked.write_text("")
    wf = WriteFailures("node 0")
    w = MetricsWriter(blocked / "node-0.jsonl", failures=wf)  # its folder cannot exist
    w.write({"step": 1}, flush=True)
    w.close()
    assert wf.as_dict() == {"metrics record": 2}
    with pytest.raises(OSError):  # without WriteFailures: raised, as before
        MetricsWriter(blocked / "node-0.jsonl")


def test_metrics_records_on_a_full_disk_are_counted_not_raised(tmp_path: Path) -> None:
    from p2psync.files import WriteFailures
    from p2psync.training.metrics import MetricsWriter, read_jsonl
    from tests.helpers import tiny_filesystem

    with tiny_filesystem(tmp_path / "disk", 16) as disk:
        wf = WriteFailures("node 0")
        w = MetricsWriter(disk / "node-0.jsonl", failures=wf)
        for k in range(400):
            w.write({"step": k, "pad": "x" * 100}, flush=True)
        w.close()
        assert wf.counts["metrics record"] > 100
        assert 50 < len(read_jsonl(disk / "node-0.jsonl")) < 400


def _momentum_state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return checkpoint.snapshot(p2psync={"step": step, "samples": 0, "strategy": "ssgd", "run_id": "r", "node": 1,
                                        "strategy_state": {}, "feedback": {"ef": {}, "sparse": {}}},
                               model=model, optimizer=opt, extra={})


def _break(st: dict, how: str) -> None:
    if how == "momentum":
        st["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3, 5)
    elif how == "momentum-dtype":
        st["optimizer"]["state"][1]["momentum_buffer"] = torch.zeros(3, dtype=torch.float64)
    elif how == "param-size":
        st["model"]["0.weight"] = torch.zeros(3, 5)
    elif how == "param-dtype":
        st["model"]["0.bias"] = st["model"]["0.bias"].double()
    elif how == "missing-key":
        del st["model"]["1.running_var"]
    elif how == "extra-key":
        st["model"]["2.weight"] = torch.zeros(1)
    elif how == "no-model":
        del st["model"]
    elif how == "no-optimizer":
        del st["optimizer"]
    elif how == "groups":
        st["optimizer"]["param_groups"].append(dict(st["optimizer"]["param_groups"][0]))
    elif how == "residual":
        st["feedback"]["ef"]['["ssgd", 0]'] = torch.zeros(4, dtype=torch.float64)
    elif how == "rng":
        st["rng"]["numpy"] = "nope"


@pytest.mark.parametrize("how,field", [
    ("momentum", "optimizer.state[0].momentum_buffer"),
    ("momentum-dtype", "optimizer.state[1].momentum_buffer"),
    ("param-size", "model.0.weight"),
    ("param-dtype", "model.0.bias"),
    ("missing-key", "model.1.running_var"),
    ("extra-key", "model.2.weight"),
    ("no-model", "model"),
    ("no-optimizer", "optimizer"),
    ("groups", "optimizer.param_groups"),
    ("residual", "feedback.ef['[\"ssgd\", 0]']"),
    ("rng", "malformed RNG state"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_at_attach_naming_file_and_field(
        tmp_path: Path, how: str, field: str) -> None:
    """A crafted checkpoint (a momentum buffer of another shape, a parameter of another size or
    dtype, a missing key, ...) is a ConfigError naming the file and the field when the node
    attaches with --resume, never a RuntimeError at the first step (a momentum buffer of
    another shape used to load without a word and fail in optimizer.step())."""
    from p2psync.api.session import Session
    from p2psync.topology import mesh, save

    st = _momentum_state(3)
    _break(st, how)
    run = tmp_path / "r"
    path = checkpoint.node_checkpoint(run, 1)
    checkpoint.save_atomic(path, st)
    topo = tmp_path / "mesh2.json"
    save(mesh(2), topo)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(ConfigError) as ei:
        with Session(str(topo), 1, "ssgd", out=str(tmp_path), run_id="r", resume=str(run), steps=20) as s:
            s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert str(ei.value).startswith(f"{path}: ") and field in str(ei.value), str(ei.value)
    if how != "rng":
        assert ei.value.field == field


def test_a_checkpoint_that_fits_passes_the_checks() -> None:
    st = _momentum_state(3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint.restore_local(st, model, opt, source="x.pt")
    torch.testing.assert_close(model.state_dict()["0.weight"], st["model"]["0.weight"])
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    adam.step()  # Adam's 0-dimensional step counts pass, its moments have their parameters' shapes
    checkpoint.check_fits({**st, "optimizer": adam.state_dict()}, model, adam, source="x.pt")


def test_write_text_or_warn_replaces_atomically_or_says_why(tmp_path: Path, caplog) -> None:
    import logging

    from p2psync.files import WriteFailures, write_text_or_warn

    path = tmp_path / "summary.json"
    assert write_text_or_warn(path, "{}", what="run summary") and path.read_text() == "{}"
    wf = WriteFailures("node 0")
    with caplog.at_level(logging.WARNING, "p2psync.files"):
        assert not write_text_or_warn(path / "x", "{}", what="run summary", failures=wf)
        assert not write_text_or_warn(path / "y", "{}", what="run summary", failures=wf)
    assert wf.as_dict() == {"run summary": 2} and len(caplog.records) == 1
    assert f"cannot write the run summary {path / 'x'}: Not a directory (ENOTDIR)" in caplog.text


def test_error_feedback_residuals_with_nested_keys_survive_a_checkpoint():
    """The collectives key residuals by their callers' keys, which may be tuples themselves
    (``("rs", ("ssgd", "grad"), n, k)``): they come back as the same, hashable keys."""
    from p2psync.compress import ErrorFeedback

    fb = ErrorFeedback()
    keys = [("rs", ("ssgd", "grad"), 8, 0), ("own", (("dts", "window"), "m", 1), 8, 2), ("topk", "ef", 8), "asgd"]
    for i, k in enumerate(keys):
        fb.residual[k] = np.full(8, i, np.float32)
    back = ErrorFeedback()
    checkpoint.load_feedback(back, checkpoint.feedback_state(fb))
    assert set(back.residual) == set(keys)
    for k in keys:
        np.testing.assert_array_equal(back.residual[k], fb.residual[k])
