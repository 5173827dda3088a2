"""Compile the numba kernels once, at install time: ``python -m p2psync.cli.precompile``.

The codecs' kernels (:mod:`p2psync.compress.kernels`) and ZipLine's barrier search
(:mod:`p2psync.coordinator.zipline_kernels`) are compiled on first use and cached on disk
(``cache=True``). Uncached, the first sketch8 encode and decode of a process takes about 4 s
of compiling on this project's 2-core machine (0.6 s more for ``sketch8:BITS``). Each node
process compiles on its first call, inside its first exchange and on its event loop, and
several nodes compile at once on a fresh install. Run once after installing
(``scripts/install.sh`` does), every later process only loads the cache: 0.35 s for that
first sketch8 call, measured on the same machine.

:func:`precompile` runs each codec's encode and decode the way the runtime does. Encode takes a
writeable float32 piece. Decode takes the encoded arrays both as they are (the collectives'
cached pieces) and read-only (what arrives from the wire), which numba compiles separately.
It also runs the min / max scan of a piece holding a NaN, and every barrier search on a small
predicted table. It returns what it ran.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from p2psync.compress import get_codec
from p2psync.compress import kernels as K
from p2psync.coordinator.zipline import SEARCHERS, predict

#: every spec whose encode or decode reaches a numba kernel (``sketch8:6``: the bit packing;
#: ``sketch8:auto``: the width search; ``e3m0:sr``: its own encoder)
CODEC_SPECS = ("int8", "sketch8", "sketch8:6", "sketch8p", "sketch8p:6", "sketch8:auto", "e3m0", "e3m0:sr")


def warm_codecs() -> list[str]:
    """Every numba-backed codec's encode and decode run once (:meth:`Codec.warm`): their kernels
    loaded from the on-disk cache (or compiled) in this process; the specs. (Not in the
    launcher before it forks the nodes: the first kernel call starts a native thread, so the
    launcher would have to exec them; each node warms its own codec before its first step.)"""
    for spec in CODEC_SPECS:
        get_codec(spec).warm()
    return list(CODEC_SPECS)


def precompile() -> list[str]:
    """Run every numba-backed codec and barrier search once; their names."""
    done = warm_codecs()
    y = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    y[7] = np.nan
    K.minmax_fast(y)  # its scalar loop, which runs only when a NaN is present
    done.append("minmax")
    table = [[0.0, 1.0], [0.0, 1.5], [0.2, 2.5]]
    for name, search in SEARCHERS.items():
        search(predict(table, 5))
        done.append(name)
    return done


def main() -> None:
    t0 = time.perf_counter()
    done = precompile()
    print(f"p2psync: compiled the numba kernels of {', '.join(done)} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
