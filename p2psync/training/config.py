"""RunConfig: the frozen, validated description of a run, built once at the CLI edge."""

from __future__ import annotations

import hashlib
import json
import math
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from p2psync.errors import ConfigError
from p2psync.training.hetero import SlowdownMode
from p2psync.transport.shaping import SHAPERS, ShaperName
from p2psync.vocab import BUFFER_MODES, ON_FAILURE, BufferMode, OnFailure
from p2psync.wire.schema import valid_run_id

#: the built-in job's models (p2psync.training.models builds them; named here, without torch,
#: so the CLI parses its options without importing it)
ModelName = Literal["mlp", "cnn", "resnet18", "lm-tiny", "lm-small", "lm-base"]
MODELS: tuple[str, ...] = get_args(ModelName)


@dataclass(frozen=True)
class LmSpec:
    """A decoder-only transformer's shape (pre-norm blocks, GELU MLP of 4 x width, learned
    positions, an untied output layer; the byte vocabulary)."""

    width: int
    layers: int
    heads: int
    context: int
    #: the built-in job's defaults for this size: AdamW's peak learning rate, sequences per batch
    lr: float
    batch_size: int


#: the language models of ``--model`` (their parameter counts: p2psync.training.nets.lm_params)
LM_SPECS: dict[str, LmSpec] = {
    "lm-tiny": LmSpec(width=128, layers=5, heads=4, context=128, lr=2e-3, batch_size=8),   # ~1.05 M
    "lm-small": LmSpec(width=320, layers=8, heads=5, context=256, lr=1e-3, batch_size=8),  # ~10.0 M
    "lm-base": LmSpec(width=768, layers=12, heads=12, context=512, lr=3e-4, batch_size=8),  # ~85.6 M
}
#: the data sets a language model trains on (byte tokens), and the classifiers' data sets
LM_DATASETS: tuple[str, ...] = ("pysource",)
#: the options whose default differs for a language model (``p2psync run`` fills them in from
#: :func:`lm_defaults` when they are not given; :meth:`RunConfig.to_argv` always writes them out)
LM_DEFAULTED = ("optimizer", "lr", "batch_size", "lr_schedule", "weight_decay")
#: the language models' default weight decay (AdamW's decoupled decay)
LM_WEIGHT_DECAY = 0.1


#: a language model's default peak learning rate under ``--optimizer sgd`` or ``nesterov``
#: (momentum 0.9; lm-tiny, 40 steps of 16 sequences: 0.1 learns, 0.3 is noisier, 1.0 diverges at first)
LM_SGD_LR = 0.1


def repeated_blocks(model: str) -> tuple[int, bool] | None:
    """A built-in ``model``'s repeated blocks, known from its name without building it: (how
    many, whether it has parameters outside them) for the language models (``blocks.<i>``; the
    embeddings, final norm and output layer outside them); None for the others."""
    spec = LM_SPECS.get(model)
    return None if spec is None else (spec.layers, True)


def lm_defaults(model: str, optimizer: str | None = None) -> dict[str, Any]:
    """The built-in job's defaults of :data:`LM_DEFAULTED` for ``--model`` (empty for a
    classifier): AdamW at the size's peak learning rate, warm-up then cosine decay, the size's
    batch, weight decay :data:`LM_WEIGHT_DECAY`. ``optimizer``: the one chosen (an SGD one
    peaks at :data:`LM_SGD_LR`)."""
    spec = LM_SPECS.get(model)
    if spec is None:
        return {}
    opt = optimizer or "adamw"
    return {"optimizer": opt, "lr": LM_SGD_LR if opt in ("sgd", "nesterov") else spec.lr,
            "batch_size": spec.batch_size, "lr_schedule": "warmup-cosine", "weight_decay": LM_WEIGHT_DECAY}


LrSchedule = Literal["constant", "cosine", "warmup-cosine"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)
#: the built-in job's ``--optimizer`` choices (training/trainer.py ``make_optimizer``: nesterov is
#: SGD with Nesterov momentum)
OptimizerName = Literal["sgd", "nesterov", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)

#: fields that only concern the local process; every other field must agree across nodes
LOCAL_FIELDS = frozenset({"out", "run_id", "device", "threads", "progress", "keys", "resume", "shm", "command"})
#: options only the built-in job reads (its model, data, optimizer, evaluation, emulated device):
#: a run of the user's own command (``command``) does not record them
BUILTIN_JOB_FIELDS = frozenset({"epochs", "model", "hidden", "data", "data_dir", "synthetic_size", "optimizer",
                                "lr", "lr_schedule", "momentum", "weight_decay", "batch_size", "eval_every", "eval_seconds",
                                "device", "slowdown", "slowdown_schedule", "step_time", "slowdown_mode",
                                "step_jitter", "init_from"})
UNBOUNDED_STEPS = 1 << 62


@dataclass(frozen=True)
class RunConfig:
    topology: str
    strategy: str = "ssgd"
    steps: int | None = None
    epochs: float | None = None
    time_limit: float | None = None
    model: ModelName = "mlp"
    #: the MLP's hidden width (a wider one makes the network matter at a given bandwidth)
    hidden: int = 128
    data: str = "digits"
    data_dir: str | None = None
    synthetic_size: int = 20000
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    shards_per_node: int = 2
    optimizer: str = "sgd"
    lr: float = 0.05
    #: the built-in job's learning-rate schedule, stepped after every optimizer step:
    #: constant, or cosine decay to 0 over the run's steps (needs --steps or --epochs)
    lr_schedule: LrSchedule = "constant"
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 20
    eval_seconds: float | None = None
    out: str = "runs"
    run_id: str | None = None
    device: str = "auto"
    threads: int | None = None
    start_timeout: float = 60.0
    peer_timeout: float = 30.0
    heartbeat: float = 0.5
    failure_timeout: float = 2.0
    phi_threshold: float = 8.0
    #: seconds a node cut off from the majority of the run waits (not stepping) before it gives up
    quorum_timeout: float = 300.0
    shaper: ShaperName = "none"
    wan: str | None = None
    #: bandwidth of every NIC for the inproc shaper (Mb/s; one token bucket per NIC)
    nic_mbps: float | None = None
    slowdown: str = ""
    slowdown_schedule: str = ""
    step_time: str = ""
    slowdown_mode: SlowdownMode = "wait"
    step_jitter: float = 0.0
    codec: str = "none"
    piece_kib: int = 1024
    error_feedback: bool = False
    collective: str = "auto"
    strategy_options: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    progress: bool = False
    #: a peer fails: synchronous strategies re-form over the survivors (continue) or stop
    on_failure: OnFailure = "continue"
    #: folder of this host's key files (a keyed cluster: the topology lists public keys)
    keys: str | None = None
    #: write every node's state every N steps into its run folder (None: never)
    checkpoint_every: int | None = None
    #: the run folder (``<out>/<run_id>``) whose checkpoints this run continues
    resume: str | None = None
    #: built-in job: the model's initial weights from this file (a checkpoint or a state_dict;
    #: api/checkpoint.py ``load_weights``) instead of the seed's
    init_from: str | None = None
    #: send big pieces to peers on this host through shared memory (transport/shm.py)
    shm: bool = False
    #: module buffers at a synchronizing step: the lowest member's (broadcast), the group's
    #: mean (average) or each node's own (local); see strategies/buffers.py
    buffers: BufferMode = "broadcast"
    #: compare a hash of every member's parameters and buffers every N steps (strategies that
    #: promise identical replicas; the end of the run is always audited)
    audit_every: int | None = None
    #: the user's command that each node runs (``p2psync run ... -- CMD``); None: the built-in job
    command: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")

        for name in ("steps", "epochs", "time_limit", "threads", "eval_seconds", "checkpoint_every", "nic_mbps",
                     "audit_every"):
            positive(name)
        for name in ("lr", "batch_size", "eval_every", "start_timeout", "peer_timeout", "heartbeat",
                     "failure_timeout", "phi_threshold", "quorum_timeout", "dirichlet_alpha", "synthetic_size", "shards_per_node",
                     "piece_kib", "hidden"):
            positive(name, allow_none=False)
        if not 0 <= self.momentum < 1:
            raise ConfigError("--momentum must be in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose {', '.join(OPTIMIZERS)}")
        if self.optimizer == "nesterov" and self.momentum <= 0:
            raise ConfigError("--optimizer nesterov needs --momentum > 0")
        if self.weight_decay < 0:
            raise ConfigError("--weight-decay must be >= 0")
        if self.failure_timeout <= self.heartbeat:
            raise ConfigError("--failure-timeout must be longer than --heartbeat")
        from p2psync.compress import get_codec
        from p2psync.training.hetero import parse_profiles

        get_codec(self.codec)  # validate: a known name, topk:F with 0 < F <= 1
        self._check_devices()
        parse_profiles(self.slowdown, self.slowdown_schedule, self.step_time, self.slowdown_mode,
                       self.step_jitter)  # validate
        if self.model not in MODELS:
            raise ConfigError(f"--model {self.model!r}: choose from {', '.join(MODELS)}")
        if self.shaper not in SHAPERS:
            raise ConfigError(f"--shaper {self.shaper!r}: choose from {', '.join(SHAPERS)}")
        if self.wan and self.shaper == "none":
            raise ConfigError("--wan needs --shaper inproc or netem")
        if self.shm and self.keys is not None:
            raise ConfigError("--shm cannot be used with --keys: the bytes would bypass CurveZMQ")
        if self.nic_mbps is not None and self.shaper != "inproc":
            raise ConfigError("--nic-mbps needs --shaper inproc")
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"--on-failure {self.on_failure!r}: choose from {', '.join(ON_FAILURE)}")
        if self.run_id is not None and not valid_run_id(self.run_id):
            raise ConfigError(f"--run-id {self.run_id!r}: must be a plain folder name (1-128 characters "
                              "of A-Z a-z 0-9 _ . + -, not starting with a dot, no '..')")
        for name in ("checkpoint_every", "audit_every"):
            v = getattr(self, name)
            if v is not None and isinstance(v, float):
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number of steps, got {v!r}")
        if self.init_from is not None:
            if self.command is not None:
                raise ConfigError("--init-from is the built-in job's: a script loads its own weights")
            if not Path(self.init_from).is_file():
                raise ConfigError(f"--init-from {self.init_from}: no such file")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"--lr-schedule {self.lr_schedule!r}: choose from {', '.join(LR_SCHEDULES)}")
        if self.lr_schedule != "constant" and self.steps is None and self.epochs is None:
            raise ConfigError(f"--lr-schedule {self.lr_schedule} needs the run's length: --steps or --epochs")
        if (self.model in LM_SPECS) != (self.data in LM_DATASETS):
            raise ConfigError(f"--model {self.model} cannot train on --data {self.data}: the language models "
                              f"({', '.join(LM_SPECS)}) train on {', '.join(LM_DATASETS)}, the classifiers "
                              "on digits, idx or synthetic")
        if self.data in LM_DATASETS and self.partition != "iid":
            raise ConfigError(f"--partition {self.partition} needs class labels: --data {self.data} "
                              "(text windows) is split iid only")
        if self.buffers not in BUFFER_MODES:
            raise ConfigError(f"--buffers {self.buffers!r}: choose from {', '.join(BUFFER_MODES)}")

    def _check_devices(self) -> None:
        """The emulated devices' rules that depend on the rest of the run. A command's nodes
        emulate slower devices only by CPU quotas (``--slowdown`` with ``--slowdown-mode
        quota``): the padded modes, ``--step-time``, ``--step-jitter`` and schedules act on the
        built-in job's steps, which a script does not run (an error, rather than a run that
        silently emulates nothing). Quotas need the host's control groups, which a network
        namespace entered by ``ip netns exec`` (``--shaper netem``) does not mount."""
        if self.slowdown_mode == "quota" and self.shaper == "netem":
            raise ConfigError("--slowdown-mode quota with --shaper netem: a node in a network namespace sees no "
                              "control groups (ip netns exec mounts its own /sys); use --shaper inproc")
        if self.command is None:
            return
        padded = [o for o, v in (("--step-time", self.step_time), ("--step-jitter", self.step_jitter),
                                 ("--slowdown-schedule", self.slowdown_schedule)) if v]
        if self.slowdown and self.slowdown_mode != "quota":
            padded.insert(0, f"--slowdown with --slowdown-mode {self.slowdown_mode}")
        if padded:
            raise ConfigError(f"{', '.join(padded)}: the built-in job's emulated device, which a command's nodes do "
                              "not run; a command's nodes emulate slower devices with --slowdown NODE:FACTOR,... "
                              "--slowdown-mode quota (each node's process capped at its device's share of the "
                              "cores; root)")

    def record(self) -> dict[str, Any]:
        """The options this run uses, as the run folder records them: for the user's own
        command, ``command`` and none of :data:`BUILTIN_JOB_FIELDS` (the script has its own
        model, data and optimizer); for the built-in job, every field but ``command``."""
        out = asdict(self)
        if self.command is None:
            del out["command"]
            return out
        out["command"] = list(self.command)
        return {k: v for k, v in out.items() if k not in BUILTIN_JOB_FIELDS}

    def agreed(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in LOCAL_FIELDS and k != "topology"}

    def fingerprint(self) -> str:
        blob = json.dumps(self.agreed(), sort_keys=True, default=str).encode()
        return hashlib.sha1(blob).hexdigest()[:12]

    @property
    def lm(self) -> LmSpec | None:
        """The language model's shape (None: a classifier)."""
        return LM_SPECS.get(self.model)

    def max_steps(self, n_train: int, n_nodes: int) -> int:
        """Steps per node: --steps, or --epochs over the whole training set split across nodes."""
        if self.steps is not None:
            return int(self.steps)
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * n_train / (n_nodes * self.batch_size)))
        return UNBOUNDED_STEPS

    def to_json(self) -> str:
        """Every field as one JSON object; ``from_json`` reads it back into an equal config."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """The config ``to_json`` wrote. Unknown fields, wrong types and values that the
        config's own checks reject raise ``ConfigError`` naming the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"expected a JSON object of config fields, got {type(data).__name__}")
        hints = get_type_hints(cls)
        unknown = sorted(set(data) - set(hints))
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(map(repr, unknown))}")
        if "topology" not in data:
            raise ConfigError("missing config field 'topology'")
        return cls(**{name: _json_value(name, hints[name], v) for name, v in data.items()})

    def to_argv(self) -> list[str]:
        """Command-line options that reproduce this config (for launching node processes)."""
        out: list[str] = []
        for f in fields(self):
            if f.name in ("topology", "progress", "command"):
                continue
            v = getattr(self, f.name)
            if v is None or (v == f.default and not (self.lm is not None and f.name in LM_DEFAULTED)):
                continue
            if isinstance(v, str) and not v:
                continue
            flag = "--time" if f.name == "time_limit" else "--" + f.name.replace("_", "-")
            if f.name == "strategy_options":
                for k, val in v:
                    out += ["--opt", f"{k}={val}"]
            elif isinstance(v, bool):
                out += [flag] if v else []
            else:
                out += [flag, str(v)]
        return out


def _json_value(name: str, hint: Any, v: Any) -> Any:
    """``v`` (decoded JSON) as a value of the field type ``hint``; ConfigError if it is not one."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if v is None and len(args) < len(get_args(hint)):
            return None
        (hint,) = args
    if hint is bool and isinstance(v, bool):
        return v
    if (hint is str or get_origin(hint) is Literal) and isinstance(v, str):
        return v  # a Literal's value is checked by the config's own checks, naming the option
    if hint is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    if hint is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if get_args(hint) == (str, ...) and isinstance(v, list):  # command: its words
        if all(isinstance(x, str) for x in v):
            return tuple(v)
        raise ConfigError(f"expected a list of strings, got {v!r}", field=name)
    if get_origin(hint) is tuple and isinstance(v, list):  # strategy_options: NAME/VALUE pairs
        if all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in v):
            return tuple((p[0], p[1]) for p in v)
        raise ConfigError(f"expected a list of [name, value] string pairs, got {v!r}", field=name)
    raise ConfigError(f"expected {getattr(hint, '__name__', hint)}, got {v!r}", field=name)
