"""The language-model workload: the ``pysource`` corpus (stable split, byte tokens that
round-trip, windows), the ``lm-*`` models' sizes, their defaults and checks at the CLI edge,
and a few steps of ``lm-tiny`` that lower the training loss."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.training.config import LM_SPECS, RunConfig
from p2psync.training.corpus import TokenData, decode, encode, is_validation, pysource, source_files
from p2psync.topology import ring

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_the_split_is_stable_and_holds_out_about_five_percent() -> None:
    files = source_files()
    assert files == sorted(files) and files == source_files()  # same files, same order, every call
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.split("/"))
    held = [f for f in files if is_validation(f)]
    assert 0.03 < len(held) / len(files) < 0.07
    assert is_validation(held[0]) and held == [f for f in files if is_validation(f)]
    c = pysource()
    assert c is pysource()  # built once per process
    assert c.meta["python"] == ".".join(map(str, sys.version_info[:3]))
    assert c.meta["files"] == len(files) and c.meta["val_files"] == len(held)
    assert c.meta["bytes"] == len(c.train) + len(c.val) and len(c.meta["sha256"]) == 64
    assert 0.02 < len(c.val) / c.meta["bytes"] < 0.1


def test_a_folder_of_sources_gives_the_same_corpus_every_time(tmp_path: Path) -> None:
    for rel, text in {"a.py": "x = 1\n", "pkg/b.py": "def f():\n    return 'é'\n", "c.txt": "no",
                      "site-packages/d.py": "skipped", "pkg/dist-packages/e.py": "skipped"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert source_files(tmp_path) == ["a.py", "pkg/b.py"]
    c = pysource(tmp_path)
    joined = np.concatenate([c.train, c.val])
    assert sorted(decode(joined)) == sorted("x = 1\n" + "def f():\n    return 'é'\n")
    with pytest.raises(ConfigError, match="pysource"):
        pysource(tmp_path / "missing")


def test_byte_tokens_round_trip() -> None:
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    tokens = encode(text)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text and decode(tokens.astype(np.int64).tolist()) == text
    raw = bytes(range(256))  # not UTF-8: bytes are tokens all the same
    assert encode(raw).tobytes() == raw
    # the validation stream begins with the first held-out file's bytes, exactly
    import sysconfig

    first = next(f for f in source_files() if is_validation(f))
    body = (Path(sysconfig.get_paths()["stdlib"]) / first).read_bytes()
    assert pysource().val[:len(body)].tobytes() == encode(body).tobytes()
    with pytest.raises(ValueError):
        decode([256])


def test_windows_are_the_next_bytes() -> None:
    c = pysource()
    data = TokenData(c, 16)
    assert data.n_train == (len(c.train) - 1) // 16
    x, y = data.train_batch(np.array([0, 5]))
    assert x.shape == y.shape == (2, 16) and x.dtype == np.int64
    assert (x[1] == c.train[80:96]).all() and (y[1] == c.train[81:97]).all()
    batches = data.eval_batches(10)
    assert sum(len(b[0]) for b in batches) == len(data.val_starts) == 64


@pytest.mark.parametrize("name,millions", [("lm-tiny", 1.0), ("lm-small", 10.0), ("lm-base", 85.0)])
def test_parameter_counts_match_the_documented_sizes(name: str, millions: float) -> None:
    from p2psync.training.models import build_model
    from p2psync.training.nets import lm_params

    spec = LM_SPECS[name]
    count = lm_params(spec.width, spec.layers, spec.context)
    assert abs(count / 1e6 - millions) / millions < 0.1, count
    if name != "lm-base":  # 85M parameters: the formula is checked on the two smaller ones
        model = build_model(name, (spec.context,), 256)
        assert sum(p.numel() for p in model.parameters()) == count


def test_the_example_script_builds_the_same_model() -> None:
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("lm_example", ROOT / "examples" / "lm.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    from p2psync.training.models import build_model

    ours = build_model("lm-tiny", (128,), 256)
    theirs = mod.ByteLM()
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    from p2psync.training.trainer import warmup_cosine

    assert all(mod.lr_factor(k, 300) == warmup_cosine(k, 300) for k in range(300))


def test_a_few_steps_of_lm_tiny_lower_the_training_loss() -> None:
    import torch

    from p2psync.training.node import build_trainer

    cfg = RunConfig(topology="-", model="lm-tiny", data="pysource", optimizer="adamw", lr=3e-3, batch_size=4,
                    threads=1, device="cpu")
    tr = build_trainer(cfg, ring(2), 0)
    assert tr.clip_norm == 1.0 and tr.tokens_per_sample == 128
    fixed = tr.sampler.batch(0)
    x, y = tr.batch_tensors(fixed)

    def loss_now() -> float:
        with torch.no_grad():
            return float(tr.loss_of(x, y)[0])

    before = loss_now()
    assert abs(before - math.log(256)) < 0.3  # the initial model is close to uniform
    for _ in range(6):
        tr.batches_done = 0  # the same batch: the loss on it must fall
        tr.forward_backward()
        tr.optimizer.step()
    assert loss_now() < before - 0.5
    test_loss, acc = tr.evaluate_now()
    assert math.isfinite(test_loss) and 0 <= acc <= 1


def test_a_language_model_trains_on_text_only() -> None:
    with pytest.raises(ConfigError, match="--model lm-tiny cannot train on --data digits"):
        RunConfig(topology="t", model="lm-tiny")
    with pytest.raises(ConfigError, match="--model mlp cannot train on --data pysource"):
        RunConfig(topology="t", data="pysource")
    with pytest.raises(ConfigError, match="--partition shards needs class labels"):
        RunConfig(topology="t", model="lm-tiny", data="pysource", partition="shards")


def test_the_cli_gives_a_language_model_its_defaults_and_keeps_explicit_choices() -> None:
    from p2psync.cli.main import build_parser
    from p2psync.cli.run_cmd import DEFAULT_LM_STEPS, config_from_args

    def cfg(*argv: str) -> RunConfig:
        return config_from_args(build_parser().parse_args(["run", "topologies/ring-4.json", *argv]))

    c = cfg("--model", "lm-tiny")
    assert (c.data, c.optimizer, c.lr, c.batch_size, c.lr_schedule, c.steps) == (
        "pysource", "adamw", LM_SPECS["lm-tiny"].lr, LM_SPECS["lm-tiny"].batch_size, "warmup-cosine", DEFAULT_LM_STEPS)
    # an explicit choice equal to a classifier's default survives the trip to the node processes
    c = cfg("--model", "lm-tiny", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "32", "--steps", "5",
            "--lr-schedule", "constant", "--weight-decay", "0")
    again = cfg(*c.to_argv())
    assert again == c and (c.optimizer, c.lr, c.batch_size, c.lr_schedule, c.weight_decay) == (
        "sgd", 0.05, 32, "constant", 0.0)
    assert cfg().optimizer == "sgd" and cfg().data == "digits"  # the classifiers' defaults are unchanged
    assert cfg("--model", "lm-tiny", "--time", "5").lr_schedule == "constant"  # no length to decay over


def test_dts_refuses_the_language_models_adamw_before_any_node_starts(tmp_path: Path) -> None:
    from p2psync.cli.main import build_parser
    from p2psync.cli.run_cmd import config_from_args, run

    argv = ["run", "topologies/ring-4.json", "--strategy", "dts", "--model", "lm-tiny", "--steps", "3",
            "--out", str(tmp_path)]
    with pytest.raises(ConfigError, match=r"(?s)--strategy dts cannot train with this optimizer.*AdamW.*"
                                          r"--model lm-tiny trains with --optimizer adamw.*--optimizer sgd"):
        run(build_parser().parse_args(argv))
    assert not any(tmp_path.iterdir())  # nothing started, no run folder
    # with the optimizer it needs, the same run is accepted (its checks pass; it is not started here)
    cfg = config_from_args(build_parser().parse_args([*argv, "--optimizer", "sgd"]))
    assert (cfg.optimizer, cfg.lr, cfg.lr_schedule) == ("sgd", 0.1, "warmup-cosine")


def test_single_is_one_process_with_every_nodes_batch(tmp_path: Path) -> None:
    from p2psync.cli.main import build_parser
    from p2psync.cli.run_cmd import config_from_args, single_reference
    from p2psync.topology import load

    args = build_parser().parse_args(["run", "topologies/ring-4.json", "--model", "lm-tiny", "--steps", "300",
                                      "--strategy", "dts", "--codec", "int8", "--single", "--out", str(tmp_path),
                                      "--run-id", "ref"])
    cfg, topo = single_reference(config_from_args(args), load("topologies/ring-4.json"), args)
    assert topo.ids == [0] and load(cfg.topology).ids == [0] and load(cfg.topology).name == "ring-4-single"
    assert Path(cfg.topology) == tmp_path / "ref" / "topology-single.json"
    assert (cfg.batch_size, cfg.steps, cfg.strategy, cfg.codec, cfg.optimizer) == (
        4 * LM_SPECS["lm-tiny"].batch_size, 300, "ssgd", "none", "adamw")
    from p2psync.cli.main import parse_args

    bad = parse_args(build_parser(), ["run", "topologies/ring-4.json", "--single", "--", "python", "x.py"])
    with pytest.raises(ConfigError, match="--single runs the built-in job"):
        single_reference(config_from_args(bad), load("topologies/ring-4.json"), bad)


def test_the_report_shows_a_language_models_validation_bpb() -> None:
    from p2psync.cli.report_cmd import table

    recs = {0: [{"step": 1, "time": 1.0, "loss": 5.0}, {"step": 2, "time": 2.0, "loss": 4.0, "val_bpb": 5.5}],
            1: []}
    out = table(recs).splitlines()
    assert "| val bpb |" in out[0] and out[2].split(" | ")[5] == "5.5000"
    assert out[3].count("|") == out[0].count("|")
    assert "val bpb" not in table({0: [{"step": 1, "time": 1.0, "loss": 5.0, "accuracy": 0.5}]})
