"""The replica audit: members that should hold one model prove it.

Each member hashes every parameter and buffer of its replica (8-byte BLAKE2b digests, in
``named_parameters`` then ``named_buffers`` order); the digests are allgathered over the group
(exact, tiny) and compared. Every member takes the same decision from the same rows, so either
all members go on or all raise :class:`~p2psync.errors.ReplicaMismatch` naming the nodes whose
replica differs from the lowest id's and the first tensor that differs. A silent divergence of
replicas that a strategy promises equal is thereby impossible at the points the audit runs:
the end of the run, and every ``--audit-every N`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from p2psync.collectives import Collectives
from p2psync.errors import ReplicaMismatch

DIGEST = 8


@dataclass(frozen=True)
class Mismatch:
    """Who differs from the reference member (the group's lowest id) and where first."""

    reference: int
    nodes: tuple[int, ...]
    tensor: str
    tensors: int


def first_mismatch(group: Sequence[int], rows: Sequence[np.ndarray], names: Sequence[str]) -> Mismatch | None:
    """Pure: the members whose digest row differs from the lowest id's, and the first tensor
    (in ``names`` order) where any of them differs; None when every row is equal."""
    if len(rows) != len(group):
        raise ValueError(f"{len(rows)} digest rows for a group of {len(group)}")
    ref_at = min(range(len(group)), key=lambda i: group[i])
    ref = np.asarray(rows[ref_at], np.uint8).reshape(len(names), DIGEST)
    nodes: list[int] = []
    first: int | None = None
    differ: set[int] = set()
    for node, row in zip(group, rows):
        r = np.asarray(row, np.uint8).reshape(len(names), DIGEST)
        bad = np.flatnonzero((r != ref).any(axis=1))
        if bad.size:
            nodes.append(node)
            differ.update(int(i) for i in bad)
            first = int(bad[0]) if first is None else min(first, int(bad[0]))
    if first is None:
        return None
    return Mismatch(reference=group[ref_at], nodes=tuple(sorted(nodes)), tensor=names[first], tensors=len(differ))


@dataclass
class AuditLog:
    """A node's audits so far: passed, not completed (a member failed meanwhile), and the
    step after which the last one passed."""

    passed: int = 0
    incomplete: int = 0
    last: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return {"passed": self.passed, "incomplete": self.incomplete, "last": self.last}


async def audit_replicas(coll: Collectives, digests: Sequence[tuple[str, bytes]], *, tag: str,
                         group: Sequence[int], step: int) -> None:
    """Compare this member's ``digests`` with every other member's; ReplicaMismatch (on every
    member alike) when they differ."""
    names = [n for n, _ in digests]
    mine = np.frombuffer(b"".join(d for _, d in digests), np.uint8).copy()
    if mine.size != DIGEST * len(names):
        raise ValueError(f"digests must be {DIGEST} bytes each")
    rows = await coll.allgather(mine, list(group), tag=tag)
    bad = first_mismatch(list(group), rows, names)
    if bad is not None:
        raise ReplicaMismatch(
            f"replica audit at step {step}: node(s) {list(bad.nodes)} hold a different model than node "
            f"{bad.reference} ({bad.tensors} of {len(names)} tensors differ; first: {bad.tensor!r})",
            nodes=bad.nodes, tensor=bad.tensor)


__all__ = ["DIGEST", "AuditLog", "Mismatch", "audit_replicas", "first_mismatch"]
