"""Pure parts of DDP semantics: bucket plans, the replica audit's decision, module buffers as
raw bytes, and the user's training state (schedulers, hyperparameters) captured and restored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from p2psync.errors import ConfigError, ProtocolError
from p2psync.strategies.audit import DIGEST, first_mismatch
from p2psync.strategies.backward_sync import plan_buckets
from p2psync.model.flat import FlatModel
from p2psync.training.user_state import UserState, decode, encode


def test_buckets_cover_every_parameter_once_last_first() -> None:
    sizes = [10, 1000, 3, 5000, 7, 250_000, 2]
    plan = plan_buckets(sizes, bucket_bytes=8000)
    covered = [i for lo, hi in plan for i in range(lo, hi)]
    assert sorted(covered) == list(range(len(sizes)))
    assert plan[0][1] == len(sizes)  # the last parameters first: backward produces them first
    assert all(b[1] == a[0] for a, b in zip(plan, plan[1:]))  # contiguous, descending
    # the first bucket closes at a quarter of the size; the others at the size
    assert sum(sizes[i] for i in range(*plan[0])) * 4 >= 2000
    assert plan_buckets([5], 1 << 20) == [(0, 1)]
    with pytest.raises(ValueError):
        plan_buckets([1], 0)


def test_a_huge_parameter_closes_its_bucket_at_once() -> None:
    plan = plan_buckets([4, 1 << 20, 4, 4], bucket_bytes=1024)
    assert plan == [(1, 4), (0, 1)]


def _rows(n: int, names: list[str]) -> list[np.ndarray]:
    return [np.arange(len(names) * DIGEST, dtype=np.uint8) for _ in range(n)]


def test_audit_names_the_nodes_that_differ_and_the_first_tensor() -> None:
    names = ["a.weight", "a.bias", "bn.running_mean"]
    rows = _rows(4, names)
    assert first_mismatch([0, 1, 2, 3], rows, names) is None
    rows[2] = rows[2].copy()
    rows[2][2 * DIGEST] ^= 1  # node 2's running_mean
    rows[3] = rows[3].copy()
    rows[3][DIGEST + 3] ^= 1  # node 3's bias
    bad = first_mismatch([0, 1, 2, 3], rows, names)
    assert bad is not None and bad.reference == 0 and bad.nodes == (2, 3)
    assert bad.tensor == "a.bias" and bad.tensors == 2


def test_audit_reference_is_the_lowest_id_whatever_the_order() -> None:
    names = ["w"]
    rows = _rows(3, names)
    rows[0] = rows[0] + 1  # group order (5, 2, 9): node 5 differs from node 2
    bad = first_mismatch([5, 2, 9], rows, names)
    assert bad is not None and bad.reference == 2 and bad.nodes == (5,)


class _BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scale64", torch.tensor(1.5, dtype=torch.float64))
        self.register_buffer("h16", torch.ones(2, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def test_buffers_move_bitwise_whatever_their_dtype() -> None:
    torch.manual_seed(0)
    a, b = _BN(), _BN()
    a(torch.randn(8, 3))
    with torch.no_grad():
        a.scale64.fill_(1.0 / 3.0)  # not representable in float32
        a.mask.logical_not_()
        a.h16.mul_(3)
    fa = FlatModel(model=a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
    fb = FlatModel(model=b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1))
    assert fa.buffer_bytes == fb.buffer_bytes > 0
    fb.write_buffers(fa.read_buffers())
    for (n, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        assert x.dtype == y.dtype and torch.equal(x, y), n
    assert [d for _, d in fa.digests()][-5:] == [d for _, d in fb.digests()][-5:]
    with pytest.raises(ValueError):
        fb.set_buffers(np.zeros(3, np.uint8))


def test_float_buffers_average_keeps_each_dtype() -> None:
    m = _BN()
    f = FlatModel(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    vals = f.float_buffers()
    assert vals.dtype == np.float32 and vals.size == 4 + 4 + 1 + 2
    f.set_float_buffers(np.full(vals.size, 2.0, np.float32))
    assert m.bn.running_var.tolist() == [2.0] * 4 and m.scale64.dtype == torch.float64 and float(m.scale64) == 2.0
    assert int(m.bn.num_batches_tracked) == 0  # not a float: untouched


def _opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Linear(2, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_a_scheduler_created_after_attach_is_found_and_restored_at_the_first_step() -> None:
    m, opt = _opt()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(4):
        opt.step()
        sched.step()
    saved = decode(encode(UserState(opt).capture()))
    # a fresh process: optimizer restored, the scheduler created after attach
    m2, opt2 = _opt()
    opt2.load_state_dict(opt.state_dict())
    us = UserState(opt2)
    us.restore(saved, absorb=False)  # no scheduler yet: pending
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)  # a schedule from its start
    assert sched2.last_epoch == 0
    us.on_step()  # the first optimizer.step(): found and restored
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and sched2.last_epoch == 4
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_an_adopted_state_absorbs_the_scheduler_step_of_the_skipped_iteration() -> None:
    _, donor = _opt()
    ds = torch.optim.lr_scheduler.LambdaLR(donor, lambda e: 1.0 / (1 + e))
    for _ in range(5):
        donor.step()
        ds.step()
    state = UserState(donor).capture()  # the donor, parked at the start of step 5
    _, me = _opt()
    ms = torch.optim.lr_scheduler.LambdaLR(me, lambda e: 1.0 / (1 + e))
    us = UserState(me)
    us.restore(state, absorb=True)  # taken while parked in an iteration that is skipped
    ms.step()  # the loop's scheduler.step() after the skipped optimizer.step(): absorbed
    assert me.param_groups[0]["lr"] == donor.param_groups[0]["lr"]
    us.on_step()  # the next iteration arrives: absorbing is over
    ds.step()
    ms.step()
    assert me.param_groups[0]["lr"] == donor.param_groups[0]["lr"] == pytest.approx(1e-2 / 7)


def test_manual_lr_changes_travel_and_mismatches_are_clear_errors() -> None:
    _, a = _opt()
    a.param_groups[0]["lr"] = 0.123
    _, b = _opt()
    UserState(b).restore(UserState(a).capture(), absorb=False)
    assert b.param_groups[0]["lr"] == 0.123
    kept = torch.optim.lr_scheduler.StepLR(a, 3)
    state = UserState(a).capture()
    assert len(state["schedulers"]) == 1 and kept.last_epoch == 0
    us = UserState(b)
    us.restore(state, absorb=False)
    with pytest.raises(ConfigError, match="LR scheduler"):
        us.on_step()  # the script never created a scheduler: named, not ignored
    with pytest.raises(ProtocolError):
        decode(b"not a torch file")


def test_only_member_failures_are_redone() -> None:
    from p2psync.errors import Diverged, NonFinitePiece, PeerFailure, PeerTimeout

    from p2psync.strategies.backward_sync import redoable

    assert redoable(PeerFailure("gone", peers=(2,)))
    assert redoable(ProtocolError("collective_mismatch", "another group"))
    assert not redoable(Diverged("NaN"))
    assert not redoable(ConfigError("bad"))
    assert not redoable(ProtocolError("header", "bad"))
    assert redoable(NonFinitePiece("x", peer=1))  # its sender is being excluded: redo without it
    assert not redoable(PeerTimeout("slow"))  # not a member failure: the step fails as it would at step()
