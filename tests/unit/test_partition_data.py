"""Partitions, batch sampling, data loading (pure logic)."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from p2psync.errors import ConfigError
from p2psync.training.data import load_dataset, load_idx, make_synthetic, read_idx
from p2psync.training.partition import BatchSampler, dirichlet, iid, label_shards, partition

LABELS = np.repeat(np.arange(10), 100)


def _check_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n


def test_iid_sizes_and_cover():
    parts = iid(1001, 4, seed=1)
    _check_cover(parts, 1001)
    assert sorted(len(p) for p in parts) == [250, 250, 250, 251]


def test_label_shards_are_non_iid():
    parts = label_shards(LABELS, 5, shards_per_part=2, seed=0)
    _check_cover(parts, len(LABELS))
    for p in parts:
        assert len(np.unique(LABELS[p])) <= 3  # two shards: at most a few classes each


def test_dirichlet_skew_and_determinism():
    a = dirichlet(LABELS, 4, alpha=0.1, seed=3)
    b = dirichlet(LABELS, 4, alpha=0.1, seed=3)
    _check_cover(a, len(LABELS))
    assert all((x == y).all() for x, y in zip(a, b))
    # small alpha: each node is dominated by few classes; large alpha: close to uniform
    def top_share(parts):
        return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])
    assert top_share(a) > top_share(dirichlet(LABELS, 4, alpha=100.0, seed=3)) + 0.2


def test_partition_errors():
    with pytest.raises(ConfigError, match="unknown partition"):
        partition(LABELS, 2, "nope", seed=0)
    with pytest.raises(ConfigError, match="alpha"):
        partition(LABELS, 2, "dirichlet", seed=0, alpha=0)


def test_batch_sampler_deterministic_and_covers_epoch():
    s = BatchSampler(np.arange(10, 20), 4, seed=5)
    first = [s.batch(k) for k in range(5)]
    again = BatchSampler(np.arange(10, 20), 4, seed=5)
    assert all((a == again.batch(k)).all() for k, a in enumerate(first))
    epoch0 = np.concatenate(first)[:10]
    assert sorted(epoch0.tolist()) == list(range(10, 20))


def test_digits_embedded():
    d = load_dataset("digits")
    assert d.input_shape == (1, 8, 8) and d.num_classes == 10
    assert len(d.y_train) + len(d.y_test) == 1797
    assert set(np.unique(d.y_test)) == set(range(10))


def test_synthetic():
    d = make_synthetic(500, classes=4, side=8)
    assert d.x_train.shape[1:] == (1, 8, 8) and d.num_classes == 4


def _write_idx(path, arr, gz=False):
    head = struct.pack(">BBBB", 0, 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = head + arr.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def test_idx_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 255, (20, 5, 5)))
    _write_idx(tmp_path / "train-labels-idx1-ubyte", rng.integers(0, 3, 20))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (6, 5, 5)), gz=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([0, 1, 2, 0, 1, 2]), gz=True)
    d = load_idx(tmp_path)
    assert d.x_train.shape == (20, 1, 5, 5) and d.x_test.shape == (6, 1, 5, 5) and d.num_classes == 3
    assert d.x_train.min() >= -1 and d.x_train.max() <= 1


def test_idx_errors(tmp_path):
    bad = tmp_path / "x"
    bad.write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ConfigError, match="magic"):
        read_idx(bad)
    short = tmp_path / "y"
    short.write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, 10) + b"abc")
    with pytest.raises(ConfigError, match="declares 10 bytes"):
        read_idx(short)
    with pytest.raises(ConfigError, match="missing"):
        load_idx(tmp_path)
    with pytest.raises(ConfigError, match="--data-dir"):
        load_dataset("idx")
