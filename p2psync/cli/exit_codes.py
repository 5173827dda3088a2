"""The exit codes of ``p2psync`` (one home: the entry point, ``run`` and the launcher use them)."""

from __future__ import annotations

EXIT_OK = 0
#: a node failed, or the run did
EXIT_FAILED = 1
#: bad usage or configuration (a ConfigError), reported before anything starts
EXIT_USAGE = 2
#: this node was removed from the run (Fenced): restart it and it rejoins (sysexits' EX_TEMPFAIL)
EXIT_FENCED = 75
#: Ctrl+C / SIGTERM
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_FAILED", "EXIT_FENCED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE"]
