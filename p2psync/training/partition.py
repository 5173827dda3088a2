"""Partitions of a training set across nodes (pure): iid, label shards, Dirichlet(alpha).

Every node computes the same partitioning from the same seed and keeps its own part.
"""

from __future__ import annotations

import numpy as np

from p2psync.errors import ConfigError

SCHEMES = ("iid", "shards", "dirichlet")


def iid(n_samples: int, parts: int, *, seed: int) -> list[np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n_samples)
    return [np.sort(p) for p in np.array_split(perm, parts)]


def label_shards(labels: np.ndarray, parts: int, *, shards_per_part: int = 2, seed: int) -> list[np.ndarray]:
    """Sort by label, cut into ``parts * shards_per_part`` shards, deal them out at random
    (the non-iid split of McMahan et al.): each part sees only a few classes."""
    n_shards = parts * shards_per_part
    if n_shards > len(labels):
        raise ConfigError(f"cannot cut {len(labels)} samples into {n_shards} shards")
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, n_shards)
    deal = np.random.default_rng(seed).permutation(n_shards)
    return [np.sort(np.concatenate([shards[s] for s in deal[k::parts]])) for k in range(parts)]


def dirichlet(labels: np.ndarray, parts: int, *, alpha: float, seed: int,
              min_size: int = 1, max_tries: int = 100) -> list[np.ndarray]:
    """Per class, proportions ~ Dir(alpha) over parts; smaller alpha = more skew."""
    if alpha <= 0:
        raise ConfigError("--dirichlet-alpha must be > 0")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        out: list[list[np.ndarray]] = [[] for _ in range(parts)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            props = rng.dirichlet(np.full(parts, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for k, piece in enumerate(np.split(idx, cuts)):
                out[k].append(piece)
        result = [np.sort(np.concatenate(p)) for p in out]
        if min(len(r) for r in result) >= min_size:
            return result
    raise ConfigError(f"Dirichlet(alpha={alpha}) left a node without data after {max_tries} tries; "
                      "raise --dirichlet-alpha")


def partition(labels: np.ndarray, parts: int, scheme: str, *, seed: int,
              alpha: float = 0.5, shards_per_part: int = 2) -> list[np.ndarray]:
    if parts < 1:
        raise ConfigError("need at least one partition")
    if scheme == "iid":
        return iid(len(labels), parts, seed=seed)
    if scheme == "shards":
        return label_shards(labels, parts, shards_per_part=shards_per_part, seed=seed)
    if scheme == "dirichlet":
        return dirichlet(labels, parts, alpha=alpha, seed=seed)
    raise ConfigError(f"unknown partition {scheme!r} (choose from {', '.join(SCHEMES)})")


class BatchSampler:
    """Endless fixed-size batches over a partition: a fresh permutation per pass, deterministic
    in (seed). ``batch(k)`` is reproducible, which tests use to replay training."""

    def __init__(self, indices: np.ndarray, batch_size: int, *, seed: int) -> None:
        if len(indices) == 0:
            raise ConfigError("empty partition")
        if batch_size < 1:
            raise ConfigError("--batch-size must be >= 1")
        self.indices = np.asarray(indices)
        self.batch_size = batch_size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng((self.seed, epoch)).permutation(self.indices)}
        return self._perms[epoch]

    def batch(self, k: int) -> np.ndarray:
        n = len(self.indices)
        start = k * self.batch_size
        out: list[int] = []
        while len(out) < self.batch_size:
            epoch, pos = divmod(start + len(out), n)
            perm = self._perm(epoch)
            out.extend(perm[pos: pos + self.batch_size - len(out)].tolist())
        return np.asarray(out, dtype=np.int64)
