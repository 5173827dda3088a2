"""What crosses between a GPU and the network: flat vectors of a CUDA model, collectives on CUDA
tensors (through pinned host memory) and checkpoints of a CUDA model (the gradient-ready hooks
on a CUDA backward pass: test_grad_copies.py). Skipped on a machine without CUDA; each case
compares with the same computation on the CPU."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from p2psync.api import checkpoint
from p2psync.collectives import Collectives
from p2psync.collectives.buffers import to_numpy
from p2psync.topology import bcube
from p2psync.model.flat import FlatModel
from tests.helpers import free_port, zmq_cluster

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def _pair(opt: str = "adam") -> tuple[FlatModel, FlatModel]:
    """The same small model and optimizer state on the CPU and on the GPU."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 5))
    gpu = copy.deepcopy(cpu).to(CUDA)
    flats = []
    for m in (cpu, gpu):
        o = (torch.optim.Adam(m.parameters(), lr=1e-2) if opt == "adam"
             else torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        x = torch.linspace(-1, 1, 2 * 64).reshape(2, 1, 8, 8).to(next(m.parameters()).device)
        m(x).square().sum().backward()
        o.step()
        flats.append(FlatModel(model=m, optimizer=o))
    return flats[0], flats[1]


def test_flat_vectors_of_a_cuda_model_match_the_cpu_ones() -> None:
    cpu, gpu = _pair()
    assert gpu.device.type == "cuda"
    np.testing.assert_allclose(gpu.grads(), cpu.grads(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu.get_params(), cpu.get_params(), rtol=1e-5, atol=1e-6)
    state = cpu.export_state()
    assert gpu.export_state().shape == state.shape
    vec = np.arange(gpu.numel, dtype=np.float32) / gpu.numel
    gpu.set_params(vec)
    vec[:] = -1  # the parameters hold their own copy, not a view of the caller's array
    np.testing.assert_array_equal(gpu.get_params(), np.arange(gpu.numel, dtype=np.float32) / gpu.numel)
    assert all(p.device.type == "cuda" for p in gpu.params)
    gpu.set_grads(np.full(gpu.numel, 0.5, np.float32))
    np.testing.assert_array_equal(gpu.grads(), np.full(gpu.numel, 0.5, np.float32))
    gpu.import_state(state)  # the CPU replica's parameters and Adam moments, onto the GPU
    np.testing.assert_allclose(gpu.export_state(), state, rtol=1e-6)
    for p in gpu.params:
        st = gpu.optimizer.state[p]
        assert st["exp_avg"].device.type == "cuda" and st["exp_avg_sq"].device.type == "cuda"


def test_sgd_step_on_a_cuda_model_does_what_it_does_on_the_cpu() -> None:
    cpu, gpu = _pair("sgd")
    g = np.linspace(-1, 1, cpu.numel, dtype=np.float32)
    a = cpu.sgd_step(g, cpu.optimizer.step)
    b = gpu.sgd_step(g, gpu.optimizer.step)
    np.testing.assert_allclose(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu.get_params(), cpu.get_params(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_tensors_stage_through_host_memory_and_come_back(dtype: torch.dtype) -> None:
    t = (torch.arange(1000, device=CUDA, dtype=torch.float32) / 7).to(dtype).reshape(10, 100)
    arr, back = to_numpy(t)
    assert arr.dtype == np.float32 and arr.shape == (1000,)
    np.testing.assert_array_equal(arr, t.float().cpu().numpy().reshape(-1))
    out = back(arr * 2)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, (t.float() * 2).to(dtype))


async def test_collectives_on_cuda_tensors_over_zeromq() -> None:
    topo = bcube(2, 2, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        cs = {i: Collectives(e, piece_bytes=4096) for i, e in eps.items()}
        ts = {i: torch.arange(5000, device=CUDA, dtype=torch.float32) * (i + 1) for i in topo.ids}
        outs = await asyncio.gather(*(cs[i].allreduce(ts[i], tag="g") for i in topo.ids))
        want = torch.arange(5000, device=CUDA, dtype=torch.float32) * 10
        for i, o in enumerate(outs):
            assert o.device.type == "cuda" and torch.equal(o, want), i
            assert torch.equal(ts[i], torch.arange(5000, device=CUDA, dtype=torch.float32) * (i + 1))


def test_a_cuda_model_checkpoint_holds_the_cuda_generator_and_loads_back(tmp_path) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3).to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4, device=CUDA)).sum().backward()
    opt.step()
    torch.cuda.manual_seed(5)
    st = checkpoint.snapshot(p2psync={"step": 1, "samples": 2, "strategy": "ssgd", "run_id": "r", "node": 0,
                                      "strategy_state": {}}, model=model, optimizer=opt, extra={})
    assert "cuda" in st["rng"]
    path = checkpoint.node_checkpoint(tmp_path, 0)
    checkpoint.save_atomic(path, st)
    expect = torch.rand(3, device=CUDA)
    fresh = torch.nn.Linear(4, 3).to(CUDA)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    checkpoint.restore_local(checkpoint.load(path), fresh, fresh_opt)
    assert torch.equal(torch.rand(3, device=CUDA), expect)  # the CUDA generator is back where it was
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert b.device.type == "cuda" and torch.equal(a, b)
    mom = fresh_opt.state[next(fresh.parameters())]["momentum_buffer"]
    assert mom.device.type == "cuda"
