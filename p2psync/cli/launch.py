"""Launch every node of a topology as a subprocess on this host, show progress, summarize.

Two kinds of node process, one launcher: the built-in job (``launch``: ``python -m p2psync run
TOPOLOGY --node I --run-id ID ...``) and the user's own command (``launch_script``: CMD with the
variables of ``p2psync.api.env`` added to its environment). Either way a node's output goes to
``<run>/node-I.log`` and progress is read from its metrics file ``<run>/node-I.jsonl`` while
there is one (a script's ``Session`` writes it; '-' until then). Every node runs in a process
group of its own; SIGINT/SIGTERM stop every node (SIGTERM to the group, SIGKILL after a grace
period), and nodes die with the launcher (``PR_SET_PDEATHSIG``). A node that fails is reported
with the last line of its log.

The launcher follows the run, not a timer. A node that was *fenced* (removed from the run while
it paused, or on the minority side of a partition; it exits with ``EXIT_FENCED`` or leaves a
``node-I.fenced`` marker) is started again with ``--on-failure continue``, up to
``MAX_RESTARTS`` times, and rejoins with the majority's state — unless the run is over (the
coordinator wrote ``summary.json``, or every other node has exited): then it is *left out*, and
so is a restarted node whose new life ends without a record once the run is over (it found
nobody to join). After a failure the others run on as long as some node makes progress (a new
metrics record); only a run where nothing moved for :func:`hang_bound` seconds is stopped. The
exit status is 0 only when the run's coordinator wrote ``summary.json`` and every node ended
well or was left out (the run's model is then the majority's: a left-out node's progress after
its removal is void, and it is named on stderr).

The built-in job's nodes are forked from the launcher once it has imported what they import
(:mod:`p2psync.cli.fork_nodes`: torch's imports once instead of once per node); users' commands,
``--shaper netem`` (each node in its network namespace) and ``P2PSYNC_LAUNCH=exec`` exec them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from p2psync.cli.exit_codes import EXIT_FAILED, EXIT_FENCED, EXIT_INTERRUPTED
from p2psync.cli.fork_nodes import ENV_LAUNCH, LAUNCH_MODES, NodeProcess, die_with_parent, fork_node, warm_up
from p2psync.errors import ConfigError, translate
from p2psync.files import node_marker, reason
from p2psync.strategies.base import get_strategy
from p2psync.topology import Topology
from p2psync.training.config import RunConfig
from p2psync.training.metrics import bytes_sent
from p2psync.transport.keys import warned_env
from p2psync.api.env import thread_env
from p2psync.api.runtime import default_run_id

#: how to start node I: its command line and its environment (None: the launcher's own)
NodeSpec = Callable[[int], "tuple[list[str], dict[str, str] | None]"]
#: node I's arguments to ``p2psync`` when it is forked from the launcher (None: exec every node)
ForkSpec = Callable[[int], "list[str]"] | None

log = logging.getLogger("p2psync.cli")

STOP_GRACE_S = 4.0
POLL_S = 0.25
#: times one node is started again after it was fenced
MAX_RESTARTS = 3


def hang_bound(cfg: RunConfig) -> float:
    """Seconds without a new record from any node, after a failure, before the launcher stops
    a run as hung: longer than a minority waits for a majority (``--quorum-timeout``) plus a
    peer wait, so it never stops a run that the nodes themselves would still recover."""
    return cfg.quorum_timeout + cfg.peer_timeout + cfg.failure_timeout + 15


def start_bound(cfg: RunConfig) -> float:
    """Seconds the other nodes may go on after a failure while none of them has written a
    record yet (nothing to follow: they never trained, or do not train through p2psync)."""
    return cfg.failure_timeout + cfg.peer_timeout + 15


def fenced_marker(run_dir: Path, node: int) -> Path:
    """Where a fenced node's session leaves its reason (read, then removed, by the launcher)."""
    return node_marker(run_dir, node, "fenced")


def ended_marker(run_dir: Path, node: int) -> Path:
    """Where a node's session leaves why the run ended without it (:class:`RunEnded`: it came
    back as the run ended), read, then removed, by the launcher."""
    return node_marker(run_dir, node, "ended")


def default_threads(local_nodes: int) -> int:
    """Torch threads per node when ``local_nodes`` share this host's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_nodes))


def _child_setup() -> None:  # runs in the child between fork and exec
    os.setpgid(0, 0)  # a group of its own: stopping the node also stops what it started
    die_with_parent()


class _Tail:
    """Incrementally reads the JSON lines appended to a metrics file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.buf = ""
        self.last: dict[str, Any] = {}
        self.last_acc: float | None = None

    def poll(self) -> None:
        try:
            with self.path.open() as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.last = rec
            if rec.get("accuracy") is not None:
                self.last_acc = rec["accuracy"]


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


def _progress_table(tails: dict[int, _Tail], codes: dict[int, int | None], title: str, unit: str = "step") -> Any:
    """Live progress, one row per node; ``unit``: what the strategy's step is (ESync: a round)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("node", unit, "loss", "accuracy", "samples/s", "sent MB", "state"):
        t.add_column(col, justify="right")
    for i, tail in tails.items():
        r = tail.last
        t.add_row(str(i), _fmt(r.get("step"), "d"), _fmt(r.get("loss"), ".4f"), _fmt(tail.last_acc, ".4f"),
                  _fmt(r.get("samples_per_s"), ".0f"), _fmt(bytes_sent(r) / 1e6 if r else None, ".2f"),
                  _state(codes[i]))
    return t


def _fmt(value: Any, spec: str) -> str:
    """``value`` formatted, or '-' when a node has not reported it (no metrics file yet)."""
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _state(code: int | None) -> str:
    return "running" if code is None else ("done" if code == 0 else f"exit {code}")


def _status_line(tails: dict[int, _Tail], codes: dict[int, int | None], unit: str = "step") -> str:
    parts = []
    for i, tail in tails.items():
        r = tail.last
        if not r:
            parts.append(f"n{i} {_state(codes[i])}")
            continue
        acc = f" acc {tail.last_acc:.3f}" if tail.last_acc is not None else ""
        parts.append(f"n{i} {unit} {_fmt(r.get('step'), 'd')} loss {_fmt(r.get('loss'), '.3f')}{acc}")
    return " | ".join(parts)


def print_summary(run_dir: Path, tails: dict[int, _Tail], wall: float, unit: str = "step") -> None:
    """One row per node from ``summary.json`` or, for a node it does not list, the node's last
    metrics record; '-' for what no node reported (a script without metrics). ``unit``: what
    the strategy's step is; where it is not one local iteration (ESync's rounds) the table
    counts ``unit``s and, beside them, the local steps. A language model's run (its nodes report
    ``final_val_bpb``) adds the validation bits per byte and tokens/s."""
    from rich.console import Console
    from rich.table import Table

    nodes = _summary_nodes(run_dir / "summary.json")
    t = Table(title=f"run {run_dir.name}")
    local = unit != "step"
    rows = []
    for i, tail in tails.items():
        s = nodes.get(str(i))
        if not isinstance(s, dict):  # node did not finish: use its last metrics record
            r = tail.last
            s = {"steps": r.get("step"), "final_accuracy": tail.last_acc, "wall_s": r.get("time"),
                 "samples_per_s": r.get("samples_per_s"), "bytes_sent": bytes_sent(r) if r else None}
        rows.append(s)
    lm = any(isinstance(s.get("final_val_bpb"), (int, float)) for s in rows)  # a language model's run
    for col in ("node", f"{unit}s", *(["local steps"] if local else []), "final accuracy",
                *(["val bpb"] if lm else []), "wall s", "samples/s", *(["tokens/s"] if lm else []), "sent MB"):
        t.add_column(col, justify="right")
    for i, s in zip(tails, rows):
        t.add_row(str(i), _fmt(s.get("steps"), "d"), *([_fmt(s.get("local_steps"), "d")] if local else []),
                  _fmt(s.get("final_accuracy"), ".4f"), *([_fmt(s.get("final_val_bpb"), ".4f")] if lm else []),
                  _fmt(s.get("wall_s"), ".1f"), _fmt(s.get("samples_per_s"), ".0f"),
                  *([_fmt(s.get("tokens_per_s"), ".0f")] if lm else []),
                  _fmt(_scaled(s.get("bytes_sent"), 1e-6), ".2f"))
    accs = [s["final_accuracy"] for s in rows if isinstance(s.get("final_accuracy"), (int, float))]
    bpbs = [s["final_val_bpb"] for s in rows if isinstance(s.get("final_val_bpb"), (int, float))]
    t.add_row("all", "", *([""] if local else []), _fmt(sum(accs) / len(accs) if accs else None, ".4f"),
              *([_fmt(sum(bpbs) / len(bpbs) if bpbs else None, ".4f")] if lm else []),
              f"{wall:.1f}", _fmt(_total(rows, "samples_per_s"), ".0f"),
              *([_fmt(_total(rows, "tokens_per_s"), ".0f")] if lm else []),
              _fmt(_scaled(_total(rows, "bytes_sent"), 1e-6), ".2f"))
    console = Console()
    console.print(t)
    console.print(f"run folder: {run_dir}")


def _summary_nodes(path: Path) -> dict[str, Any]:
    """The ``nodes`` of a run's summary.json; {} if there is none (yet) or it is unreadable."""
    try:
        nodes = json.loads(path.read_text()).get("nodes", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return nodes if isinstance(nodes, dict) else {}


def _total(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return float(sum(values)) if values else None


def _scaled(value: Any, factor: float) -> float | None:
    return value * factor if isinstance(value, (int, float)) else None


def launch(cfg: RunConfig, topo: Topology) -> int:
    """The built-in training job on every node of ``topo``, all on this host."""
    child, run_id = _child_config(cfg, topo)
    args = ["run", cfg.topology, *child.to_argv()]
    base = [sys.executable, "-m", "p2psync", *args]
    try:
        fork: ForkSpec = (lambda i: [*args, "--node", str(i)]) if _forks(cfg) else None
    except KeyboardInterrupt:  # Ctrl+C while importing torch: no node started yet
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    run_dir = Path(cfg.out) / run_id
    code = _run_nodes(child, topo, run_dir, lambda i: ([*base, "--node", str(i)], None), fork)
    if code == 0 and not (run_dir / "summary.json").exists():
        print(f"every node ended but no coordinator holding a majority of the run wrote "
              f"{run_dir / 'summary.json'}: the run did not end as one", file=sys.stderr)
        return EXIT_FAILED
    return code


def _forks(cfg: RunConfig) -> bool:
    """Whether the built-in job's nodes are forked from this process: not with ``--shaper netem``
    (``ip netns exec``) nor ``P2PSYNC_LAUNCH=exec``; otherwise after :func:`warm_up`, if it is safe."""
    mode = os.environ.get(ENV_LAUNCH) or "fork"
    if mode not in LAUNCH_MODES:
        raise ConfigError(f"{ENV_LAUNCH}={mode}: expected one of {', '.join(LAUNCH_MODES)}")
    if mode == "exec" or cfg.shaper == "netem":
        return False
    why_not = warm_up()
    if why_not is not None:
        log.warning("%s: starting the nodes with exec", why_not)
    return why_not is None


def launch_script(cfg: RunConfig, topo: Topology, cmd: Sequence[str]) -> int:
    """The user's command ``cmd`` once per node of ``topo``, all on this host, each with the
    variables of ``p2psync.api.env`` (node, topology, config, its own run directory, ranks)."""
    if not cmd:
        raise ConfigError("nothing to run after --")
    child, run_id = _child_config(cfg, topo)
    named = replace(cfg, run_id=run_id)
    caps: dict[int, float] = {}
    if cfg.slowdown_mode == "quota":
        from p2psync.cli.run_cmd import quota_caps

        caps = quota_caps(cfg, topo, topo.ids)

    def spec(i: int) -> tuple[list[str], dict[str, str] | None]:
        # --slowdown-mode quota: the copy starts capped (cli/capped.py puts itself in its group, then
        # becomes the command)
        capped = [sys.executable, "-m", "p2psync.cli.capped", repr(caps[i]), "--"] if i in caps else []
        return [*capped, *cmd], {**os.environ, **script_env(named, topo, i, topo.ids)}

    run_dir = Path(cfg.out) / run_id
    code = _run_nodes(child, topo, run_dir, spec)
    if code == 0 and not (run_dir / "summary.json").exists():
        # every copy exited 0 but none joined the run: a script without p2psync.attach would
        # otherwise look like a successful distributed run
        print(f"the script never joined the run (no node called p2psync.attach(); no {run_dir / 'summary.json'}): "
              "each copy trained alone", file=sys.stderr)
        return EXIT_FAILED
    return code


def script_env(cfg: RunConfig, topo: Topology, node_id: int, local: Sequence[int]) -> dict[str, str]:
    """What ``p2psync run ... -- CMD`` adds to the environment of node ``node_id``'s copy of CMD,
    the same whether the launcher starts every node (``local``: all of them) or only this one
    (``--node``; ``local``: :func:`~p2psync.api.env.host_nodes`): the variables of
    :mod:`p2psync.api.env` (its own folder ``P2PSYNC_RUN_DIR``, created; its ``LOCAL_RANK``
    among ``local``) and ``OMP_NUM_THREADS`` (``--threads``, else the cores shared among
    ``local``). ``cfg.run_id`` must be set (ConfigError otherwise)."""
    from p2psync.api.env import node_env, node_run_dir

    if cfg.run_id is None:
        raise ConfigError(f"node {node_id}: a command's copies need the run id (--run-id ID) for their folders")
    if node_id not in local:
        raise ConfigError(f"node {node_id} is not among the nodes on this host {list(local)}")
    child = replace(cfg, threads=cfg.threads or default_threads(len(local)))
    env = node_env(child, topo, node_id, run_dir=node_run_dir(child.out, cfg.run_id, node_id),
                   local_rank=list(local).index(node_id), local_world_size=len(local))
    return {**thread_env(cfg.threads, child.threads), **env}


def _child_config(cfg: RunConfig, topo: Topology) -> tuple[RunConfig, str]:
    """The config every node process gets (a fixed run id, torch threads shared out), its run id."""
    run_id = cfg.run_id or default_run_id(topo, cfg.strategy)
    return replace(cfg, run_id=run_id, threads=cfg.threads or default_threads(topo.size)), run_id


def _run_nodes(cfg: RunConfig, topo: Topology, run_dir: Path, spec: NodeSpec, fork: ForkSpec = None) -> int:
    """Start every node (``spec``; forked from this process with ``fork``), inside its network
    namespace with ``--shaper netem`` (named with :func:`p2psync.transport.netem.launcher_prefix`).
    Afterwards, with ``--slowdown-mode quota``, the control groups of nodes killed before they
    removed theirs are removed."""
    netns = None
    if cfg.shaper == "netem":
        from p2psync.cli.netns_cmd import link_specs
        from p2psync.transport import netem

        netns = netem.plan(topo, link_specs(topo, cfg.wan), prefix=netem.launcher_prefix())
        try:
            netem.up(netns)
        except netem.NetemUnavailable as exc:
            raise ConfigError(f"--shaper netem: {exc}") from None
    try:
        return _start_and_monitor(cfg, topo, run_dir, spec, fork, netns)
    finally:
        if netns is not None:
            from p2psync.transport import netem

            netem.down(netns)
        if cfg.slowdown_mode == "quota":
            from p2psync.training.cpu_quota import sweep

            sweep()


def _start_and_monitor(cfg: RunConfig, topo: Topology, run_dir: Path, spec: NodeSpec, fork: ForkSpec,
                       netns: Any) -> int:
    with translate({OSError: lambda e: ConfigError(f"cannot create the run folder {run_dir} for the nodes' logs: "
                                                   f"{reason(e)}")}):
        run_dir.mkdir(parents=True, exist_ok=True)
    stop: dict[str, Any] = {"signal": None}

    def on_signal(sig: int, _frame: Any) -> None:
        stop["signal"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[int, NodeProcess] = {}
    groups: set[int] = set()  # process groups of the nodes (each node leads its own) that exist
    logs: dict[int, Any] = {}
    t0 = time.monotonic()

    def start(i: int) -> NodeProcess:
        """Start node ``i`` (again, after a fence: its log goes on)."""
        argv, env = spec(i)
        old_log = logs.pop(i, None)
        if old_log is not None:
            old_log.close()
        log_path = run_dir / f"node-{i}.log"
        with translate({OSError: lambda e: ConfigError(f"cannot write node {i}'s log {log_path}: {reason(e)}")}):
            log_f = logs[i] = log_path.open("ab" if old_log is not None else "wb")
        prefix = netns.exec_prefix(i) if netns is not None else []
        proc: NodeProcess
        try:
            # the launcher said it already if the cluster is unauthenticated: not every node again
            env = {**(os.environ if env is None else env), **warned_env()}
            if fork is not None:  # other nodes' logs: not held by this one
                proc = fork_node(fork(i), env, log_f.fileno(), [f.fileno() for n, f in logs.items() if n != i],
                                 f"p2psync-node{i}")
            else:
                proc = subprocess.Popen([*prefix, *argv], env=env, stdout=log_f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
        except OSError as exc:
            raise ConfigError(f"node {i}: cannot start {argv[0]!r}: {exc.strerror}") from None
        groups.add(proc.pid)
        return proc

    try:
        for i in topo.ids:
            procs[i] = start(i)
        return _monitor(cfg, run_dir, procs, groups, stop, t0, start)
    finally:
        _stop_all(procs, groups)
        for f in logs.values():
            f.close()
        for s, h in old.items():
            signal.signal(s, h)


def _take(marker: Path) -> str | None:
    """A marker's reason, the marker removed (None: there is none)."""
    try:
        why = marker.read_text(errors="replace").strip()
        marker.unlink()
    except OSError:
        return None
    return why


def _fenced(run_dir: Path, node: int, code: int | None) -> str | None:
    """Why node ``node``, which ended with exit status ``code``, was fenced (its marker, which
    is removed), or None when it was not. A node still running (``code`` None) is not looked
    at: it leaves its marker before it exits, and the reason must still be there then."""
    if code is None:
        return None
    why = _take(fenced_marker(run_dir, node))
    if why is None and code == EXIT_FENCED:
        why = "fenced"
    return why if code not in (None, 0) else None


@dataclass(frozen=True)
class NodeEnd:
    """What the launcher does about a node whose process it found ended (:func:`on_node_end`):
    ``restart`` it (it rejoins with the majority's state), leave it out of the run with
    ``left_out`` as the reason (the run's model is the majority's), or neither; ``failure``:
    the end counts as a failure (the hang bound starts from the first one)."""

    restart: bool = False
    left_out: str | None = None
    failure: bool = False


def on_node_end(code: int, fenced: str | None, *, over: bool, may_restart: bool, restarted: bool,
                wrote_since_restart: bool, ended: str | None = None) -> NodeEnd:
    """The launcher's decision for a node whose process exited with ``code`` (pure; see the
    module docstring). ``fenced``: why it was removed from the run (:func:`_fenced`), or None;
    ``over``: the run ended as far as it is concerned (:func:`run_over`); ``may_restart``:
    the launcher may start it again (``--on-failure continue``, restarts left, no stop
    signal); ``restarted``: this process was such a new start, and ``wrote_since_restart``
    whether it wrote a metrics record since.

    A fenced node is left out once the run is over, else started again when allowed; a new
    life that ended without a record once the run is over found nobody to join: left out
    too, and so is one that came back as the run ended (``ended``: its session's reason,
    :class:`~p2psync.errors.RunEnded`), whatever its exit status. Any other non-zero end is a
    failure."""
    if ended is not None:
        return NodeEnd(left_out=f"it came back as the run ended ({ended[:200]})")
    if fenced is not None and over:
        return NodeEnd(left_out=f"it was removed from the run ({fenced[:200]}) and the run ended before it could "
                                "rejoin")
    if fenced is not None and may_restart:
        return NodeEnd(restart=True)
    if code != 0 and over and restarted and not wrote_since_restart:
        return NodeEnd(left_out="it was removed from the run and its new process found the run over before it "
                                "could rejoin")
    return NodeEnd(failure=code != 0)


def _monitor(cfg: RunConfig, run_dir: Path, procs: dict[int, NodeProcess], groups: set[int],
             stop: dict[str, Any], t0: float, start: Callable[[int], NodeProcess] | None = None) -> int:
    tails = {i: _Tail(run_dir / f"node-{i}.jsonl") for i in procs}
    unit = get_strategy(cfg.strategy).step_unit
    codes: dict[int, int | None] = {i: None for i in procs}
    live = None
    if cfg.progress and sys.stdout.isatty():
        from rich.live import Live

        live = Live(_progress_table(tails, codes, run_dir.name, unit), refresh_per_second=4)
        live.start()
    last_print = time.monotonic()
    first_failure: tuple[float, int] | None = None
    patience = hang_bound(cfg)
    restarts: dict[int, int] = {}
    restarted_at: dict[int, int] = {}  # a restarted node -> its metrics file's size at the restart
    left_out: dict[int, str] = {}  # nodes removed from the run that could not rejoin before its end
    progress = time.monotonic()  # the last time any node wrote a record
    try:
        while True:
            for i, p in list(procs.items()):
                if codes[i] is not None:
                    continue
                code = codes[i] = p.poll()
                if code is None:
                    continue
                why = _fenced(run_dir, i, code)
                tails[i].poll()
                end = on_node_end(code, why, over=run_over(run_dir, codes, i), ended=_take(ended_marker(run_dir, i)),
                                  may_restart=start is not None and cfg.on_failure == "continue"
                                  and restarts.get(i, 0) < MAX_RESTARTS and stop["signal"] is None,
                                  restarted=i in restarted_at,
                                  wrote_since_restart=tails[i].pos != restarted_at.get(i, tails[i].pos))
                if end.restart and start is not None:
                    restarts[i] = restarts.get(i, 0) + 1
                    print(f"node {i} was removed from the run ({str(why)[:200]}); starting it again "
                          f"({restarts[i]}/{MAX_RESTARTS}): it rejoins with the majority's state",
                          file=sys.stderr, flush=True)
                    restarted_at[i] = tails[i].pos
                    procs[i], codes[i] = start(i), None
                    continue
                if end.left_out is not None:
                    left_out[i] = end.left_out
                elif end.failure and first_failure is None:
                    first_failure = (time.monotonic(), i)
            _prune(groups)
            for tail in tails.values():
                before = tail.pos
                tail.poll()
                if tail.pos != before:
                    progress = time.monotonic()
            if live is not None:
                live.update(_progress_table(tails, codes, run_dir.name, unit))
            elif cfg.progress and time.monotonic() - last_print > 5:
                print(_status_line(tails, codes, unit), flush=True)
                last_print = time.monotonic()
            if stop["signal"] is not None:
                break
            if all(c is not None for c in codes.values()):
                break
            # nodes that never wrote a record (a script that does not train through p2psync, or
            # not yet): no progress to follow, the short bound of a failed start applies
            bound = patience if any(t.pos for t in tails.values()) else start_bound(cfg)
            if first_failure is not None and time.monotonic() - max(first_failure[0], progress) > bound:
                print(f"no node made progress for {bound:.0f}s after node {first_failure[1]} failed: the run "
                      f"hangs, stopping it", file=sys.stderr)
                break
            time.sleep(POLL_S)
    finally:
        if live is not None:
            live.stop()
    if stop["signal"] is not None:
        _stop_all(procs, groups)
        print(f"interrupted: stopped {len(procs)} nodes", file=sys.stderr)
        return EXIT_INTERRUPTED
    stopped = set(_stop_all(procs, groups))
    for tail in tails.values():
        tail.poll()
    print_summary(run_dir, tails, time.monotonic() - t0, unit)
    for i, why in sorted(left_out.items()):
        print(f"node {i} left out: {why}; the run's model is the majority's", file=sys.stderr)
    failed = {i: procs[i].returncode for i in procs if procs[i].returncode != 0 and i not in left_out}
    for i, code in sorted(failed.items()):
        if i in stopped:
            print(f"node {i} stopped by the launcher (the run hung after a failure)", file=sys.stderr)
        else:
            log_path = run_dir / f"node-{i}.log"
            print(f"node {i} failed (exit {code}): {_last_line(log_path) or f'no output ({log_path})'}",
                  file=sys.stderr)
    models = models_at_end(run_dir, cfg.strategy) if cfg.buffers != "local" else None  # (hashes cover buffers)
    if models is not None:
        print(f"the run ended with {models}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_FAILED if failed else 0


def run_over(run_dir: Path, codes: Mapping[int, int | None], node: int) -> bool:
    """Whether the run ended as far as node ``node`` is concerned: its coordinator wrote
    ``summary.json``, or every other node's process has exited (``codes``: exit statuses,
    None while running)."""
    if (run_dir / "summary.json").exists():
        return True
    return all(c is not None for n, c in codes.items() if n != node)


def models_at_end(run_dir: Path, strategy: str) -> str | None:
    """What is wrong with the run's end, for a strategy that promises one model after every
    step (its nodes' ``params_sha1`` in ``summary.json`` differ), or None (one model, a strategy
    that promises it only at an agreed stop, which warns itself when a loop's end left several,
    or no summary: the callers say that themselves)."""
    if get_strategy(strategy).identical_replicas != "every_step":
        return None
    nodes = _summary_nodes(run_dir / "summary.json")
    hashes: dict[str, list[str]] = {}
    for node, rec in nodes.items():
        sha = rec.get("params_sha1") if isinstance(rec, dict) else None
        if isinstance(sha, str):
            hashes.setdefault(sha, []).append(node)
    if len(hashes) <= 1:
        return None
    groups = "; ".join(f"nodes {', '.join(sorted(v, key=int))}: {k}" for k, v in sorted(hashes.items()))
    return f"{len(hashes)} different models where {strategy} promises one ({groups})"


def _stop_all(procs: dict[int, NodeProcess], groups: set[int]) -> list[int]:
    """SIGTERM the nodes' process groups, SIGKILL what is left of them after STOP_GRACE_S.
    Returns the nodes whose own process was still running (stopped here)."""
    running = [i for i, p in procs.items() if p.poll() is None]
    _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for i in running:
        try:
            procs[i].wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while _prune(groups) and time.monotonic() < deadline:  # what the nodes started themselves
        time.sleep(0.05)
    _signal(groups, signal.SIGKILL)
    for i in running:
        procs[i].wait()
    _prune(groups)
    return running


def _signal(groups: set[int], sig: int) -> None:
    for pgid in list(groups):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            groups.discard(pgid)
        except PermissionError:  # pragma: no cover - not ours (any more)
            groups.discard(pgid)


def _prune(groups: set[int]) -> int:
    """Forget the process groups that no longer exist; how many are left. Called every poll, so a
    group's number is forgotten before the kernel can reuse it and never signalled after that."""
    _signal(groups, 0)
    return len(groups)
