"""Users' loops of different lengths on ring-4 over real ZeroMQ (nodes as threads of one
process, through ``Session.attach``): nodes 0 and 2 end their loops first and depart, nodes 1
and 3 share no link yet train on, re-form over the view {1, 3} (its state sync and every step
after it relayed by the departed nodes, which stay in the finish barrier), and end with one
model."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from p2psync.api.session import Session
from p2psync.topology import ring, save
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(150)

LOOP = {0: 2, 1: 7, 2: 2, 3: 7}


def _body(s: Session, i: int) -> Any:
    torch.manual_seed(i)
    model = nn.Linear(4, 3)
    opt = s.attach(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    g = torch.Generator().manual_seed(100 + i)
    for _ in range(LOOP[i]):
        opt.zero_grad()
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    return params, s.close()


@pytest.mark.parametrize("strategy", ["ssgd", "preduce"])
def test_members_without_a_common_link_train_on_through_departed_nodes(tmp_path: Path, strategy: str) -> None:
    path = tmp_path / "ring4.json"
    save(ring(4, base_port=free_port()), path)
    out: dict[int, Any] = {}

    def node(i: int) -> None:
        try:
            s = Session(str(path), i, strategy, out=str(tmp_path), run_id=f"relays-{strategy}", start_timeout=30,
                        peer_timeout=20)
            out[i] = _body(s, i)
        except BaseException as exc:  # reported below
            out[i] = exc

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    for i in range(4):
        assert i in out, f"node {i} did not finish"
        if isinstance(out[i], BaseException):
            raise out[i]
    (p1, s1), (p3, s3) = out[1], out[3]
    assert torch.equal(p1, p3)  # one model: the final average (preduce) / every step (ssgd) over 1 and 3
    if strategy == "ssgd":  # every iteration of their loops averaged over 1 and 3 (P-Reduce's default
        # tail=stop ends the run once fewer than P workers are left, with the final average)
        assert s1["local_steps"] == LOOP[1] and s3["local_steps"] == LOOP[3]
