"""ESync over real ZeroMQ: 4 nodes with slowdowns 1,1,2,8 (emulated step times)."""

from __future__ import annotations

import numpy as np
import pytest

from p2psync.topology import ring
from tests.helpers import free_port, zmq_cluster
from tests.unit.test_esync import run_esync_rounds

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
async def test_esync_fast_nodes_iterate_more_and_replicas_match(mode):
    topo = ring(4, base_port=free_port())
    async with zmq_cluster(topo) as eps:
        n_local = await run_esync_rounds(eps, topo, rounds=5, mode=mode)
    fast = np.mean(n_local[0] + n_local[1])
    assert fast > np.mean(n_local[2]) >= np.mean(n_local[3]), n_local
    assert fast >= 2 * np.mean(n_local[3])
