"""``p2psync run``: train on a topology — every node on this host, or one node (``--node``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from p2psync.cli.exit_codes import EXIT_FAILED, EXIT_FENCED, EXIT_INTERRUPTED, EXIT_OK
from p2psync.collectives.plan import ALGOS
from p2psync.compress import DEFAULT_FRACTION, codec_usage, get_codec
from p2psync.errors import ConfigError, Fenced, P2PSyncError, RunEnded, translate
from p2psync.topology import Topology
from p2psync.training.config import (LM_DATASETS, LM_DEFAULTED, LM_SGD_LR, LM_SPECS, LR_SCHEDULES, MODELS, OPTIMIZERS,
                                     RunConfig, lm_defaults, repeated_blocks)
from p2psync.training.data import DATASETS
from p2psync.training.hetero import SLOWDOWN_MODES
from p2psync.training.partition import SCHEMES
from p2psync.transport.keys import ENV_KEYS
from p2psync.transport.shaping import SHAPERS
from p2psync.vocab import BUFFER_MODES, ON_FAILURE

DEFAULT_EPOCHS = 20.0
#: the built-in job's budget for a language model without --steps/--epochs/--time
DEFAULT_LM_STEPS = 300

log = logging.getLogger("p2psync.cli")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default after its help, except a None one (no default, or one that depends on
    other options, which the help states)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from p2psync.strategies import REGISTRY

    d = RunConfig(topology="")
    p = sub.add_parser(
        "run", help="train a model on a topology (the built-in job, or your own script after --)",
        usage="%(prog)s TOPOLOGY [options] [-- CMD ARGS...]",
        description="Train one model on every node of TOPOLOGY (all on this host), or run one node "
                    "of a multi-host run with --node. The built-in job without --steps/--epochs/--time: "
                    f"--epochs {DEFAULT_EPOCHS:g}. With '-- CMD ARGS...': run your own training "
                    "script instead of the built-in job, once per node (or only node --node K, in "
                    "the foreground, with --run-id); everything after '--' goes to CMD unchanged. Each copy finds its "
                    "node, topology, strategy and these options in P2PSYNC_NODE, P2PSYNC_TOPOLOGY, "
                    "P2PSYNC_STRATEGY, P2PSYNC_CONFIG (JSON), its own folder in P2PSYNC_RUN_DIR, and "
                    "torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (p2psync.attach reads them), "
                    "and OMP_NUM_THREADS; --node K gives its copy the same.",
        formatter_class=_DefaultsHelp)
    p.add_argument("topology", help="topology JSON file (see 'p2psync topo')")
    p.add_argument("--strategy", default=d.strategy, choices=sorted(REGISTRY),
                   help="synchronization algorithm")
    p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="strategy option (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="training steps per node")
    g.add_argument("--epochs", type=float, help="passes over the training set (all nodes together)")
    p.add_argument("--time", type=float, dest="time_limit", metavar="SECONDS",
                   help="stop after this many seconds of training (with or instead of a step budget)")
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="mlp, cnn, resnet18: classifiers (digits, idx, synthetic); lm-tiny (~1M parameters, "
                        "context 128), lm-small (~10M, 256), lm-base (~85M, 512): byte-level decoder-only "
                        "transformers for --data pysource, trained with AdamW, warm-up + cosine decay and "
                        "gradient clipping at 1.0 unless the options below say otherwise "
                        f"(no budget given: --steps {DEFAULT_LM_STEPS})")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden width of --model mlp")
    p.add_argument("--data", choices=(*DATASETS, *LM_DATASETS),
                   help="digits: embedded (no download); idx: MNIST-format files in --data-dir; pysource: the "
                        "Python standard library's source as bytes (no download; the lm-* models' data) "
                        f"(default: {d.data}, pysource with an lm-* model)")
    p.add_argument("--data-dir", help="directory with train/t10k IDX files (for --data idx)")
    p.add_argument("--synthetic-size", type=int, default=d.synthetic_size, help="samples for --data synthetic")
    p.add_argument("--partition", default=d.partition, choices=SCHEMES, help="how data is split across nodes")
    p.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha, help="skew of --partition dirichlet")
    p.add_argument("--shards-per-node", type=int, default=d.shards_per_node, help="for --partition shards")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                   help="the built-in job's optimizer (nesterov: SGD with Nesterov momentum) "
                        f"(default: {d.optimizer}; adamw for the lm-* models)")
    p.add_argument("--lr", type=float,
                   help=f"(peak) learning rate (default: {d.lr}; lm-* models: "
                        + ", ".join(f"{k} {v.lr:g}" for k, v in LM_SPECS.items())
                        + f", or {LM_SGD_LR:g} with --optimizer sgd or nesterov)")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float,
                   help=f"(default: {d.weight_decay}; {lm_defaults('lm-tiny')['weight_decay']} for the lm-* models)")
    p.add_argument("--batch-size", type=int,
                   help=f"per node: samples, or sequences of the lm-* models (default: {d.batch_size}; lm-* models: "
                        + ", ".join(f"{k} {v.batch_size}" for k, v in LM_SPECS.items()) + ")")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every N steps")
    p.add_argument("--eval-seconds", type=float, help="also evaluate every S seconds")
    p.add_argument("--shaper", default="none", choices=SHAPERS,
                   help="link emulation: inproc (delay/bandwidth/jitter/loss in process) or netem "
                        "(network namespaces + tc; root and the netem qdisc needed)")
    p.add_argument("--nic-mbps", type=float, metavar="MBPS",
                   help="with --shaper inproc: every NIC sends at most this many Mb/s (one token bucket "
                        "per NIC, shared by its links)")
    p.add_argument("--wan", metavar="PROFILE.json",
                   help="latency profile (regions and RTTs), e.g. topologies/wan-4-regions.json")
    p.add_argument("--slowdown", default="", metavar="NODE:FACTOR,...",
                   help="emulated device slowdown per node, e.g. 0:1,1:1,2:2,3:8")
    p.add_argument("--slowdown-schedule", default="", metavar="NODE:AFTER_S:FACTOR,...",
                   help="change a node's slowdown during training, e.g. 2:30:4")
    p.add_argument("--step-time", default="", metavar="NODE:SECONDS,...",
                   help="fixed emulated step time per node (deterministic runs)")
    p.add_argument("--step-jitter", type=float, default=0.0, metavar="FRACTION",
                   help="every node's emulated step time varies by up to +-FRACTION per step "
                        "(uniform, seeded), e.g. 0.2")
    p.add_argument("--slowdown-mode", default="wait", choices=SLOWDOWN_MODES,
                   help="how a slower device is emulated: wait (the compute thread idles, CPU free), "
                        "compute (real extra matrix products on the compute thread) or quota (each node's "
                        "process capped at its device's share of the host's cores; root)")
    p.add_argument("--esync-mode", choices=("blocking", "nonblocking"),
                   help="ESync State Server queries (default nonblocking, §4.2)")
    p.add_argument("--codec", default=d.codec, type=codec_arg, metavar="CODEC",
                   help=f"compression in collectives: {codec_usage()}. topk:F keeps the largest-magnitude "
                        f"fraction F of each tensor (0 < F <= 1; topk alone: {DEFAULT_FRACTION:g}), exchanged "
                        "as a sparse allreduce, always with error feedback")
    p.add_argument("--error-feedback", action="store_true",
                   help="carry what a lossy codec dropped into the next step")
    p.add_argument("--piece-kib", type=int, default=d.piece_kib, help="collective piece size (KiB)")
    p.add_argument("--collective", default=d.collective, choices=ALGOS,
                   help="allreduce algorithm (auto: the topology's own)")
    p.add_argument("--out", default=d.out, help="folder for run folders")
    p.add_argument("--run-id", help="run folder name (default: time-topology-strategy)")
    p.add_argument("--node", type=int, help="run only this node (multi-host: one process per host)")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, help="torch threads per node (default: cores / local nodes)")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout,
                   help="seconds to wait for every node to join")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout,
                   help="seconds any wait on a peer may take")
    p.add_argument("--heartbeat", type=float, default=d.heartbeat,
                   help="heartbeat interval (s); heartbeats are pipelined, their RPC timeouts follow "
                        "the measured RTT")
    p.add_argument("--failure-timeout", type=float, default=d.failure_timeout,
                   help="failure detector floor: a node is never declared failed after less silence "
                        "than this (s); slow or jittery links wait longer (phi accrual + RTT)")
    p.add_argument("--phi-threshold", type=float, default=d.phi_threshold,
                   help="phi-accrual suspicion level (-log10 of the probability that a live node "
                        "is this late); higher = fewer false failures, slower detection")
    p.add_argument("--quorum-timeout", type=float, default=d.quorum_timeout,
                   help="seconds a node that hears no majority of the run waits, without stepping, "
                        "before it gives up (a partition's minority side, both halves of an even split)")
    p.add_argument("--on-failure", default=d.on_failure, choices=ON_FAILURE,
                   help="a node fails: ssgd/esync re-form over the survivors at the next step "
                        "(continue) or stop the run naming it (stop); asgd always continues. With "
                        "continue, a node restarted with the same --node and --run-id rejoins")
    p.add_argument("--keys", default=os.environ.get(ENV_KEYS) or None, metavar="DIR",
                   help=f"folder of this host's node key files ('p2psync keys gen'; default ${ENV_KEYS}): "
                        "needed when the topology lists public keys; every connection then runs CurveZMQ")
    p.add_argument("--shm", action="store_true",
                   help="send pieces of 64 KiB or more to nodes on this host (loopback addresses) through "
                        "shared memory in /dev/shm instead of TCP (a full /dev/shm falls back to TCP), and "
                        "the collectives' messages to them as Unix datagrams")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="write every node's state (parameters, optimizer, strategy, step, data position, "
                        "RNG) every N steps to <run>/node-<id>/checkpoint.pt, atomically")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                   help="built-in job: the learning rate stays (constant), decays to 0 along a cosine over "
                        "the run's steps (cosine; needs --steps or --epochs), or rises linearly over the first "
                        "5%% of the steps, then decays along a cosine to 10%% of its peak (warmup-cosine), stepped "
                        f"after every optimizer step (default: {d.lr_schedule}; warmup-cosine for the lm-* models)")
    p.add_argument("--buffers", default=d.buffers, choices=BUFFER_MODES,
                   help="module buffers (BatchNorm statistics) at every synchronizing step: the lowest "
                        "member's, bitwise (broadcast, as DDP), the group's mean of the floating-point ones "
                        "(average), or each node's own (local)")
    p.add_argument("--audit-every", type=int, metavar="N",
                   help="every N steps, members that should hold one model compare a hash of their parameters "
                        "and buffers (a mismatch ends the run naming the nodes and the first tensor); the "
                        "end of the run is always audited")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (<out>/<run-id>) from its nodes' checkpoints (same "
                        "topology and options; --steps/--epochs count the whole run, --time this part), at the "
                        "latest step every node can restore (ssgd: the latest any node has; the others adopt it)")
    p.add_argument("--init-from", metavar="FILE",
                   help="built-in job: start from the model weights in FILE (a node's checkpoint.pt of an earlier "
                        "run, e.g. its --checkpoint-every file, or a torch.save of the model's state_dict) instead "
                        "of the seed's; the optimizer, the schedule and the step count start afresh (fine-tuning, "
                        "or comparing strategies from one pretrained model)")
    p.add_argument("--single", action="store_true",
                   help="built-in job: the single-process reference of this run instead of the run: one "
                        "process (a one-node topology at the first node's address, saved in the run folder) "
                        "trains on the whole training set with --batch-size times the topology's node count per "
                        "step, so every step sees the samples (tokens) all nodes see together, from the same "
                        "initial weights, with the same optimizer and schedule (no strategy, codec, shaping or "
                        "emulated slowdown)")
    p.add_argument("--no-progress", action="store_true", help="launcher: no live display")
    p.set_defaults(func=run, cmd=None)


def codec_arg(value: str) -> str:
    """``--codec``: a known codec (``topk:F`` with its fraction checked), else a usage error."""
    try:
        get_codec(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def config_from_args(args: argparse.Namespace) -> RunConfig:
    opts: list[tuple[str, str]] = []
    for item in args.opt:
        if "=" not in item:
            raise ConfigError(f"--opt {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        opts.append((k.strip(), v.strip()))
    if args.esync_mode:
        if args.strategy != "esync":
            raise ConfigError("--esync-mode needs --strategy esync")
        opts.append(("mode", args.esync_mode))
    out, run_id = args.out, args.run_id
    if args.resume is not None:  # the run folder names both
        folder = Path(args.resume)
        if not folder.is_dir():
            raise ConfigError(f"--resume {args.resume}: no such run folder")
        if run_id is not None and run_id != folder.name:
            raise ConfigError(f"--resume {args.resume} continues run {folder.name!r}, not --run-id {run_id!r}")
        out, run_id = str(folder.parent), folder.name
    epochs, steps = args.epochs, args.steps
    lm = args.model in LM_SPECS
    # the built-in job needs a budget; a script's own loop decides when it is done
    if steps is None and epochs is None and args.time_limit is None and args.cmd is None:
        if lm:
            steps = DEFAULT_LM_STEPS
        else:
            epochs = DEFAULT_EPOCHS
    d = RunConfig(topology="")
    given = {k: getattr(args, k) for k in LM_DEFAULTED if getattr(args, k) is not None}
    job = {**{k: getattr(d, k) for k in LM_DEFAULTED}, **lm_defaults(args.model, args.optimizer), **given}
    if job["lr_schedule"] == "warmup-cosine" and steps is None and epochs is None and "lr_schedule" not in given:
        job["lr_schedule"] = "constant"  # a run bounded by --time only: no length to decay over
    data = args.data if args.data is not None else (LM_DATASETS[0] if lm else d.data)
    cfg = RunConfig(
        topology=args.topology, strategy=args.strategy, steps=steps, epochs=epochs,
        time_limit=args.time_limit, model=args.model, data=data, data_dir=args.data_dir,
        synthetic_size=args.synthetic_size, partition=args.partition,
        dirichlet_alpha=args.dirichlet_alpha, shards_per_node=args.shards_per_node,
        optimizer=job["optimizer"], lr=job["lr"], lr_schedule=job["lr_schedule"], momentum=args.momentum,
        weight_decay=job["weight_decay"],
        batch_size=job["batch_size"], seed=args.seed, eval_every=args.eval_every,
        eval_seconds=args.eval_seconds, out=out,
        run_id=run_id, device=args.device, threads=args.threads,
        start_timeout=args.start_timeout, peer_timeout=args.peer_timeout, heartbeat=args.heartbeat,
        failure_timeout=args.failure_timeout, phi_threshold=args.phi_threshold,
        quorum_timeout=args.quorum_timeout, shaper=args.shaper,
        wan=args.wan, nic_mbps=args.nic_mbps, hidden=args.hidden, slowdown=args.slowdown,
        slowdown_schedule=args.slowdown_schedule, step_time=args.step_time,
        slowdown_mode=args.slowdown_mode, step_jitter=args.step_jitter, codec=args.codec, piece_kib=args.piece_kib,
        error_feedback=args.error_feedback, collective=args.collective, strategy_options=tuple(opts),
        progress=not args.no_progress, on_failure=args.on_failure,
        keys=str(Path(args.keys).absolute()) if args.keys else None, checkpoint_every=args.checkpoint_every,
        shm=args.shm, buffers=args.buffers, audit_every=args.audit_every,
        resume=str(Path(args.resume).absolute()) if args.resume else None,
        init_from=str(Path(args.init_from).absolute()) if args.init_from else None,
        command=tuple(args.cmd) if args.cmd is not None else None)
    from p2psync.strategies.base import get_strategy, parse_options

    parse_options(get_strategy(cfg.strategy), dict(cfg.strategy_options))  # fail early
    return cfg


def run(args: argparse.Namespace) -> int:
    from p2psync.topology import load

    from p2psync.strategies.base import get_strategy, parse_options

    cfg = config_from_args(args)
    topo = load(cfg.topology)  # validate before starting anything
    if args.single:
        cfg, topo = single_reference(cfg, topo, args)
    # the strategy's options, also those checked against the topology (a group size vs N)
    opts = parse_options(get_strategy(cfg.strategy), dict(cfg.strategy_options), topology=topo)
    if args.cmd is None:  # the built-in job's optimizer is known: checked before any node starts
        from p2psync.strategies.needs import OptimizerInfo, check

        cls = get_strategy(cfg.strategy)
        shape = repeated_blocks(cfg.model)  # (a language model's shape is known from its name too)
        if shape is not None:
            cls.check_blocks(opts, blocks=shape[0], rest=shape[1])
        try:
            check(cls.name, cls.needs, OptimizerInfo.builtin(cfg.optimizer, momentum=cfg.momentum))
        except ConfigError as exc:
            if cfg.lm is not None and args.optimizer is None:
                raise ConfigError(f"{exc}\n--model {cfg.model} trains with --optimizer {cfg.optimizer} unless "
                                  "told otherwise: choose one this strategy supports (e.g. --optimizer sgd)") from None
            raise
    if args.node is not None and args.node not in topo.ids:
        raise ConfigError(f"--node {args.node}: no such node in {cfg.topology} (ids {topo.ids})")
    check_keys(cfg, topo, args.node)
    if cfg.slowdown_mode == "quota":
        check_quota(cfg, topo, args.node)
    if args.cmd is not None:
        return run_script(cfg, topo, args.node, args.cmd)
    if args.node is None:
        from p2psync.cli.launch import launch

        return launch(cfg, topo)
    return run_one(cfg, args.node)


def quota_caps(cfg: RunConfig, topo: Topology, nodes: Sequence[int]) -> dict[int, float]:
    """The CPU cores each of ``nodes`` is capped at under ``--slowdown-mode quota``, at its
    fastest over the run (the largest cap it sets)."""
    from p2psync.training.cpu_quota import controller, host_share
    from p2psync.training.hetero import default_profile, parse_profiles

    profiles = parse_profiles(cfg.slowdown, cfg.slowdown_schedule, cfg.step_time, cfg.slowdown_mode,
                              cfg.step_jitter)
    ctl = controller()
    return {n: host_share(profiles, topo, n, ctl) / profiles.get(n, default_profile(cfg.slowdown_mode)).fastest
            for n in nodes}


def check_quota(cfg: RunConfig, topo: Topology, node: int | None) -> None:
    """``--slowdown-mode quota``: this host lets the nodes it runs (``node``, or all) cap their
    CPU at the largest cap one of them sets; refused here (ConfigError), before any starts.
    The empty groups earlier runs' killed nodes left behind are removed first."""
    from p2psync.training.cpu_quota import bandwidth, probe, sweep

    sweep()
    caps = quota_caps(cfg, topo, [node] if node is not None else topo.ids).values()
    bandwidth(min(caps))  # the smallest cap too is one the kernel can grant
    probe(max(caps))


def single_reference(cfg: RunConfig, topo: Topology, args: argparse.Namespace) -> tuple[RunConfig, Topology]:
    """``--single``: the config and one-node topology of the run's single-process reference
    (see the option's help); the topology is written to ``<run>/topology-single.json``."""
    from dataclasses import replace

    from p2psync.api.runtime import default_run_id
    from p2psync.topology import mesh, save

    if args.cmd is not None:
        raise ConfigError("--single runs the built-in job: a script's single-process reference is the script "
                          "run alone (python SCRIPT, with the nodes' batches together)")
    if args.node is not None:
        raise ConfigError("--single runs one process of its own: it takes no --node")
    if args.resume is not None:
        raise ConfigError("--single cannot --resume a run")
    first = topo.node(topo.ids[0]).nics[0]
    one = replace(mesh(1, base_port=first.port, hosts=[first.address]), name=f"{topo.name}-single")
    run_id = cfg.run_id or default_run_id(one, "single")
    folder = Path(cfg.out) / run_id
    path = folder / "topology-single.json"
    with translate({OSError: lambda e: ConfigError(f"--single: cannot write {path}: {e}")}):
        folder.mkdir(parents=True, exist_ok=True)
        save(one, path)
    single = replace(cfg, topology=str(path), run_id=run_id, strategy="ssgd", strategy_options=(), codec="none",
                     error_feedback=False, shaper="none", wan=None, nic_mbps=None, slowdown="",
                     slowdown_schedule="", step_time="", keys=None, batch_size=cfg.batch_size * topo.size)
    return single, one


def check_keys(cfg: RunConfig, topo: Topology, node: int | None) -> None:
    """Keys given exactly when the topology lists them (each node's file checked before any
    process starts); a run without keys says once that nobody is authenticated."""
    from p2psync.transport.keys import node_keys

    for i in ([node] if node is not None and node in topo.ids else topo.ids):
        node_keys(cfg.keys, topo, i, topo_path=cfg.topology)


def run_script(cfg: RunConfig, topo: Topology, node: int | None, cmd: Sequence[str]) -> int:
    """``p2psync run TOPOLOGY ... -- CMD``: CMD once per node (``launch_script``), or with
    ``--node K`` (and ``--run-id``) only node K's, in the foreground: this process becomes CMD
    (same pid, signals, terminal, exit code), with the environment the launcher gives node K's
    copy when it starts every node (``script_env``; the nodes on this host are those the
    topology's addresses put here)."""
    from p2psync.api.env import host_nodes
    from p2psync.cli.launch import script_env
    from p2psync.transport.keys import warned_env

    if not cmd:
        raise ConfigError("nothing to run after --")
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"cannot run {cmd[0]!r}: no such executable file"
                          + ("" if "/" in cmd[0] else " in PATH"))
    if node is None:
        from p2psync.cli.launch import launch_script

        return launch_script(cfg, topo, cmd)
    if node not in topo.ids:
        raise ConfigError(f"--node {node}: no such node in {cfg.topology} (ids {topo.ids})")
    if cfg.run_id is None:
        raise ConfigError(f"--node {node} with a command needs --run-id ID, the same on every host: the copy's "
                          f"own folder (P2PSYNC_RUN_DIR) is {Path(cfg.out) / 'ID' / f'node-{node}'}")
    env = script_env(cfg, topo, node, host_nodes(topo, node))
    if cfg.slowdown_mode == "quota":  # this process's group and cap stay with the command it becomes
        from p2psync.training.cpu_quota import CpuQuota

        CpuQuota.create().set(quota_caps(cfg, topo, [node])[node])
    sys.stdout.flush()
    sys.stderr.flush()
    with translate({OSError: lambda e: ConfigError(f"cannot run {cmd[0]!r}: {e.strerror}")}):
        os.execvpe(cmd[0], list(cmd), {**os.environ, **env, **warned_env()})


def run_one(cfg: RunConfig, node_id: int) -> int:
    """Run a single node (the built-in job) in this process; map outcomes to exit codes."""
    from p2psync.cli.builtin_job import run_builtin

    def on_term(sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        stats = run_builtin(cfg, node_id)
    except KeyboardInterrupt:
        print(f"node {node_id}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError:
        raise
    except RunEnded as exc:  # a new process that came too late: nothing is left to rejoin
        print(f"node {node_id}: not rejoined: {exc}", file=sys.stderr)
        return EXIT_OK
    except Fenced as exc:  # restarted by the launcher, it rejoins (unless it was excluded)
        print(f"node {node_id}: {exc}", file=sys.stderr)
        return EXIT_FENCED if exc.rejoin else EXIT_FAILED
    except P2PSyncError as exc:
        print(f"node {node_id}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        signal.signal(signal.SIGTERM, old)
    acc = stats.get("final_accuracy")
    with contextlib.suppress(OSError):  # the node's log on a full disk: the node did finish
        print(f"node {node_id}: done: {stats.get('steps')} steps in {stats.get('wall_s')} s"
              + (f", test accuracy {acc:.4f}" if acc is not None else ""), file=sys.stderr, flush=True)
    return 0


