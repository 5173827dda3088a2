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
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping, Protocol

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


def _newest(votes: Mapping[int, int]) -> dict[int, int]:
    return {t: votes[t] for t in sorted(votes)[-KEPT_TERMS:]}


class MemoryVotes:
    """A :class:`VoteStore` in memory (a simulated node's disk)."""

    def __init__(self) -> None:
        self.votes: dict[int, int] = {}

    def load(self) -> dict[int, int]:
        return dict(self.votes)

    def keep(self, votes: Mapping[int, int]) -> None:
        self.votes = _newest(votes)


class FileVotes:
    """A :class:`VoteStore` in ``folder/votes.json`` (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / VOTES_FILE

    def load(self) -> dict[int, int]:
        try:
            raw = json.loads(self.path.read_text())
            votes = {int(t): int(c) for t, c in raw.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.warning("cannot read the votes of an earlier process in %s (%s): counted as none", self.path, exc)
            return {}
        return _newest(votes)

    def keep(self, votes: Mapping[int, int]) -> None:
        text = json.dumps({str(t): c for t, c in _newest(votes).items()})
        write_atomic(self.path, lambda f: f.write(text.encode()), mode=0o644)


__all__ = ["FileVotes", "KEPT_TERMS", "MemoryVotes", "VOTES_FILE", "VoteStore"]
