"""Failure detection that fits the link: phi accrual over heartbeat arrivals, plus RTT. Pure.

Why: a fixed "2 s of silence = dead" rule declares a healthy 1.2 s-RTT WAN link dead, while a
long fixed timeout detects killed processes too late. Here every decision takes ``now`` as an
argument (sans-IO) so tests drive it with synthetic arrival sequences.

:class:`RttEstimator` is RFC 6298's smoothed RTT (``srtt``, ``rttvar``) and retransmission
timeout, kept within what the latest :data:`RTT_WINDOW` samples show (a round trip that got
shorter is the estimate's within as many samples); RPC attempts and heartbeat waits use
:meth:`RttEstimator.rto`, so a 1.2 s-RTT link never times out its own heartbeats.

:class:`PeerDetector` is a phi-accrual detector (Hayashibara et al., 2004) for one peer:

* heartbeat inter-arrival times (a sliding window, bootstrapped from the configured heartbeat
  interval) give a normal distribution N(mean, std); the RTT jitter (``rttvar``) widens it,
  ``std`` never goes below ``min_std``;
* ``phi(now) = -log10(P(a heartbeat arrives later than now - last))`` where ``last`` is the
  latest proof of life: a heartbeat, or **any** message from that peer (the transport records
  arrivals, see ``Transport.last_arrival``); other traffic refreshes ``last`` but is not an
  inter-arrival sample (bulk traffic would make the distribution far too tight);
* the peer is suspected once ``phi >= threshold``, but never after less silence than
  ``floor`` (``--failure-timeout``) nor than ``2 * srtt + 4 * rttvar`` (the time a heartbeat
  RPC needs to be retried over another path when a relay dies).

Heartbeats are pipelined (sent every interval without waiting for replies), so the mean RTT
does not shift inter-arrival times; it enters through the RTT bound above and its jitter.
With the defaults (interval 0.5 s, threshold 8, floor 2 s) a killed process on a steady link is
suspected after ~2 s of silence; on a 1.2 s-RTT link after ``max(2, 2.4 + 4 * rttvar)`` s,
inside the ``3 s + 2 x RTT`` bound.

:class:`FailureDetector` holds one :class:`PeerDetector` per watched peer.

:class:`StallMeter` measures how long this process's own event loop could not run; that time
is credited to every peer (a stalled process must not blame its peers for its own silence).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: defaults, also used by the CLI (``p2psync run --heartbeat/--failure-timeout/--phi-threshold``)
DEFAULT_INTERVAL = 0.5
DEFAULT_FLOOR = 2.0
DEFAULT_THRESHOLD = 8.0
#: seconds a retransmission timeout exceeds the smoothed RTT at least (:class:`RttEstimator`):
#: the timers of an event loop fire that late or later under load
RTO_GRANULARITY = 0.01
#: the round-trip samples an :class:`RttEstimator` keeps its estimate within, once it has as
#: many (8 heartbeats: 4 s at the default interval)
RTT_WINDOW = 8


@dataclass(frozen=True)
class DetectorParams:
    """``interval``: heartbeat period (s); ``floor``: minimum silence before suspicion (s);
    ``threshold``: phi at which a peer is suspected; ``min_std``: lower bound of the
    inter-arrival standard deviation (s); ``window``: inter-arrival samples kept."""

    interval: float = DEFAULT_INTERVAL
    floor: float = DEFAULT_FLOOR
    threshold: float = DEFAULT_THRESHOLD
    min_std: float = 0.1
    window: int = 100

    def __post_init__(self) -> None:
        for name in ("interval", "floor", "threshold", "min_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"DetectorParams.{name} must be a positive number, got {v!r}")
        if type(self.window) is not int or self.window < 2:
            raise ValueError("DetectorParams.window must be an int >= 2")


class RttEstimator:
    """RFC 6298 smoothed RTT and retransmission timeout (Karn: feed first-attempt samples only),
    kept within what the latest ``window`` samples show.

    A retransmission backs the timer off (:meth:`backoff`, RFC 6298 5.5) and the backed-off
    value is kept for later calls until a valid sample arrives (5.7). Without that, a link whose
    RTT exceeds the initial RTO would be retransmitted on every first attempt and, by Karn's
    rule, never measured.

    Once ``window`` samples were measured, ``srtt`` is at most the longest of the latest
    ``window`` round trips and ``rttvar`` at most their spread (longest less shortest), so
    ``window`` samples after a round trip got shorter both are the shorter one's. RFC 6298's
    averages alone forget a longer round trip by 1/8 a sample and count ``srtt``'s lag above
    the shorter samples as variation: a link back from a 3 s round trip to a few milliseconds
    still has a second of ``rttvar`` 8 s later, and :class:`PeerDetector`, which waits for
    several times ``rttvar``, twice its floor. The bounds only lower the averages: a round
    trip that grows is in the window at once, and its spread with it; while RFC 6298's
    variation stays under the window's spread (a round trip that varies), the averages are
    RFC 6298's."""

    def __init__(self, *, initial_rto: float = 1.0, min_rto: float = 0.25, max_rto: float = 10.0,
                 granularity: float = RTO_GRANULARITY, window: int = RTT_WINDOW) -> None:
        if type(window) is not int or window < 2:
            raise ValueError("RttEstimator window must be an int >= 2")
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.initial_rto = initial_rto
        self.min_rto = min_rto
        self.max_rto = max_rto
        #: the least margin of the timeout over ``srtt`` (RFC 6298's clock granularity G)
        self.granularity = granularity
        self.samples = 0
        #: the latest samples (at most ``window``)
        self.recent: deque[float] = deque(maxlen=window)
        self._backoff = 1.0

    def sample(self, rtt: float) -> None:
        """Feed one measured round trip (seconds; non-finite or negative ignored) and clear the
        backoff. Called from rpc.py after a first-attempt reply: ``est.sample(loop.time() - sent_at)``."""
        if not math.isfinite(rtt) or rtt < 0:
            return
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.recent.append(rtt)
        if len(self.recent) == self.recent.maxlen:  # within what the window shows
            hi, lo = max(self.recent), min(self.recent)
            self.srtt = min(self.srtt, hi)
            self.rttvar = min(self.rttvar, hi - lo)
        self.samples += 1
        self._backoff = 1.0

    def backoff(self) -> None:
        """A request was retransmitted: double the timeout until the next valid sample."""
        self._backoff = min(self._backoff * 2, 64.0)

    def rto(self) -> float:
        """The retransmission timeout now: ``srtt + max(granularity, 4 * rttvar)`` (RFC 6298
        2.3; ``initial_rto`` before any sample), times the backoff, within [min_rto, max_rto].
        It always exceeds ``srtt`` by ``granularity`` at least: on a link whose round trip
        never varies ``rttvar`` is 0 once the window holds only it, and a timeout of ``srtt``
        alone expires as the reply arrives (or before it, ``srtt`` carrying rounding errors), so
        every other request would be resent and its copy sent over another first hop. Called from rpc.py per
        attempt: ``rto = est.rto()``."""
        base = self.initial_rto if self.srtt is None else \
            max(self.min_rto, self.srtt + max(self.granularity, 4 * self.rttvar))
        return min(self.max_rto, base * self._backoff)


def _survival(t: float, mean: float, std: float) -> float:
    """P(X > t) for X ~ N(mean, std)."""
    return 0.5 * math.erfc((t - mean) / (std * math.sqrt(2.0)))


class PeerDetector:
    """Phi-accrual detector of one peer (see the module docstring)."""

    def __init__(self, *, params: DetectorParams, now: float) -> None:
        self.params = params
        self.last = now  # latest proof of life
        self.last_heartbeat: float | None = None
        # bootstrap: two samples around the configured interval, as Akka does
        iv = params.interval
        self.intervals: deque[float] = deque([iv - iv / 4, iv + iv / 4], maxlen=params.window)
        self.srtt = 0.0
        self.rttvar = 0.0
        #: the latest silence longer than :meth:`outage_length` (two heartbeat intervals, or half
        #: the floor if that is longer): (the proof of life before it, the one that ended it);
        #: None: none since watched
        self.outage: tuple[float, float] | None = None
        #: :meth:`timeout` as of the current samples (None: to compute); every change of the
        #: inter-arrival samples or of the RTT drops it, so it is computed once per change,
        #: not once per question (a coordinator asks about every member on every heartbeat)
        self._timeout: float | None = None

    def heartbeat(self, now: float) -> None:
        """A heartbeat from the peer arrived at ``now``: one inter-arrival sample, and proof of
        life. A gap longer than the timeout in force is no sample: the peer was suspected
        through it (an outage whose declaration was blocked, e.g. a split without a majority),
        and learning it would stretch the timeout for long after."""
        if self.last_heartbeat is not None and now > self.last_heartbeat:
            gap = now - self.last_heartbeat
            if gap <= self.timeout():
                self.intervals.append(gap)
                self._timeout = None
        self.last_heartbeat = now
        self.alive(now)

    def alive(self, at: float) -> None:
        """Any message from the peer arrived at ``at`` (a silence before it longer than
        :meth:`outage_length` is kept as :attr:`outage`)."""
        if at > self.last:
            if at - self.last > self.outage_length():
                self.outage = (self.last, at)
            self.last = at

    def outage_length(self) -> float:
        """The silence that counts as an outage of the peer: two heartbeat intervals, or half
        the floor if that is longer (a peer heard within it is heard lately)."""
        return max(2 * self.params.interval, self.params.floor / 2)

    def rtt(self, srtt: float, rttvar: float) -> None:
        """The measured round trip to this peer (smoothed, with its variation)."""
        if math.isfinite(srtt) and srtt >= 0 and math.isfinite(rttvar) and rttvar >= 0 \
                and (srtt, rttvar) != (self.srtt, self.rttvar):
            self.srtt, self.rttvar = srtt, rttvar
            self._timeout = None

    def _dist(self) -> tuple[float, float]:
        n = len(self.intervals)
        mean = sum(self.intervals) / n
        var = sum((x - mean) ** 2 for x in self.intervals) / n
        std = max(self.params.min_std, math.sqrt(var + self.rttvar ** 2))
        return mean, std

    def phi(self, now: float) -> float:
        """The suspicion level at ``now``: ``-log10`` of the probability that a heartbeat is
        still to come after this much silence (inf when it is 0)."""
        mean, std = self._dist()
        p = _survival(max(0.0, now - self.last), mean, std)
        return math.inf if p <= 0.0 else -math.log10(p)

    def timeout(self) -> float:
        """Silence after which the peer is suspected (the phi threshold, RTT and floor)."""
        if self._timeout is None:
            self._timeout = self._compute_timeout()
        return self._timeout

    def _compute_timeout(self) -> float:
        mean, std = self._dist()
        # invert the survival function: P(X > t) = 10^-threshold  (bisection; monotone)
        target = 10.0 ** (-self.params.threshold)
        lo, hi = mean, mean + 40 * std
        for _ in range(50):
            mid = (lo + hi) / 2
            if _survival(mid, mean, std) > target:
                lo = mid
            else:
                hi = mid
        return max(self.params.floor, hi, 2 * self.srtt + 4 * self.rttvar)

    def suspect(self, now: float) -> bool:
        """The silence at ``now`` is longer than :meth:`timeout`: the peer is suspected."""
        return now - self.last > self.timeout()

    def pause(self, seconds: float) -> None:
        """This process could not receive for ``seconds`` (its event loop stalled): that time
        is not the peer's silence, nor part of a heartbeat inter-arrival sample."""
        self.last += seconds
        if self.last_heartbeat is not None:
            self.last_heartbeat += seconds


class StallMeter:
    """How long this process's event loop was stalled, measured on a periodic task.

    A check loop that sleeps ``interval`` and wakes ``elapsed`` later was unable to run for
    ``elapsed - interval``; during that time no arrival could be recorded either (messages wait
    in the sockets and get their arrival time when read, after the check). Without crediting
    that time, a process stalled longer than the floor (a loaded machine, a long synchronous
    call) wakes up to stale arrival times and declares its live peers, even its own host,
    failed. :meth:`tick` returns the stall to credit (:meth:`FailureDetector.pause`)."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.prev = now

    def tick(self, now: float) -> float:
        """The stall since the previous tick (seconds past ``interval``, 0 if none). Called
        from the periodic checks, e.g. membership.py's ``_monitor``:
        ``self.state.detector.pause(stalls.tick(clock.now()))``."""
        stall = max(0.0, now - self.prev - self.interval)
        self.prev = now
        return stall


class FailureDetector:
    """One :class:`PeerDetector` per watched peer; peers not watched are ignored by every
    method. Held by the coordinator's ``MembershipState`` (watches every member) and by
    ``MembershipClient`` (watches the coordinator)."""

    def __init__(self, *, params: DetectorParams) -> None:
        self.params = params
        self.peers: dict[int, PeerDetector] = {}

    def watch(self, peer: int, now: float) -> None:
        """Start watching ``peer`` as if it was last heard at ``now`` (no-op if watched)."""
        if peer not in self.peers:
            self.peers[peer] = PeerDetector(params=self.params, now=now)

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (a failed member, a deposed coordinator)."""
        self.peers.pop(peer, None)

    def heartbeat(self, peer: int, now: float) -> None:
        """A heartbeat from ``peer`` at ``now`` (see :meth:`PeerDetector.heartbeat`). Called
        from membership.py: ``self.detector.heartbeat(node, now)``."""
        d = self.peers.get(peer)
        if d is not None:
            d.heartbeat(now)

    def alive(self, peer: int, at: float) -> None:
        """Any message from ``peer`` arrived at ``at`` (the transport's last arrival time)."""
        d = self.peers.get(peer)
        if d is not None:
            d.alive(at)

    def rtt(self, peer: int, srtt: float, rttvar: float) -> None:
        """The measured round trip to ``peer`` (see :meth:`PeerDetector.rtt`)."""
        d = self.peers.get(peer)
        if d is not None:
            d.rtt(srtt, rttvar)

    def suspects(self, now: float) -> list[int]:
        """The watched peers suspected at ``now``, sorted. Called from
        ``MembershipState.check``: ``self.detector.suspects(now)``."""
        return sorted(p for p, d in self.peers.items() if d.suspect(now))

    def pause(self, seconds: float) -> None:
        """Credit a stall of this process to every peer (see :class:`StallMeter`)."""
        if seconds > 0:
            for d in self.peers.values():
                d.pause(seconds)

    def silence(self, peer: int, now: float) -> float:
        """Seconds since the last proof of life from ``peer`` (0 when not watched); logged."""
        d = self.peers.get(peer)
        return 0.0 if d is None else now - d.last


__all__ = ["DEFAULT_FLOOR", "DEFAULT_INTERVAL", "DEFAULT_THRESHOLD", "DetectorParams", "RTT_WINDOW",
           "FailureDetector", "PeerDetector", "RttEstimator", "StallMeter"]
