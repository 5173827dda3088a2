"""Link shaping on the send path: emulated WAN links on one machine.

A :class:`Shaper` sits between :meth:`Transport.send` and the socket, per (src, dst) link:

* ``none``: nothing (real network);
* ``inproc`` (:class:`InprocShaper`): per link, bytes are serialized through a token bucket
  (``bandwidth_mbps``; the sender waits only for its own bytes to go out, which is the
  backpressure a busy NIC gives), then each message is delivered one-way ``latency_ms`` later
  (plus bounded uniform jitter; with probability ``loss`` plus one retransmission timeout).
  Delay is pipelined: ten messages sent back to back over a 100 ms link all arrive ~100 ms
  later. Deliveries on a link keep their order (a late message holds back later ones, as TCP
  does); links never wait for each other and nothing blocks the event loop;
* ``netem``: shaping done by the kernel (``p2psync.transport.netem``); no in-process shaper.

Two traffic classes (control never waits behind bulk). ``data`` messages
(bulk) go through the token bucket(s) as above. Control messages (``rpc``, ``reply``, ``event``,
``hb``; ``submit(..., control=True)``) have strict priority: they start serializing *now*, not
behind the bulk already queued on the link, so they arrive after their own serialization time
plus the link latency (and jitter, and loss). Their bytes are still charged to the bandwidth:
they push the bulk schedule back by their serialization time, as a strict-priority qdisc would
(the bulk message being serialized is "preempted": an error of at most one message's time,
accepted for simplicity). Control has its own delivery queue per link: control keeps its order,
data keeps its order, but a control message may overtake data (as it does on the separate
ZeroMQ control connection).

Bandwidth is modelled per link (``LinkSpec.bandwidth_bps``) and optionally per NIC
(``nic_bandwidth_bps``: one bucket shared by every link leaving that NIC): a bulk message is
done when both its link and its NIC have serialized it.

Link parameters come from the topology's link attributes or a WAN profile
(:func:`load_wan_profile`: regions and round-trip times; one-way = half).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal, Mapping, get_args

from p2psync.errors import ConfigError, P2PSyncError, translate
from p2psync.topology import LinkAttrs, Topology

log = logging.getLogger("p2psync.shaping")

ShaperName = Literal["none", "inproc", "netem"]
SHAPERS: tuple[str, ...] = get_args(ShaperName)


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link, in seconds and bits/s: one-way latency, uniform jitter (±), bandwidth
    (None: unlimited), loss probability and the delay a lost message pays (``rto_s``). Built by
    :meth:`from_attrs` or :func:`load_wan_profile`; read by :class:`InprocShaper` and netem."""

    latency_s: float = 0.0  # one way
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None
    loss: float = 0.0
    rto_s: float = 0.2  # retransmission timeout added to a "lost" message

    @property
    def trivial(self) -> bool:
        """The link changes nothing (no latency, jitter, bandwidth limit or loss): not shaped."""
        return self.latency_s == 0 and self.jitter_s == 0 and self.bandwidth_bps is None and self.loss == 0

    @staticmethod
    def from_attrs(a: LinkAttrs) -> "LinkSpec":
        """The spec of a topology link (ms and Mb/s converted; ``rto_s`` twice the latency, at
        least 0.2 s). Example, :func:`make_shaper`: ``LinkSpec.from_attrs(topo.link(node_id, dst))``."""
        lat = a.latency_ms / 1e3
        return LinkSpec(latency_s=lat, jitter_s=a.jitter_ms / 1e3,
                        bandwidth_bps=a.bandwidth_mbps * 1e6 if a.bandwidth_mbps else None,
                        loss=a.loss, rto_s=max(0.2, 2 * lat))


#: one try at handing a message over now: whether it went (False: try again later)
Attempt = Callable[[], bool]
#: awaited after a failed :data:`Attempt`: tries again, pausing in between, until the send's
#: budget runs out (then raises a :class:`~p2psync.errors.P2PSyncError`)
Retry = Callable[[], Awaitable[None]]


class Shaper(ABC):
    """Delays and paces one node's outgoing messages as emulated links would.

    Built by :func:`make_shaper` and passed to the transport's constructor (``shaper=``), which
    owns and closes it; the transport's send path calls ``await self.shaper.submit(peer,
    nbytes, attempt, retry, control=not bulk, nic=route.local_nic)``.
    """

    @abstractmethod
    async def submit(self, dst: int, nbytes: int, attempt: Attempt, retry: Retry, *, control: bool = False,
                     nic: str | None = None) -> None:
        """Send ``nbytes`` to ``dst`` through the emulated link: when it is due, ``attempt``
        does the real send, and ``retry`` is awaited if that try failed. Returns once the bytes
        are serialized (the sender's NIC is done with them). ``control``: strict priority over
        bulk; ``nic``: the local NIC (per-NIC bandwidth)."""

    async def close(self) -> None:
        """Stop delivering (pending messages are dropped)."""


@dataclass
class _Lane:
    """One traffic class of a link: ordered deliveries (due time, attempt, retry). A timer
    hands the due ones over; a worker task takes the lane over while a delivery retries, and
    until the lane is empty (see :meth:`InprocShaper._fire`)."""

    last_delivery: float = 0.0
    queue: deque[tuple[float, Attempt, Retry]] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None
    worker: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """A timer or a worker will hand the queue's head over."""
        return self.timer is not None or (self.worker is not None and not self.worker.done())


@dataclass
class _Link:
    spec: LinkSpec
    free_at: float = 0.0  # when the link has serialized everything (bulk) accepted so far
    bulk: _Lane = field(default_factory=_Lane)
    control: _Lane = field(default_factory=_Lane)


class InprocShaper(Shaper):
    """The ``inproc`` shaper: per-link (and optionally per-NIC) token buckets, pipelined
    latency with jitter and loss, strict priority for control (see the module docstring).

    ``specs``: destination node -> its link (trivial links are sent unshaped); ``seed`` drives
    jitter and loss; ``nic_bandwidth_bps``: local NIC -> its bandwidth.
    """

    def __init__(self, specs: Mapping[int, LinkSpec], *, seed: int = 0,
                 nic_bandwidth_bps: Mapping[str, float] | None = None) -> None:
        self.links = {dst: _Link(spec) for dst, spec in specs.items() if not spec.trivial}
        self.rng = random.Random(seed)
        self.dropped = 0
        self.delivered = 0
        for name, bw in (nic_bandwidth_bps or {}).items():
            if not bw > 0:
                raise ConfigError(f"NIC {name}: bandwidth must be > 0 bits/s")
        self.nic_bandwidth_bps = dict(nic_bandwidth_bps or {})
        self._nic_free_at: dict[str, float] = {}

    async def submit(self, dst: int, nbytes: int, attempt: Attempt, retry: Retry, *, control: bool = False,
                     nic: str | None = None) -> None:
        """See :meth:`Shaper.submit`: schedules the delivery on its link's lane and waits out
        this message's serialization time."""
        link = self.links.get(dst)
        nic_bw = self.nic_bandwidth_bps.get(nic) if nic is not None else None
        if link is None and nic_bw is None:
            if not attempt():
                await retry()
            return
        if link is None:
            link = self.links[dst] = _Link(LinkSpec())
        loop = asyncio.get_running_loop()
        now = loop.time()
        s = link.spec
        ser = nbytes * 8 / s.bandwidth_bps if s.bandwidth_bps else 0.0
        nic_ser = nbytes * 8 / nic_bw if nic_bw else 0.0
        if control:
            # strict priority: serialize now; the bulk schedule moves back by our share
            done = now + max(ser, nic_ser)
            link.free_at = max(link.free_at, now) + ser
            if nic is not None and nic_bw:
                self._nic_free_at[nic] = max(self._nic_free_at.get(nic, 0.0), now) + nic_ser
        else:
            done = max(now, link.free_at) + ser
            link.free_at = done
            if nic is not None and nic_bw:
                nic_done = max(now, self._nic_free_at.get(nic, 0.0)) + nic_ser
                self._nic_free_at[nic] = nic_done
                done = max(done, nic_done)
        delay = s.latency_s
        if s.jitter_s:
            delay = max(0.0, delay + self.rng.uniform(-s.jitter_s, s.jitter_s))
        if s.loss and self.rng.random() < s.loss:
            delay += s.rto_s
        lane = link.control if control else link.bulk
        deliver_at = max(done + delay, lane.last_delivery)  # order-preserving per lane
        lane.last_delivery = deliver_at
        lane.queue.append((deliver_at, attempt, retry))
        if not lane.busy:
            lane.timer = loop.call_at(deliver_at, self._fire, lane)
        if done > now:  # the sender's NIC is busy until its bytes are out
            await asyncio.sleep(done - now)

    def _fire(self, lane: _Lane) -> None:
        """The lane's timer: hand every due delivery over, in order, each in one try; at the
        first that fails, a worker task retries it and goes on with the lane (:meth:`_drain`).
        A message that goes at once costs one timer, not a task."""
        lane.timer = None
        loop = asyncio.get_running_loop()
        q = lane.queue
        while q and q[0][0] <= loop.time():
            _, attempt, retry = q.popleft()
            if not self._try(attempt):
                lane.worker = asyncio.create_task(self._drain(lane, retry), name="shaped-link")
                return
        if q:
            lane.timer = loop.call_at(q[0][0], self._fire, lane)

    async def _drain(self, lane: _Lane, retry: Retry | None) -> None:
        """Retry a delivery whose try failed (``retry``; None: none), then hand the rest of
        the lane over as each comes due, until it is empty."""
        loop = asyncio.get_running_loop()
        q = lane.queue
        while True:
            if retry is not None:
                try:
                    await retry()
                    self.delivered += 1
                except P2PSyncError as exc:
                    self._drop(exc)
            if not q:
                return
            at, attempt, retry = q[0]
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            q.popleft()
            if self._try(attempt):
                retry = None

    def _try(self, attempt: Attempt) -> bool:
        """One try at a due delivery, counted: False when it must be retried (a send that
        failed for good is dropped, and needs no retry)."""
        try:
            if not attempt():
                return False
            self.delivered += 1
        except P2PSyncError as exc:
            self._drop(exc)
        return True

    def _drop(self, exc: P2PSyncError) -> None:
        self.dropped += 1
        log.info("shaped message dropped: %s", exc)

    async def close(self, *, flush_s: float = 2.0) -> None:
        """Stop. Control messages already accepted are still delivered when they are due within
        ``flush_s`` (a real NIC delivers what it has sent; a node's last replies, such as the
        coordinator's finish-barrier answers, must not vanish with it); the rest is dropped."""
        loop = asyncio.get_running_loop()
        end = loop.time() + flush_s
        flushing = []
        for link in self.links.values():
            lane = link.control
            if lane.busy and lane.queue and lane.queue[-1][0] <= end:
                if lane.timer is not None:  # (a worker hands the lane over from now on)
                    lane.timer.cancel()
                    lane.timer = None
                    lane.worker = asyncio.create_task(self._drain(lane, None), name="shaped-link-flush")
                if lane.worker is not None:
                    flushing.append(lane.worker)
        if flushing:
            await asyncio.wait(flushing, timeout=flush_s)
        for link in self.links.values():
            for lane in (link.control, link.bulk):
                if lane.timer is not None:
                    lane.timer.cancel()
                    lane.timer = None
                if lane.worker is not None:
                    lane.worker.cancel()
                    try:
                        await lane.worker
                    except (asyncio.CancelledError, Exception):
                        pass
                if lane.queue:
                    self.dropped += len(lane.queue)
                    lane.queue.clear()


def load_wan_profile(path: str | Path, topo: Topology) -> dict[tuple[int, int], LinkSpec]:
    """Link specs for every pair of nodes from a WAN profile file.

    ``{"regions": {"tokyo": [0], "london": [1], ...}, "rtt_ms": {"london-tokyo": 210, ...},
    "intra_rtt_ms": 0, "jitter_ms": 0, "bandwidth_mbps": null, "loss": 0}``. Pairs are named
    ``"a-b"`` in either order; one-way latency is half the round-trip time.
    """
    p = Path(path)
    with translate({OSError: lambda e: ConfigError(f"cannot read WAN profile {p}: {e.strerror}"),
                    json.JSONDecodeError: lambda e: ConfigError(f"{p}: invalid JSON at line {e.lineno}: {e.msg}")}):
        doc = json.loads(p.read_text())
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: a WAN profile is a JSON object")
    allowed = {"name", "regions", "rtt_ms", "intra_rtt_ms", "jitter_ms", "bandwidth_mbps", "loss", "description"}
    extra = sorted(set(doc) - allowed)
    if extra:
        raise ConfigError(f"{p}: unknown key {extra[0]!r}", field=extra[0])
    regions = doc.get("regions")
    if not isinstance(regions, dict) or not regions:
        raise ConfigError(f"{p}: regions must map region names to node id lists", field="regions")
    where: dict[int, str] = {}
    for name, ids in regions.items():
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise ConfigError(f"{p}: a list of node ids is expected", field=f"regions.{name}")
        for i in ids:
            if i not in topo.ids:
                raise ConfigError(f"{p}: node {i} is not in topology {topo.name}", field=f"regions.{name}")
            if i in where:
                raise ConfigError(f"{p}: node {i} is in two regions", field=f"regions.{name}")
            where[i] = name
    missing = [i for i in topo.ids if i not in where]
    if missing:
        raise ConfigError(f"{p}: nodes {missing} have no region", field="regions")

    def num(key: str, default: Any, allow_none: bool = False) -> Any:
        v = doc.get(key, default)
        if v is None and allow_none:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{p}: {key} must be a number >= 0", field=key)
        return float(v)

    rtts: dict[frozenset[str], float] = {}
    raw = doc.get("rtt_ms", {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: rtt_ms must be an object", field="rtt_ms")
    for pair, v in raw.items():
        a, _, b = pair.partition("-")
        if a not in regions or b not in regions or a == b:
            raise ConfigError(f"{p}: {pair!r} is not 'regionA-regionB'", field=f"rtt_ms.{pair}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{p}: round-trip time must be a number >= 0", field=f"rtt_ms.{pair}")
        rtts[frozenset((a, b))] = float(v)
    intra = num("intra_rtt_ms", 0.0)
    jitter = num("jitter_ms", 0.0) / 1e3
    bw = num("bandwidth_mbps", None, allow_none=True)
    loss = num("loss", 0.0)
    out: dict[tuple[int, int], LinkSpec] = {}
    for a in topo.ids:
        for b in topo.ids:
            if a == b:
                continue
            ra, rb = where[a], where[b]
            if ra == rb:
                rtt = intra
            elif frozenset((ra, rb)) in rtts:
                rtt = rtts[frozenset((ra, rb))]
            else:
                raise ConfigError(f"{p}: no round-trip time for {ra}-{rb}", field="rtt_ms")
            lat = rtt / 2e3
            out[(a, b)] = LinkSpec(latency_s=lat, jitter_s=jitter, bandwidth_bps=bw * 1e6 if bw else None,
                                   loss=loss, rto_s=max(0.2, 2 * lat))
    return out


def make_shaper(kind: str, topo: Topology, node_id: int, *, wan: str | None = None,
                seed: int = 0, nic_mbps: float | None = None) -> Shaper | None:
    """The shaper for ``node_id``'s outgoing links (None: send directly); ``nic_mbps``: every
    NIC of the node sends at most that many Mb/s (inproc only)."""
    if kind not in SHAPERS:
        raise ConfigError(f"unknown shaper {kind!r} (choose from {', '.join(SHAPERS)})")
    if kind in ("none", "netem"):
        return None
    if wan:
        pairs = load_wan_profile(wan, topo)
        specs = {dst: pairs[(node_id, dst)] for dst in topo.ids if dst != node_id}
    else:
        specs = {dst: LinkSpec.from_attrs(topo.link(node_id, dst)) for dst in topo.ids if dst != node_id}
    nics = {n.name: nic_mbps * 1e6 for n in topo.node(node_id).nics} if nic_mbps else None
    return InprocShaper(specs, seed=seed * 7919 + node_id, nic_bandwidth_bps=nics)
