"""A node's votes kept across its processes, as Raft keeps ``votedFor`` on stable storage.

A process that restarted while an election was going on must not grant a second vote in a
term its previous process voted in: two candidates could then each count a majority of one
view in one term. :class:`~p2psync.coordinator.quorum.Ballot` hands every vote to its ``keep``
before granting it; a new process seeds its ballot with what was kept.

* :class:`FileVotes`: a JSON file in the node's folder of the run (``<run>/node-<id>/votes.json``,
  next to its ``incarnation``), replaced atomically and synced before the vote is granted
  (:func:`~p2psync.files.write_atomic`). A write that fails refuses the vote (the ballot's
  contract); a file that cannot be read is said once and counts as no votes, as a run
  folder that was removed does.
* :class:`MemoryVotes`: the same in memory, for a simulation whose restarted processes share
  their node's "disk" (:mod:`p2psync.sim.cluster`).

Only the :data:`KEPT_TERMS` highest terms are kept: a vote in an older term can no longer
decide an election (a node never votes in a term below the highest it voted in).

What is kept belongs to one launch of the run: a process that takes part in a fresh
rendezvous (every node registered anew: the run was started again with the same run id, in
the same folder) forgets it (``forget``), since the earlier launch's terms would make it refuse
the new launch's views; a process that joins a running run keeps it.

The key (term, epoch) of the newest view the node applied is kept too (``keep_view``), as Raft
keeps its log: a voter refuses a candidate whose view is older than its own, so that a
candidate that missed a view agreed by a majority cannot win. A restarted process that forgot
its view would grant such a candidate its vote, and the agreed view's majority would no longer
hold it. A view key that cannot be kept is said once and the view is applied all the same
(refusing the view would be worse); the file holds ``{"votes": {term: candidate}, "view":
[term, epoch]}`` (a file of an earlier version, votes only, is read as votes).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping, Protocol

from p2psync.coordinator.quorum import ViewKey
from p2psync.files import write_atomic

log = logging.getLogger("p2psync.membership")

VOTES_FILE = "votes.json"
#: the highest terms whose votes are kept
KEPT_TERMS = 16


class VoteStore(Protocol):
    """Where a node's votes outlive its process: :meth:`load` at the start, :meth:`keep`
    before each vote is granted (raises OSError when it cannot)."""

    def load(self) -> dict[int, int]:
        """The votes kept so far: term -> candidate."""

    def keep(self, votes: Mapping[int, int]) -> None:
        """Keep ``votes`` (all of them, the newest included) durably; OSError when it cannot."""

    def load_view(self) -> ViewKey | None:
        """The key of the newest view an earlier process of this node applied (None: none kept)."""

    def keep_view(self, key: ViewKey) -> None:
        """Keep ``key``, the newest view this process applied, durably; OSError when it cannot."""

    def forget(self) -> None:
        """Drop what was kept: a new launch of the run in this folder rendezvoused afresh, and
        the terms and views of the earlier launch are not this one's; OSError when it cannot."""


def _newest(votes: Mapping[int, int]) -> dict[int, int]:
    return {t: votes[t] for t in sorted(votes)[-KEPT_TERMS:]}


class MemoryVotes:
    """A :class:`VoteStore` in memory (a simulated node's disk)."""

    def __init__(self) -> None:
        self.votes: dict[int, int] = {}
        self.view: ViewKey | None = None

    def load(self) -> dict[int, int]:
        return dict(self.votes)

    def keep(self, votes: Mapping[int, int]) -> None:
        self.votes = _newest(votes)

    def load_view(self) -> ViewKey | None:
        return self.view

    def keep_view(self, key: ViewKey) -> None:
        self.view = key

    def forget(self) -> None:
        self.votes, self.view = {}, None


class FileVotes:
    """A :class:`VoteStore` in ``folder/votes.json`` (see the module docstring): it reads the
    file once, holds what it last wrote, and writes the votes and the view key together (one
    per folder: a second one on the same file would write back what it holds)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / VOTES_FILE
        self._votes: dict[int, int] = {}
        self._view: ViewKey | None = None
        self._read = False

    def _load(self) -> None:
        if self._read:
            return
        self._read = True
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("cannot read the votes of an earlier process in %s (%s): counted as none", self.path, exc)
            return
        view = None
        if isinstance(raw, dict) and "votes" in raw:
            view, raw = raw.get("view"), raw["votes"]
        try:
            self._votes = _newest({int(t): int(c) for t, c in raw.items()})
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("cannot read the votes of an earlier process in %s (%s): counted as none", self.path, exc)
        try:  # (read apart: a view key that cannot be read leaves the votes kept)
            self._view = (int(view[0]), int(view[1])) if view is not None else None
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            log.warning("cannot read the view key of an earlier process in %s (%s): counted as none", self.path,
                        exc)

    def load(self) -> dict[int, int]:
        self._load()
        return dict(self._votes)

    def load_view(self) -> ViewKey | None:
        self._load()
        return self._view

    def _write(self, votes: dict[int, int], view: ViewKey | None) -> None:
        text = json.dumps({"votes": {str(t): c for t, c in votes.items()},
                           "view": list(view) if view is not None else None})
        write_atomic(self.path, lambda f: f.write(text.encode()), mode=0o644)
        self._votes, self._view = votes, view

    def keep(self, votes: Mapping[int, int]) -> None:
        self._load()
        self._write(_newest(votes), self._view)

    def keep_view(self, key: ViewKey) -> None:
        self._load()
        self._write(self._votes, key if self._view is None else max(key, self._view))

    def forget(self) -> None:
        self._read = True
        if self.path.exists() or self._votes or self._view is not None:
            self._write({}, None)


__all__ = ["FileVotes", "KEPT_TERMS", "MemoryVotes", "VOTES_FILE", "VoteStore"]
