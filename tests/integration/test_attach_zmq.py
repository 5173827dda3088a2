"""``Session.attach`` with real training loops over real ZeroMQ (issue 11): two nodes in one
process, each with its own training thread and its own node runtime.

SSGD through the hooks must be exactly data-parallel SGD: the replicas stay bitwise equal and
equal (allclose) to one process training on the union of the nodes' batches. The loop uses what
users' loops use: an LR scheduler stepping the attached optimizer, gradient accumulation (two
backward passes per step), and ``state_dict()`` of the optimizer and of the session.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from p2psync.api.session import Session
from p2psync.errors import ConfigError, Diverged
from p2psync.strategies.base import REGISTRY, register
from p2psync.strategies.ssgd import SSGD
from p2psync.topology import ring, save
from p2psync.training.config import RunConfig
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)

STEPS = 6


def _batches(node: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7 + node)
    return [[(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(2)]
            for _ in range(STEPS)]


def _loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[list[Any]]) -> StepLR:
    sched = StepLR(opt, step_size=2, gamma=0.5)
    for k in range(STEPS):
        opt.zero_grad()
        for x, y in batches[k]:  # gradient accumulation: two backward passes per step
            (nn.functional.cross_entropy(model(x), y) / 2).backward()
        opt.step()
        sched.step()
    return sched


def _model(seed: int) -> nn.Module:
    """Built on the calling thread (torch's global generator is shared by threads)."""
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _run_node(cfg: RunConfig, i: int, model: nn.Module, out: dict[int, Any]) -> None:
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        if i == 0:
            s = Session(config=cfg, node=i)
        else:  # the explicit form: topology, node, strategy, options
            s = Session(cfg.topology, i, "ssgd", out=cfg.out, run_id=cfg.run_id, start_timeout=30,
                        peer_timeout=15)
        assert s.attach(model, opt) is opt  # the user's own optimizer object
        with pytest.raises(ConfigError, match="twice"):
            s.attach(model, opt)
        _loop(model, opt, _batches(i))
        params = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
        out[i] = {"params": params, "lr": opt.param_groups[0]["lr"], "session": s.state_dict(),
                  "opt_state": opt.state_dict(), "stats": s.close()}
    except BaseException as exc:  # reported by the test
        out[i] = exc


def test_session_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        Session("t.json", 0, "ssgd", learning_rate=0.1)
    with pytest.raises(ConfigError, match="node"):
        Session("t.json", None, "ssgd")


def test_ssgd_through_attach_is_data_parallel_sgd(tmp_path: Path) -> None:
    topo = tmp_path / "ring2.json"
    save(ring(2, base_port=free_port()), topo)
    cfg = RunConfig(topology=str(topo), strategy="ssgd", out=str(tmp_path), run_id="attach",
                    start_timeout=30, peer_timeout=15)
    out: dict[int, Any] = {}
    # seeded differently: the identical start must give both node 0's parameters
    models = [_model(100 + i) for i in (0, 1)]
    _in_threads(lambda i: _run_node(cfg, i, models[i], out), out)
    a, b = out[0], out[1]
    assert a["params"].tobytes() == b["params"].tobytes()  # replicas bitwise equal
    assert a["lr"] == pytest.approx(0.1 * 0.5 ** 3)  # the scheduler drove the attached optimizer
    assert a["session"]["step"] == STEPS and a["stats"]["steps"] == STEPS
    # one process on the union of the batches, from node 0's initial parameters
    ref = _model(100)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    both = [[*_batches(0)[k], *_batches(1)[k]] for k in range(STEPS)]
    sched = StepLR(ref_opt, step_size=2, gamma=0.5)
    for k in range(STEPS):
        ref_opt.zero_grad()
        for x, y in both[k]:
            (nn.functional.cross_entropy(ref(x), y) / 4).backward()
        ref_opt.step()
        sched.step()
    expect = torch.nn.utils.parameters_to_vector(ref.parameters()).detach().numpy()
    np.testing.assert_allclose(a["params"], expect, atol=1e-6)
    # the optimizer's own state_dict round-trips (momentum buffers, scheduled lr)
    fresh = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=1.0, momentum=0.5)
    fresh.load_state_dict(a["opt_state"])
    assert fresh.param_groups[0]["lr"] == pytest.approx(a["lr"]) and len(fresh.state) == 2


class _GradReady(SSGD):
    """SSGD that asks for the per-parameter gradient-ready hooks and records them."""

    name = "test-grad-ready"
    grad_ready = True

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.seen: list[tuple[int, int, np.ndarray]] = []

    def on_grad_ready(self, index: int, offset: int, grad: np.ndarray) -> None:
        self.seen.append((index, offset, grad))


if _GradReady.name not in REGISTRY:
    register(_GradReady)


def _two_nodes(tmp_path: Path, strategy: str, body: Any, **opts: Any) -> dict[int, Any]:
    """Run ``body(session, node)`` on two nodes (threads) of one run; returns their results."""
    topo = tmp_path / "ring2.json"
    save(ring(2, base_port=free_port()), topo)
    out: dict[int, Any] = {}

    def node(i: int) -> None:
        try:
            s = Session(str(topo), i, strategy, out=str(tmp_path), run_id=f"{strategy}-{opts.get('tag', '')}",
                        start_timeout=30, peer_timeout=15,
                        **{k: v for k, v in opts.items() if k != "tag"})
            out[i] = body(s, i)
        except BaseException as exc:  # reported by the test
            out[i] = exc

    _in_threads(node, out)
    return out


def _in_threads(fn: Any, out: dict[int, Any]) -> None:
    """``fn(i)`` for nodes 0 and 1 on their own threads; raises what a node stored in ``out``."""
    threads = [threading.Thread(target=fn, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for i in (0, 1):
        if isinstance(out.get(i), BaseException):
            raise out[i]


def test_gradient_ready_hooks_fire_per_parameter_during_backward(tmp_path: Path) -> None:
    """Issue 11: a strategy with ``grad_ready`` sees every parameter's gradient as backward
    produces it, last layer first, once per backward pass (two with accumulation)."""

    def body(s: Session, i: int) -> Any:
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        last: list[np.ndarray] = []
        for k in range(STEPS):
            opt.zero_grad()
            for x, y in _batches(i)[k]:
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            last = [p.grad.detach().reshape(-1).numpy().copy() for p in model.parameters()]
            opt.step()
        strategy = s.strategy
        s.close()
        return strategy.seen, last, [p.numel() for p in model.parameters()]

    # sync=step: the gradients in .grad stay local until optimizer.step() (with the default,
    # backward returns with the mean in .grad, which the hooks never see)
    out = _two_nodes(tmp_path, "test-grad-ready", body, strategy_options=(("sync", "step"),))
    for i in (0, 1):
        seen, last, sizes = out[i]
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        assert len(seen) == STEPS * 2 * len(sizes), len(seen)
        first_pass = [idx for idx, _, _ in seen[:len(sizes)]]
        assert first_pass == sorted(first_pass, reverse=True)  # backward: last layer first
        assert all(off == offsets[idx] and g.size == sizes[idx] for idx, off, g in seen)
        final = seen[-len(sizes):]  # the last backward pass of the last step
        for idx, _, g in final:
            np.testing.assert_array_equal(g, last[idx])


def test_dts_checkpoint_between_syncs_resumes_in_sync(tmp_path: Path) -> None:
    """Session.state_dict carries the strategy's state: a DTS checkpoint taken with windows in
    flight says so, and a run resumed from it re-synchronizes (every node loaded its own,
    different model) before going on; the nodes end with one model."""

    def first(s: Session, i: int) -> Any:
        model = _model(0)
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
        for k in range(4):  # t=2, p=2, budget 10: windows in flight after step 3
            opt.zero_grad()
            x, y = _batches(i)[k][0]
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "opt": opt.state_dict(), "p2psync": s.state_dict()}
        s.close(graceful=False)
        return ckpt

    ckpts = _two_nodes(tmp_path, "dts", first, strategy_options=(("t", "2"), ("p", "2")), tag="a")
    assert all(c["p2psync"]["strategy_state"]["in_sync"] is False for c in ckpts.values())
    a, b = (torch.nn.utils.parameters_to_vector(_load(c)[0].parameters()) for c in ckpts.values())
    assert not torch.allclose(a, b)  # each node holds its own local steps

    def resume(s: Session, i: int) -> Any:
        model, opt_state = _load(ckpts[i])
        s.load_state_dict(ckpts[i]["p2psync"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        opt.load_state_dict(opt_state)
        opt = s.attach(model, opt)
        for k in range(4, STEPS):
            opt.zero_grad()
            x, y = _batches(i)[k][0]
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if s.should_stop:
                break
        resyncs = s.strategy.resyncs
        s.close()
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), resyncs

    out = _two_nodes(tmp_path, "dts", resume, strategy_options=(("t", "2"), ("p", "2")), max_steps=STEPS,
                     tag="b")
    assert out[0][1] >= 1 and out[1][1] >= 1
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)


def _load(ckpt: dict[str, Any]) -> tuple[nn.Module, Any]:
    model = nn.Linear(4, 3)
    model.load_state_dict(ckpt["model"])
    return model, ckpt["opt"]


def _wide_mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def test_canary_colayer_exchanges_start_before_backward_ends(tmp_path: Path) -> None:
    """Issue 15: colayers leave as backward produces them (pipelining, Canary §4.3.2): the
    output colayer's exchange starts before the user's ``loss.backward()`` has returned."""
    models = {i: _wide_mlp() for i in (0, 1)}

    def body(s: Session, i: int) -> Any:
        model = models[i]
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
        g = torch.Generator().manual_seed(i)
        ends, live = [], []
        for t in range(STEPS):
            opt.zero_grad()
            x, y = torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            ends.append(time.perf_counter())
            if not s.should_stop:  # native Canary: a node behind stops as soon as it hears the
                live.append(t)     # other one did; a step begun after that exchanges nothing
            opt.step()
        starts = list(s.strategy.timeline)
        s.close()
        return ends, live, starts

    out = _two_nodes(tmp_path, "canary", body, strategy_options=(("colayers", "4"),), max_steps=STEPS)
    for i in (0, 1):
        ends, live, starts = out[i]
        first = {t: started for t, z, started in starts if z == 0}
        early = [t for t, started in first.items() if t < len(ends) and started < ends[t]]
        assert set(live) <= set(first) and len(early) > STEPS // 2, (first, ends, live)


def test_canary_gradient_accumulation_needs_pipeline_off(tmp_path: Path) -> None:
    def body(s: Session, i: int) -> Any:
        model = _model(0)
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for batches in _batches(i):
            opt.zero_grad()
            for x, y in batches:  # two backward passes per step
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            opt.step()
            if s.should_stop:  # native Canary: a node stops once it hears another one did
                break
        s.close()
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()

    with pytest.raises(ConfigError, match="pipeline=false"):
        _two_nodes(tmp_path, "canary", body, tag="a")
    out = _two_nodes(tmp_path, "canary", body, strategy_options=(("pipeline", "false"),), max_steps=STEPS, tag="b")
    assert out[0].tobytes() == out[1].tobytes()  # the final average


class _TwoHeads(nn.Module):
    """A model whose second head gets no gradient (an unused branch) in one colayer with the
    first head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_canary_pipelining_with_an_unused_branch_and_gradient_clipping(tmp_path: Path) -> None:
    """Review H3: a colayer with a parameter that got no gradient is sent at the step (it made
    the next step fail as "gradient accumulation"), and clipping after backward only warns."""
    models = {}
    for i in (0, 1):
        torch.manual_seed(5)
        models[i] = _TwoHeads()

    def body(s: Session, i: int) -> Any:
        model = models[i]
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        steps = 0
        for batches in _batches(i):
            opt.zero_grad()
            x, y = batches[0]
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            steps += 1
            if s.should_stop:
                break
        s.close()
        return steps, torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()

    out = _two_nodes(tmp_path, "canary", body, strategy_options=(("colayers", "2"),), max_steps=STEPS)
    assert max(out[0][0], out[1][0]) == STEPS
    assert out[0][1].tobytes() == out[1][1].tobytes()


def test_backward_returns_with_the_mean_and_no_sync_keeps_passes_local(tmp_path: Path) -> None:
    """ssgd's default: ``loss.backward()`` returns with the group's mean gradient in ``.grad``
    (both nodes see the same values right after backward, before step), ``no_sync()`` keeps a
    pass local, and the next pass averages the accumulated sum: the model is data-parallel SGD
    on the union of the batches, as in DDP."""

    models = [_model(100 + i) for i in (0, 1)]

    def body(s: Session, i: int) -> Any:
        model = models[i]
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
        seen: list[tuple[np.ndarray, np.ndarray]] = []
        for k in range(STEPS):
            opt.zero_grad()
            (first, second) = _batches(i)[k]
            with s.no_sync():
                (nn.functional.cross_entropy(model(first[0]), first[1]) / 2).backward()
            local = torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()]).numpy().copy()
            (nn.functional.cross_entropy(model(second[0]), second[1]) / 2).backward()
            mean = torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()]).numpy().copy()
            seen.append((local, mean))
            opt.step()
        s.close()
        return seen, torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()

    out = _two_nodes(tmp_path, "ssgd", body, tag="nosync")
    (seen0, w0), (seen1, w1) = out[0], out[1]
    assert w0.tobytes() == w1.tobytes()
    for (l0, m0), (l1, m1) in zip(seen0, seen1):
        assert not np.array_equal(l0, l1)  # no_sync: each node's own first micro-batch
        np.testing.assert_array_equal(m0, m1)  # right after backward: one mean on both
    ref = _model(100)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for k in range(STEPS):
        ref_opt.zero_grad()
        for x, y in [*_batches(0)[k], *_batches(1)[k]]:
            (nn.functional.cross_entropy(ref(x), y) / 4).backward()
        ref_opt.step()
    np.testing.assert_allclose(w0, torch.nn.utils.parameters_to_vector(ref.parameters()).detach().numpy(), atol=1e-6)


def _diverging(tmp_path: Path, loss: Any, tag: str, **opts: Any) -> dict[int, tuple[BaseException | None, float]]:
    """Two ssgd nodes each taking up to three steps of ``loss(model)`` on ``nn.Linear(4, 3)``:
    per node, the Diverged it ended with (None: it closed normally) and the seconds it took."""

    def body(s: Session, i: int) -> Any:
        model = nn.Linear(4, 3)
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        t0 = time.monotonic()
        try:
            for _ in range(3):
                opt.zero_grad()
                loss(model).backward()
                opt.step()
            s.close()
        except Diverged as exc:
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0

    return _two_nodes(tmp_path, "ssgd", body, tag=tag, **opts)


def test_a_sum_that_overflows_during_backward_ends_the_run_as_diverged(tmp_path: Path) -> None:
    """Finite gradients whose sum overflows float32 while backward averages them: the run ends
    with Diverged on the nodes (as at optimizer.step()), it is not redone over and over."""
    # each gradient finite, their sum not
    out = _diverging(tmp_path, lambda model: model(torch.ones(2, 4)).sum() * 3e38, "overflow")
    for i in (0, 1):
        exc, took = out[i]
        assert isinstance(exc, Diverged), (i, exc)
        assert took < 15, took  # not a peer timeout (30 s here) per redo


@pytest.mark.parametrize("sync", ["backward", "step"])
def test_a_sum_that_overflows_in_one_piece_only_ends_the_run_as_diverged_on_every_node(tmp_path: Path,
                                                                                       sync: str) -> None:
    """Only the first gradient element's sum overflows float32: one piece of the allreduce (its
    owner sees the infinity), while the other piece is finite. The node that does not own it
    learns of the divergence from its peer and ends with Diverged too, well before a peer
    timeout (15 s here), instead of waiting for a piece that is never sent."""
    out = _diverging(tmp_path, lambda model: model.weight[0, 0] * 3e38 + model(torch.ones(2, 4)).sum(),
                     f"overflow-one-{sync}", strategy_options=(("sync", sync),))
    for i in (0, 1):
        exc, took = out[i]
        assert isinstance(exc, Diverged), (i, exc)
        assert took < 10, (i, took)


def test_a_grad_scaler_unscales_the_mean_and_stays_equal(tmp_path: Path) -> None:
    """AMP's GradScaler under ssgd: the scaled gradients are averaged during backward,
    ``unscale_`` and clipping act on the mean, every node skips the same steps, and the replicas
    and the scalers' states stay equal."""
    models = [_model(100 + i) for i in (0, 1)]

    def body(s: Session, i: int) -> Any:
        model = models[i]
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
        norms = []
        for k in range(STEPS):
            opt.zero_grad()
            x, y = _batches(i)[k][0]
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            scaler.step(opt)
            scaler.update()
        s.close()
        return norms, scaler.state_dict(), torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()

    out = _two_nodes(tmp_path, "ssgd", body, tag="scaler")
    (n0, sc0, w0), (n1, sc1, w1) = out[0], out[1]
    assert n0 == n1 and sc0 == sc1 and w0.tobytes() == w1.tobytes()
    assert sc0["scale"] != 2.0 ** 16  # the scaler did work (it grew)


def test_a_session_moves_through_its_phases_and_a_step_after_the_stop_changes_nothing(tmp_path: Path) -> None:
    """CREATED, RUNNING once attached (attach returns with the strategy started), STOPPED when
    the run agreed to stop (``should_stop``), CLOSED after close; an ``optimizer.step()`` after
    the stop leaves the model as the run ended it."""
    from p2psync.api.lifecycle import Phase

    def body(s: Session, i: int) -> Any:
        phases = [s.phase]
        model = _model(7)
        opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        phases.append(s.phase)
        k = 0
        while not s.should_stop:
            opt.zero_grad()
            x, y = _batches(i)[k][0]
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            k += 1
        phases.append(s.phase)
        final = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # after the stop: no change (one warning)
        after = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        stats = s.close()
        phases.append(s.phase)
        return phases, k, stats["steps"], torch.equal(final, after)

    out = _two_nodes(tmp_path, "ssgd", body, tag="phases", max_steps=STEPS)
    for i in (0, 1):
        phases, k, steps, unchanged = out[i]
        assert phases == [Phase.CREATED, Phase.RUNNING, Phase.STOPPED, Phase.CLOSED], phases
        assert k == steps == STEPS and unchanged
