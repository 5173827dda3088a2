"""DiLoCo (DiLoCo, Streaming DiLoCo, eager updates, DyLU): the strategy and its parts, one module
per concept (the algorithm: :mod:`~p2psync.strategies.diloco.strategy`).

* ``strategy.py`` — the :class:`DiLoCo` strategy: it owns the parts below and implements the
  strategy's hooks: the step loop (inner step, send, apply, eager rounds), start, checkpoints
  (registered as ``--strategy diloco``);
* ``options.py`` — its ``--opt`` options (:class:`DilocoOptions`);
* ``node.py`` — the node's state, plain data (:class:`~.node.NodeState`: θ_g, momentum,
  counters, the operation in flight, :class:`Op`), which every part below works on;
* ``ops.py`` — the operations (:class:`~.ops.Operations`): a fragment's pseudo-gradient sum
  over a view, redone over the next view when it fails, and the outer step that applies it (IO);
* ``adoption.py`` — a member behind or a joiner adopts a leader's state
  (:class:`~.adoption.Adoption`: what the regroup is built with) (IO);
* ``stop.py`` — the stop (:class:`~.stop.Stop`): the operations in flight, the final sync, the
  closing checks (IO);
* ``outer.py`` — the outer Nesterov step, the α merge, the eager gradient (pure);
* ``schedule.py`` — which fragment is sent and applied after which inner step, DyLU (pure);
* ``fragments.py`` — the fragment map (pure);
* ``state.py`` — the counters and the state vector a member behind adopts (pure);
* ``async_strategy.py`` — ``--strategy diloco-async`` (:class:`DilocoAsync`): asynchronous
  Local-SGD, Delayed Nesterov over one numbered stream of pseudo-gradients, DyLU; its options
  (``async_options.py``) and its pure logic (``dn.py``: the DN state machine, DyLU's H_m).

The parts are composed, not inherited: each is built with the state and the parts it uses.
Imports flow one way: the pure modules, then ``node`` → ``adoption`` → ``ops`` → ``stop`` →
``strategy``.
"""

from p2psync.strategies.diloco.node import Op
from p2psync.strategies.diloco.options import DilocoOptions
from p2psync.strategies.diloco.state import CLOSE, FULL
from p2psync.strategies.diloco.strategy import DiLoCo
from p2psync.strategies.diloco.async_strategy import DilocoAsync  # noqa: E402  (registers diloco-async)

#: :class:`Op`, also under this name
_Op = Op

__all__ = ["CLOSE", "FULL", "DiLoCo", "DilocoAsync", "DilocoOptions", "Op"]
