"""The shared-memory floor of ``bench.allreduce`` (``floor-shm``) computes the allreduce it
times: every rank ends with the sum of every rank's input, in the warm-up and in the last timed
operation (two alternating slot sets), with one or several pieces per chunk."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil

import pytest

from bench._floor import floor_endpoints, shm_floor_worker, shm_segments
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("n,elems,piece_bytes", [(3, 1000, 1 << 20), (4, 5003, 1024)])
def test_the_shared_memory_floor_ends_with_the_sum_on_every_rank(n, elems, piece_bytes):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    eps = floor_endpoints("tcp", n, free_port())
    segs = shm_segments(n, elems, piece_bytes)
    try:
        procs = [ctx.Process(target=shm_floor_worker, args=(r, n, elems, eps, segs, 3, q, piece_bytes, True))
                 for r in range(n)]
        for p in procs:
            p.start()
        got = [q.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    finally:
        shutil.rmtree(os.path.dirname(segs[0]), ignore_errors=True)
    assert sorted(r for r, _, _, _ in got) == list(range(n))
    assert all(ok and 0 < cpu for _, _, cpu, ok in got), got
    assert all(p.exitcode == 0 for p in procs)
