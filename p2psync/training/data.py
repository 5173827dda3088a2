"""Data sets: the embedded handwritten digits (scikit-learn, no download), IDX files (MNIST /
Fashion-MNIST format) from a directory, and a synthetic classification set for throughput runs.

Every node loads the same data set deterministically and takes its own partition of the
training split; the held-out test split is shared.
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2psync.errors import ConfigError, translate

DATASETS = ("digits", "idx", "synthetic")


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray  # float32, (N, C, H, W)
    y_train: np.ndarray  # int64, (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    """Stratified split: the same fraction of every class goes to the test set."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.append(idx[: int(round(len(idx) * test_fraction))])
    test = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(len(y)), test)
    return x[train], y[train], x[test], y[test]


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (images (1797, 8, 8), targets), read straight from the CSV file it
    ships: ``import sklearn.datasets`` costs about 1.5 s per node process (start-up);
    the package's own loader (same values) when the file is not where it usually is."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    return d.images, d.target


def load_digits() -> Dataset:
    images, target = _digits_arrays()
    x = (images.astype(np.float32) / 16.0 - 0.5).reshape(-1, 1, 8, 8) / 0.5
    y = target.astype(np.int64)
    xtr, ytr, xte, yte = _split(x, y, 0.2, seed=0)
    return Dataset("digits", xtr, ytr, xte, yte, 10)


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally .gz). Only unsigned-byte data (type 0x08) is accepted."""
    opener = gzip.open if path.suffix == ".gz" else open
    with translate({OSError: lambda e: ConfigError(f"cannot read IDX file {path}: {e}")}):
        with opener(path, "rb") as f:
            raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ConfigError(f"{path}: not an IDX file (bad magic)")
    if raw[2] != 0x08:
        raise ConfigError(f"{path}: IDX data type 0x{raw[2]:02x} unsupported (only unsigned bytes)")
    ndim = raw[3]
    if not 1 <= ndim <= 4 or len(raw) < 4 + 4 * ndim:
        raise ConfigError(f"{path}: bad IDX dimension count {ndim}")
    dims = struct.unpack(f">{ndim}I", raw[4: 4 + 4 * ndim])
    count = int(np.prod(dims))
    body = raw[4 + 4 * ndim:]
    if len(body) != count:
        raise ConfigError(f"{path}: IDX header declares {count} bytes of data, file has {len(body)}")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        p = directory / name
        if p.exists():
            return p
    raise ConfigError(f"--data-dir {directory}: missing {stem}[.gz]")


def load_idx(directory: str | Path) -> Dataset:
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"--data-dir {d}: not a directory")
    parts = [read_idx(_find(d, s)) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
    xtr, ytr, xte, yte = parts
    for x, y, which in ((xtr, ytr, "train"), (xte, yte, "t10k")):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ConfigError(f"--data-dir {d}: {which} images {x.shape} do not match labels {y.shape}")

    def norm(x: np.ndarray) -> np.ndarray:
        return ((x.astype(np.float32) / 255.0 - 0.5) / 0.5)[:, None, :, :]

    classes = int(max(ytr.max(), yte.max())) + 1
    return Dataset("idx", norm(xtr), ytr.astype(np.int64), norm(xte), yte.astype(np.int64), classes)


def make_synthetic(n: int = 20000, *, classes: int = 10, side: int = 16, seed: int = 0,
                   noise: float = 2.0) -> Dataset:
    """Gaussian class prototypes plus noise, as (1, side, side) images; hard enough to need training."""
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((classes, side * side)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    x = protos[y] + noise * rng.standard_normal((n, side * side)).astype(np.float32)
    x = (x / np.sqrt(1 + noise**2)).reshape(n, 1, side, side).astype(np.float32)
    xtr, ytr, xte, yte = _split(x, y, 0.2, seed=seed)
    return Dataset("synthetic", xtr, ytr, xte, yte, classes)


def load_dataset(name: str, *, data_dir: str | None = None, synthetic_size: int = 20000) -> Dataset:
    if name == "digits":
        return load_digits()
    if name == "idx":
        if not data_dir:
            raise ConfigError("--data idx needs --data-dir DIR with the four IDX files")
        return load_idx(data_dir)
    if name == "synthetic":
        return make_synthetic(synthetic_size)
    raise ConfigError(f"unknown data set {name!r} (choose from {', '.join(DATASETS)})")
