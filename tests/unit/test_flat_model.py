"""FlatModel: vectors in and out of a model never alias the caller's arrays."""

from __future__ import annotations

import numpy as np
import torch

from p2psync.model.flat import FlatModel


def _flat() -> FlatModel:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return FlatModel(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def test_set_params_copies_instead_of_aliasing_the_callers_array():
    """Regression: set_params made the parameters views of the numpy array it was given, so
    two replicas given the same array (nodes in one process) trained one shared model."""
    a, b = _flat(), _flat()
    vec = np.arange(a.numel, dtype=np.float32)
    a.set_params(vec)
    b.set_params(vec)
    ids = [id(p) for p in a.model.parameters()]
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(1.0)
    np.testing.assert_array_equal(vec, np.arange(a.numel, dtype=np.float32))
    np.testing.assert_array_equal(b.get_params(), vec)
    assert [id(p) for p in a.model.parameters()] == ids  # the same Parameter objects


def test_corrections_add_to_weights_and_momentum():
    f = _flat()
    x = torch.ones(4, 3)
    f.optimizer.zero_grad()
    f.model(x).sum().backward()
    f.optimizer.step()
    w0, s0 = f.get_params(), f.export_state()
    dw = np.full(f.numel, 0.5, np.float32)
    f.add_to_params(dw)
    f.add_to_momentum(dw)
    np.testing.assert_allclose(f.get_params(), w0 + 0.5)
    np.testing.assert_allclose(f.export_state()[f.numel:], s0[f.numel:] + 0.5)


def test_parameter_ranges_read_and_write_what_the_whole_vector_holds_there():
    """DiLoCo's fragments: ranges across parameter boundaries (a Linear's weight and bias, the
    next layer's weight) read and write exactly the flat vector's values there, and nothing
    else: the optimizer state is untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 12 + 4 + 8 + 2 = 26
    f = FlatModel(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    f.model(torch.ones(2, 3)).sum().backward()
    f.optimizer.step()
    state = f.export_state()
    whole = f.get_params()
    ranges = ((2, 5), (10, 20), (25, 26))
    idx = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
    assert f.get_params_range(ranges).tobytes() == whole[idx].tobytes()
    new = np.arange(idx.size, dtype=np.float32) - 7
    f.set_params_range(ranges, new)
    want = whole.copy()
    want[idx] = new
    assert f.get_params().tobytes() == want.tobytes()
    after = f.export_state()
    assert after[f.numel:].tobytes() == state[f.numel:].tobytes()  # optimizer state as it was
    assert f.get_params_range(()).size == 0
    for bad in (((0, 27),), ((5, 3),)):
        try:
            f.get_params_range(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(bad)


def test_gradient_parts_write_whole_parameters_as_the_whole_vector_does():
    """``set_grads_parts``: each (offset, values) lands in the ``.grad`` of the parameters it
    covers, as ``set_grads`` of the concatenation would; a part that splits a parameter is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 12 + 4 + 8 + 2 = 26
    f = FlatModel(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    f.model(torch.ones(2, 3)).sum().backward()
    new = np.arange(26, dtype=np.float32) - 9
    f.set_grads_parts([(16, new[16:26].copy()), (0, new[:16].copy())])
    assert f.grads().tobytes() == new.tobytes()
    for p in model.parameters():
        p.grad = None
    f.set_grads_parts([(12, new[12:16].copy())])  # missing gradients are made, the rest stay missing
    assert [p.grad is None for p in model.parameters()] == [True, False, True, True]
    try:
        f.set_grads_parts([(10, new[10:16].copy())])
    except ValueError:
        pass
    else:
        raise AssertionError("a part splitting a parameter was taken")


def test_the_state_is_exported_in_place_without_a_vector_of_the_parameters(monkeypatch):
    """``export_state`` on the CPU writes each part straight into one fresh vector (no
    parameter vector to concatenate: one state's worth of memory, not one and a model's), in
    the layout parameters, then each optimizer entry per parameter (Adam: moments, steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 12 + 4 + 8 + 2 = 26
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    f = FlatModel(model=model, optimizer=opt)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    params = f.params
    want = np.concatenate([
        *(p.detach().reshape(-1).numpy() for p in params),
        *(opt.state[p]["exp_avg"].reshape(-1).numpy() for p in params),
        *(opt.state[p]["exp_avg_sq"].reshape(-1).numpy() for p in params),
        np.array([float(opt.state[p]["step"]) for p in params], np.float32)])

    def whole_vector() -> np.ndarray:
        raise AssertionError("a vector of the parameters was made")

    monkeypatch.setattr(f, "get_params", whole_vector)
    got = f.export_state()
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    got[:] = 0.0  # a fresh vector: the model and its optimizer do not share it
    assert not any(bool((p == 0).all()) for p in params) and float(opt.state[params[0]]["step"]) == 1.0
