"""``python -m p2psync.cli.capped CORES -- CMD ...``: run CMD capped at CORES CPU cores.

The launcher starts a command's node this way under ``--slowdown-mode quota``: this process
creates its control group (:class:`~p2psync.training.cpu_quota.CpuQuota`), sets the cap and
becomes CMD (``exec``: same pid, so CMD and everything it starts stay in the group). The group
outlives it; the launcher removes it once the run is over (``sweep``); the group of a node
started alone (``--node K``, which does the same in-process) is removed by the next quota run's
sweep. Exit 2 with one line
when the cap cannot be set, 127 when CMD cannot be run.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Sequence

from p2psync.errors import ConfigError
from p2psync.training.cpu_quota import CpuQuota


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m p2psync.cli.capped CORES -- CMD ...", file=sys.stderr)
        return 2
    try:
        cores = float(argv[0])
        if not math.isfinite(cores):
            raise ValueError(f"CORES must be a finite number, got {argv[0]!r}")
        CpuQuota.create().set(cores)
    except (ConfigError, ValueError) as exc:
        print(f"p2psync: {exc}", file=sys.stderr)
        return 2
    cmd = list(argv[2:])
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"p2psync: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
