"""Closing Canary's exchange while replies are still to be sent leaves no coroutine un-awaited.

A reply is sent in an owned task (``Exchange._spawn``). When the exchange closes before such a
task took its first step, the task is cancelled before its body runs; a coroutine made before
the task (as the exchange used to) was then never awaited (RuntimeWarning 'coroutine
Exchange._send was never awaited', seen in the leave/join test of Canary).
"""

from __future__ import annotations

import gc
import warnings
from types import SimpleNamespace

from p2psync.strategies.canary.plan import layout_for
from p2psync.compress import get_codec
from p2psync.strategies.canary.exchange import Exchange, Progress
from p2psync.topology import mesh
from p2psync.transport import Mailbox


def _exchange() -> Exchange:
    topo = mesh(4)
    progress = Progress(iteration=lambda: 0, zeta=lambda: (0, 0), stopping=lambda: False, on_header=lambda h: None)
    return Exchange(transport=SimpleNamespace(node_id=0, incarnation=1, scope=Mailbox().scope), fwd=None,  # type: ignore[arg-type]
                    layout=layout_for(topo, topo.ids), sizes=[8], codec=get_codec("none"), mode="native",
                    staleness=100.0, timeout=1.0, epoch=0, plan=0, progress=progress, piece=2)


async def test_replies_spawned_just_before_close_are_never_made_nor_left_unawaited():
    ex = _exchange()
    made: list[int] = []
    sent: list[int] = []

    async def reply(i: int) -> None:
        sent.append(i)

    def make(i: int):
        made.append(i)
        return reply(i)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            ex._spawn(lambda i=i: make(i))  # the tasks have not run yet
        await ex._tasks.close()  # cancelled before their first step
        ex._spawn(lambda: make(99))  # after close: dropped at once
        await ex._tasks.close()  # reaps that cancelled task too
        gc.collect()
    assert made == [] and sent == []
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_a_reply_spawned_while_open_is_sent():
    ex = _exchange()
    sent: list[int] = []

    async def reply() -> None:
        sent.append(1)

    ex._spawn(reply)
    await ex._tasks.wait(5)
    assert sent == [1]
    await ex._tasks.close()
