"""How the members of a run start: the same model, and either all fresh or all resumed at the
same step (issue 11; issue 16 review item 6).

Why: every member compares, in one tiny exact allgather (``attach.numel``), what it is about
to start with: ``[trainable parameter count, resumed (0/1), checkpoint step]``. A different
parameter count means a different model; a mix of fresh and resumed nodes would wait in
different places (a fresh node in the broadcast of the coordinator's initial parameters that
resumed nodes skip) until a timeout with no clear error; resumed nodes whose checkpoints are at
different steps would mix steps in their first exchange. Each is one :class:`ConfigError`
naming every node's value, raised on every member at once. Then a fresh start takes the
coordinator's initial parameters (a broadcast), so a script seeded differently on one node does
not silently diverge; a resumed start keeps every node's own checkpoint.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from p2psync.api.replica import HookedReplica
from p2psync.api.runtime import NodeRuntime
from p2psync.errors import ConfigError, ProtocolError


def start_rows(rows: Sequence[np.ndarray], members: Sequence[int], me: int) -> None:
    """Check the gathered ``[numel, resumed, step]`` rows (group order). Pure: a malformed row
    is a :class:`ProtocolError`, a disagreement a :class:`ConfigError`."""
    vals: list[tuple[int, int, int]] = []
    for n, r in zip(sorted(members), rows, strict=True):
        if r.shape != (3,) or not 0 <= int(r[1]) <= 1 or int(r[0]) < 0 or int(r[2]) < 0:
            raise ProtocolError("attach", f"node {n} sent a malformed start record {r.tolist()!r}"[:160])
        vals.append((int(r[0]), int(r[1]), int(r[2])))
    named = list(zip(sorted(members), vals))
    if len({v[0] for v in vals}) > 1:
        detail = ", ".join(f"node {n}: {v[0]}" for n, v in named)
        raise ConfigError(f"node {me}: the attached models differ in their number of trainable parameters "
                          f"({detail}); every node must train the same model")
    if len({v[1:] for v in vals}) > 1:
        detail = ", ".join(f"node {n}: " + (f"resumed at step {v[2]}" if v[1] else "fresh start") for n, v in named)
        raise ConfigError(f"node {me}: the nodes do not agree on how the run starts ({detail}); resume every "
                          "node (--resume RUN_DIR, or Session.load_state_dict before attach) from "
                          "checkpoints of the same step, or none")


async def identical_start(rt: NodeRuntime, replica: HookedReplica, *, resumed_at: int | None) -> None:
    """Agree on the start (see the module docstring), then, on a fresh start, take the
    coordinator's initial parameters. ``resumed_at``: the step of this node's checkpoint."""
    c = rt.collectives
    view = rt.membership.view
    members = list(view.members) if view is not None else list(rt.topo.ids)
    mine = np.array([replica.numel, resumed_at is not None, resumed_at or 0], np.int64)
    start_rows(await c.allgather(mine, members, tag="attach.numel"), members, rt.node_id)
    if resumed_at is not None:
        return
    params = await replica.get_params()
    params = await c.broadcast(params, min(members), members, tag="attach.params")
    await replica.set_params(params)


__all__ = ["identical_start", "start_rows"]
