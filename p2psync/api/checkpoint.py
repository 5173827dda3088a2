"""Checkpoints of one node: written atomically, read back without pickle.

What a checkpoint holds (:meth:`p2psync.api.session.Session.state_dict`): the step reached and
the samples seen, the run and node, the model's and the optimizer's ``state_dict()``, the
strategy's state (JSON values), the residuals of error feedback (lossy codecs), the RNG states
(torch CPU and the CUDA device the model is on, numpy's global generator, Python's ``random``), ``extra`` state that the
training script registers (the built-in job: its data sampler's position and its emulated
device's step-time generator) and ``user_state``: the LR schedulers', a scaler's and the
optimizer groups' state as it is at the start of the next step (training/user_state.py; a
``--checkpoint-every`` checkpoint is therefore written when the next iteration arrives, or at
close).

Format: one ``torch.save`` file, ``<run>/node-<id>/checkpoint.pt``, a dict of tensors, numbers,
strings, lists and dicts only, so :func:`load` reads it with ``torch.load(weights_only=True)``
(no code runs while loading; checkpoints never travel over the network). RNG states that are
not tensors are stored as plain lists.

Atomic: :func:`save_atomic` writes a temporary file in the same folder, flushes and fsyncs it,
renames it over the checkpoint (``os.replace``, atomic on POSIX) and fsyncs the folder. A
process killed at any moment leaves either the previous checkpoint or the new one, never a
torn file; a stale temporary file is removed by the next save, which creates its own
exclusively (``O_EXCL | O_NOFOLLOW``: never through a link planted in the folder). A write that
fails (a full disk, a read-only folder) raises the disk's ``OSError`` and leaves the previous
checkpoint as it was; the session logs it once and trains on (:class:`p2psync.files.WriteFailures`).

Checked before anything is restored (:func:`check_fits`): the tensors fit the model and the
optimizer they are loaded into (keys, shapes, dtypes), so a checkpoint of another model is one
ConfigError naming the file and the field, never a RuntimeError at the first step. ``--resume``
also checks that a node's checkpoint is its own (its ``node`` field) and agrees with the other
nodes on the step to continue at (:mod:`p2psync.api.start`).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from p2psync.compress import ErrorFeedback
from p2psync.errors import ConfigError, translate
from p2psync.files import write_atomic

FORMAT = 1
CHECKPOINT = "checkpoint.pt"


def node_checkpoint(run_dir: str | Path, node: int) -> Path:
    """Where node ``node`` of the run in ``run_dir`` keeps its checkpoint."""
    return Path(run_dir) / f"node-{node}" / CHECKPOINT


def save_atomic(path: str | Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename, fsync folder:
    :func:`p2psync.files.write_atomic`). A write that fails raises its ``OSError`` (a full disk,
    a read-only folder) and leaves the previous checkpoint as it was."""
    write_atomic(path, lambda f: torch.save(dict(state), f), mode=0o600)


def _read(p: Path, *, missing: str, unreadable: str) -> Any:
    """``torch.load`` of ``p`` without pickle, on the CPU; ConfigError ``missing`` when there
    is no such file, ``unreadable: <why>`` when torch cannot read it."""
    if not p.is_file():
        raise ConfigError(missing)
    # torch raises many types for a file that is not its format
    with translate({Exception: lambda e: ConfigError(f"{unreadable}: {type(e).__name__}: {str(e)[:200]}")}):
        return torch.load(p, map_location="cpu", weights_only=True)


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint :func:`save_atomic` wrote (ConfigError if missing or not one)."""
    p = Path(path)
    state = _read(p, missing=f"no checkpoint at {p}", unreadable=f"{p} is not a readable checkpoint")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{p} is not a p2psync checkpoint (format {FORMAT})")
    step = state.get("step")
    if type(step) is not int or step < 0:
        raise ConfigError(f"{p}: bad step {step!r}")
    return state


# -- RNG states --------------------------------------------------------------------------------

def model_device(model: torch.nn.Module | None) -> torch.device:
    """The device of the model's first parameter (CPU without parameters or model)."""
    p = next(model.parameters(), None) if model is not None else None
    return p.device if p is not None else torch.device("cpu")


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """Every global random generator a training loop may draw from: torch's CPU generator,
    numpy's, Python's, and the generator of the CUDA device ``device`` if it is one (only that
    one: a CPU run never initialises CUDA)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "internal": list(internal), "gauss_next": gauss_next},
    }
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["cuda"] = {"device": int(index), "state": torch.cuda.get_rng_state(index)}
    return out


def restore_rng(state: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`capture_rng` captured (ConfigError if it is malformed); a CUDA
    generator's state goes to ``device`` (the model's, which may differ from the writer's)."""
    try:
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        cuda = state.get("cuda")
        if isinstance(cuda, dict) and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda["state"], device)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise ConfigError(f"checkpoint: malformed RNG state ({type(exc).__name__}: {exc})") from None


# -- error feedback residuals ------------------------------------------------------------------

def feedback_state(fb: ErrorFeedback | None) -> dict[str, torch.Tensor]:
    """The residuals of an :class:`ErrorFeedback`, keys as JSON text (tuples, possibly nested:
    the collectives' keys hold their callers' keys, become lists; :func:`load_feedback` turns
    them back)."""
    if fb is None:
        return {}
    return {json.dumps(k): torch.from_numpy(v.copy()) for k, v in fb.residual.items()}


def _key(raw: Any) -> Any:
    """A residual key read back from JSON: lists, at any depth, are tuples again."""
    return tuple(_key(x) for x in raw) if isinstance(raw, list) else raw


def feedback_states(feedback: tuple[ErrorFeedback | None, ErrorFeedback | None]) -> dict[str, Any]:
    """Copies of the residuals of the collectives' two error feedbacks (call where they
    change: on the event loop)."""
    return {"ef": feedback_state(feedback[0]), "sparse": feedback_state(feedback[1])}


def load_feedback(fb: ErrorFeedback | None, state: Mapping[str, Any]) -> None:
    if fb is None:
        return
    for k, v in state.items():
        fb.residual[_key(json.loads(k))] = v.numpy().copy()




# -- a node's state as one dict ----------------------------------------------------------------

def snapshot(*, p2psync: Mapping[str, Any], model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
             extra: Mapping[str, Any]) -> dict[str, Any]:
    """Everything of a node a checkpoint holds (call on the thread that owns the model):
    ``p2psync`` (step, samples, strategy, run, node, strategy state, error feedback residuals:
    copied on the event loop, see :func:`feedback_states`) plus copies of the model's and
    optimizer's state, the RNG states and ``extra``."""
    state: dict[str, Any] = {"format": FORMAT, **p2psync, "rng": capture_rng(model_device(model)), "extra": dict(extra)}
    if model is not None:
        state["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if optimizer is not None:
        state["optimizer"] = copy.deepcopy(optimizer.state_dict())
    return state


# -- does it fit this model? ------------------------------------------------------------------

def _bad(source: str, field: str, what: str) -> ConfigError:
    exc = ConfigError(f"{source}: {field}: {what}")
    exc.field = field
    return exc


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load ``model``'s parameters and buffers from ``path`` (``--init-from``): a p2psync
    checkpoint (its ``model``: e.g. a ``--checkpoint-every`` file of an earlier run) or a file of
    one ``state_dict()`` (``torch.save(model.state_dict(), path)``), read without pickle. A
    ConfigError naming the file (and the tensor) when it is missing, unreadable or of another
    model; nothing is loaded then."""
    p = Path(path)
    state = _read(p, missing=f"--init-from {p}: no such file",
                  unreadable=f"--init-from {p}: not a readable weights file")
    weights = state.get("model") if isinstance(state, dict) and state.get("format") == FORMAT else state
    if not isinstance(weights, Mapping):
        raise _bad(str(p), "model", f"is a {type(weights).__name__}, not a state dict")
    _check_model(weights, model, str(p))
    model.load_state_dict(weights)


def _check_model(model_sd: Mapping[str, Any], model: torch.nn.Module, source: str) -> None:
    """``model_sd`` holds exactly ``model``'s ``state_dict()`` keys, each a tensor of the same
    shape and dtype (else a ConfigError naming ``source`` and the tensor)."""
    own = model.state_dict()
    for key, mine in own.items():
        if key not in model_sd:
            raise _bad(source, f"model.{key}", f"missing (this model has it: shape {_shape(mine)}, {mine.dtype})")
        theirs = model_sd[key]
        if not isinstance(theirs, torch.Tensor):
            raise _bad(source, f"model.{key}", f"is a {type(theirs).__name__}, not a tensor")
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            raise _bad(source, f"model.{key}", f"shape {_shape(theirs)} {theirs.dtype}; this model's is "
                       f"{_shape(mine)} {mine.dtype} (a checkpoint of another model?)")
    extra = sorted(set(model_sd) - set(own))
    if extra:
        raise _bad(source, f"model.{extra[0]}", "this model has no such parameter or buffer (a checkpoint of "
                   "another model?)")


def check_fits(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
               source: str) -> None:
    """Refuse, before anything is loaded, a state that does not fit ``model`` and ``optimizer``:
    a ConfigError naming ``source`` (the file) and the field, where loading it would raise a
    RuntimeError now or at the first step (a momentum buffer of another shape loads without a
    word and fails in ``optimizer.step()``). Checked: ``model`` holds exactly the model's
    ``state_dict()`` keys, each a tensor of the same shape and dtype; ``optimizer`` has as many
    parameter groups of as many parameters, and its per-parameter tensors (of an elementwise
    torch optimizer: SGD, Adam, ...) have their parameter's shape and dtype (a 0-dimensional one,
    a step count, any real dtype); the error-feedback residuals are 1-dimensional float32."""
    model_sd = state.get("model")
    if not isinstance(model_sd, Mapping):
        raise _bad(source, "model", "missing (not a checkpoint of an attached model)" if model_sd is None
                   else f"is a {type(model_sd).__name__}, not a state dict")
    _check_model(model_sd, model, source)
    _check_optimizer(state.get("optimizer"), model, optimizer, source)
    fb = state.get("feedback", {})
    if not isinstance(fb, Mapping):
        raise _bad(source, "feedback", f"is a {type(fb).__name__}, not a dict")
    for family in ("ef", "sparse"):
        residuals = fb.get(family, {})
        if not isinstance(residuals, Mapping):
            raise _bad(source, f"feedback.{family}", f"is a {type(residuals).__name__}, not a dict")
        for k, v in residuals.items():
            field = f"feedback.{family}[{str(k)[:60]!r}]"
            try:
                json.loads(k)
            except (TypeError, ValueError):
                raise _bad(source, field, "the key is not a residual's JSON key") from None
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype != torch.float32:
                raise _bad(source, field, "a residual must be a 1-dimensional float32 tensor, not "
                           + (f"{_shape(v)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__))


def _check_optimizer(opt_sd: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: str) -> None:
    from p2psync.params.optim import elementwise

    if not isinstance(opt_sd, Mapping):
        raise _bad(source, "optimizer", "missing (not a checkpoint of an attached optimizer)" if opt_sd is None
                   else f"is a {type(opt_sd).__name__}, not a state dict")
    groups, saved_state = opt_sd.get("param_groups"), opt_sd.get("state")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise _bad(source, "optimizer.param_groups", "missing or malformed (a list of groups with their params)")
    if not isinstance(saved_state, Mapping):
        raise _bad(source, "optimizer.state", "missing or malformed (a dict per parameter)")
    mine = optimizer.param_groups
    if len(groups) != len(mine):
        raise _bad(source, "optimizer.param_groups", f"{len(groups)} parameter group(s); this optimizer has "
                   f"{len(mine)}")
    names = {id(p): n for n, p in model.named_parameters()}
    by_id: dict[Any, tuple[torch.Tensor, str]] = {}
    for g, (theirs, ours) in enumerate(zip(groups, mine)):
        if len(theirs["params"]) != len(ours["params"]):
            raise _bad(source, f"optimizer.param_groups[{g}].params", f"{len(theirs['params'])} parameters; this "
                       f"optimizer's group {g} has {len(ours['params'])}")
        for pid, p in zip(theirs["params"], ours["params"]):
            by_id[pid] = (p, names.get(id(p), f"group {g} parameter"))
    shaped = isinstance(optimizer, elementwise())  # every non-scalar state tensor is its parameter's shape
    for pid, entries in saved_state.items():
        if pid not in by_id:
            raise _bad(source, f"optimizer.state[{pid!r}]", "state of a parameter that no parameter group lists")
        if not isinstance(entries, Mapping):
            raise _bad(source, f"optimizer.state[{pid!r}]", f"is a {type(entries).__name__}, not a dict")
        p, name = by_id[pid]
        for key, t in entries.items():
            if not isinstance(t, torch.Tensor) or not shaped:
                continue
            field = f"optimizer.state[{pid!r}].{key}"
            if t.dim() == 0:
                if t.is_complex() or t.dtype == torch.bool:
                    raise _bad(source, field, f"a scalar of dtype {t.dtype}: not a number")
            elif t.shape != p.shape or t.dtype != p.dtype:
                raise _bad(source, field, f"shape {_shape(t)} {t.dtype}; its parameter ({name}) is {_shape(p)} "
                           f"{p.dtype} (a checkpoint of another model or optimizer?)")


def restore_local(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                  source: str = "checkpoint") -> None:
    """Put a checkpoint's model, optimizer and RNG states back (before training resumes),
    after :func:`check_fits`; every error a ConfigError naming ``source``."""
    check_fits(state, model, optimizer, source=source)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: does not fit this model or optimizer ({type(exc).__name__}: "
                          f"{str(exc)[:300]})") from None
    if "rng" in state:
        try:
            restore_rng(state["rng"], model_device(model))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


def restore_feedback(state: Mapping[str, Any], feedback: tuple[ErrorFeedback | None, ErrorFeedback | None]) -> None:
    fb = state.get("feedback")
    if isinstance(fb, dict):
        load_feedback(feedback[0], fb.get("ef", {}))
        load_feedback(feedback[1], fb.get("sparse", {}))


__all__ = ["CHECKPOINT", "FORMAT", "capture_rng", "check_fits", "feedback_state", "feedback_states", "load", "load_feedback",
           "node_checkpoint",
           "restore_feedback", "restore_local", "restore_rng", "save_atomic", "snapshot"]
