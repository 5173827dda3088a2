"""ESync's State Server (Li et al., *ESync*, §4, Algorithm 2).

:class:`StateServer` is the pure decision logic: one record per device
``(rank, k, capability, last_finish_time, ready, round)``; QUERY-STATE answers whether the
querying device should aggregate now (READY) or run another local iteration; RESET-STATE-SERVER
starts a device's next round. Times are the server's clock.

:class:`StateServerService` exposes it over the coordinator RPC (``esync.query``,
``esync.reset``). Nodes do not share a clock, so a node reports how long ago it finished its
last iteration (``age``) and the round-trip time of its last query; the service places the
finish time at ``now - age - rtt / 2`` on its own clock.

Failover: when the coordinator dies, the node taking over registers a fresh
service (no records carried over: the state is small and the members hold it). It rebuilds
from the members' next calls: a query carries the device's ``round``, adopted by a record not
heard from yet; a record never heard from has infinite capability, so it is the slowest device
and every query is answered NOT-READY until each device has been heard from once (devices keep
training locally meanwhile), for at most ``UNHEARD_GRACE_S`` after the server's first call: a
member that does not query (a joiner fetching its state from the others, who can only serve it
once they aggregate) is then left out of FIND-SLOWEST-DEVICE until it queries, instead of
keeping every device NOT-READY (a deadlock found by bench/faults.py: the others timed out in
the state sync after 30 s).

Membership: the devices are the members of the current membership view. Every
query and reset carries the caller's view (``epoch``, ``members``); the newest epoch seen wins
(:meth:`StateServer.set_members`): departed devices are dropped (a dead device would otherwise
stay the slowest one and no survivor would ever be READY) and joined ones are admitted at the
current round. The service learns the view from the nodes themselves, so it needs no link to the
membership service and works wherever the coordinator role lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from p2psync import clock
from p2psync.coordinator.rpc import RpcServer
from p2psync.errors import BadRequest, ConfigError, RemoteError

#: seconds after its first call during which a State Server waits for devices it never heard from
UNHEARD_GRACE_S = 5.0


@dataclass
class DeviceRecord:
    rank: int
    k: int = 0
    capability: float = math.inf  # seconds per local iteration (plus query RTT in non-blocking mode)
    last_finish: float = 0.0
    ready: bool = False
    round: int = 0


class StateServer:
    def __init__(self, ranks: Sequence[int], *, epsilon: float = 0.0,
                 unheard_grace: float = UNHEARD_GRACE_S) -> None:
        if not ranks:
            raise ConfigError("the State Server needs at least one device")
        if epsilon < 0:
            raise ConfigError("epsilon must be >= 0")
        self.epsilon = epsilon
        self.unheard_grace = unheard_grace
        self.records = {r: DeviceRecord(rank=r) for r in ranks}
        #: devices that queried or reset since this server started
        self.heard: set[int] = set()
        #: the server's clock at the first call it got
        self.first_call: float | None = None

    def _record(self, r: int) -> DeviceRecord:
        if r not in self.records:
            raise BadRequest(f"device {r} is not registered with the State Server")
        return self.records[r]

    def slowest(self, now: float | None = None) -> DeviceRecord:
        """FIND-SLOWEST-DEVICE: the largest capability (time per iteration); ties: lowest rank.

        A device not heard from since this server started counts (as the slowest: its
        capability is unknown) only during ``unheard_grace`` seconds after the first call:
        long enough for every device of a fresh start to send its first query, but a member
        that does not query at all (a joiner still fetching its state from the others, which
        wait for READY before they can serve it) must not keep every device NOT-READY."""
        recs = list(self.records.values())
        if (now is not None and self.first_call is not None and self.heard
                and now - self.first_call > self.unheard_grace):
            recs = [d for d in recs if d.rank in self.heard] or recs
        return max(recs, key=lambda d: (d.capability, -d.rank))

    def query_state(self, r: int, k: int, c: float, t_e: float, now: float, *,
                    round_: int | None = None) -> bool:
        """QUERY-STATE(r, k, c, t_e), Alg. 2 lines 1-12. ``round_``: the device's round, adopted
        by a record not heard from yet (a server rebuilt after a coordinator takeover)."""
        if k < 0 or not c > 0 or not math.isfinite(c):
            raise BadRequest(f"bad state query from device {r}: k={k}, c={c}")
        cur = self._record(r)
        if self.first_call is None:
            self.first_call = now
        if r not in self.heard and round_ is not None:
            cur.round = round_
        self.heard.add(r)
        cur.k, cur.capability, cur.last_finish = k, c, t_e  # line 3 (ready, round unchanged)
        slowest = self.slowest(now)  # line 4
        if k == 0 or slowest.round < cur.round:  # line 5: slowest has not pulled w_t yet
            return False
        rest_time = slowest.capability - now + slowest.last_finish  # line 8
        if cur is slowest or slowest.ready or cur.capability + self.epsilon > rest_time:  # line 9
            cur.ready = True
            return True
        return False

    def set_members(self, members: Sequence[int], now: float) -> None:
        """The devices are now ``members``: drop the others, admit new ones at the current round
        with the largest known capability (so a joiner neither blocks nor rushes READY before
        its own first query)."""
        if not members:
            raise ConfigError("the State Server needs at least one device")
        keep = set(members)
        for r in [r for r in self.records if r not in keep]:
            del self.records[r]
        known = [d.capability for d in self.records.values() if math.isfinite(d.capability)]
        rnd = max((d.round for d in self.records.values()), default=0)
        for r in keep - set(self.records):
            self.records[r] = DeviceRecord(rank=r, capability=max(known, default=math.inf),
                                           last_finish=now, round=rnd)

    def reset(self, r: int, round_: int, t_e: float) -> None:
        """RESET-STATE-SERVER(r, t, t_e): device r pulled w_t and starts round t."""
        rec = self._record(r)
        rec.k, rec.ready, rec.round, rec.last_finish = 0, False, round_, t_e
        self.heard.add(r)


class StateServerService:
    """RPC glue on the coordinator node."""

    def __init__(self, server: RpcServer, ranks: Sequence[int], *, epsilon: float = 0.0) -> None:
        self.state = StateServer(ranks, epsilon=epsilon)
        self.ranks = frozenset(ranks)
        self.epoch = -1
        self.queries = 0
        server.register("esync.query", self._query)
        server.register("esync.reset", self._reset)

    @staticmethod
    def _num(args: Mapping[str, Any], key: str, default: float = 0.0) -> float:
        v = args.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise BadRequest(f"esync: bad {key} {v!r}")
        return float(v)

    def _view(self, args: Mapping[str, Any], now: float) -> None:
        """Apply the caller's view if it is newer than the newest seen."""
        epoch, members = args.get("epoch"), args.get("members")
        if epoch is None:
            return
        if (type(epoch) is not int or epoch < 0 or not isinstance(members, list) or not members
                or any(type(m) is not int or m not in self.ranks for m in members)):
            raise BadRequest("esync: bad view (epoch, members)")
        if epoch > self.epoch:
            self.epoch = epoch
            self.state.set_members(members, now)

    def _member(self, caller: int) -> None:
        """A device the newest view seen no longer names was removed from the run (it paused, or
        was cut off): its call is refused as ``Fenced``, so the node stops and rejoins instead
        of failing (:meth:`MembershipClient.call_coordinator`)."""
        if caller not in self.state.records:
            raise RemoteError("Fenced", f"device {caller} is not in view {self.epoch} of the State Server: it was "
                                        f"removed from the run")

    async def _query(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        now = clock.now()
        self._view(args, now)
        self._member(caller)
        k = args.get("k")
        if type(k) is not int:
            raise BadRequest("esync.query: k must be an integer")
        rnd = args.get("round")
        if rnd is not None and (type(rnd) is not int or rnd < 0):
            raise BadRequest("esync.query: round must be a non-negative integer")
        t_e = now - self._num(args, "age") - self._num(args, "rtt") / 2
        self.queries += 1
        ready = self.state.query_state(caller, k, self._num(args, "c", 1e-9), t_e, now, round_=rnd)
        return {"ready": ready, "round": self.state.records[caller].round}

    async def _reset(self, caller: int, args: Mapping[str, Any], _: Sequence[np.ndarray]) -> Any:
        rnd = args.get("round")
        if type(rnd) is not int or rnd < 0:
            raise BadRequest("esync.reset: round must be a non-negative integer")
        self._view(args, clock.now())
        self._member(caller)
        self.state.reset(caller, rnd, clock.now() - self._num(args, "rtt") / 2)
        return {}
