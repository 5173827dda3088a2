"""The netem backend: pure command plans everywhere; namespaces, veths and tbf for real as root."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from p2psync.errors import ConfigError
from p2psync.topology import bcube, ring
from p2psync.transport import netem
from p2psync.transport.shaping import LinkSpec
from tests.helpers import NETNS


def _ns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_plan_builds_namespaces_veths_and_per_link_qdiscs():
    topo = bcube(2, 2, subnet="198.18.0.0/16")
    links = {(0, 1): LinkSpec(latency_s=0.05, jitter_s=0.005, loss=0.01, bandwidth_bps=100e6),
             (0, 2): LinkSpec(bandwidth_bps=10e6)}
    p = netem.plan(topo, links, prefix="t")
    assert p.namespaces == {0: "tn0", 1: "tn1", 2: "tn2", 3: "tn3"} and p.switch_ns == "tsw"
    flat = [" ".join(c) for c in p.up]
    assert sum("type veth" in c for c in flat) == 8  # one per NIC
    assert any("addr add 198.18." in c and "dev t0v0" in c for c in flat)
    assert any("netem delay 50.000ms 5.000ms loss 1.0000%" in c for c in flat)
    assert any("match ip dst" in c and "flowid 1:1" in c for c in flat)
    assert sum(" tbf rate " in c for c in flat) == 2
    assert p.needs_netem
    assert p.down[-1] == ["ip", "netns", "del", "tsw"]
    assert not netem.plan(topo, {(0, 2): LinkSpec(bandwidth_bps=1e6)}, prefix="t").needs_netem


def test_plan_rejects_loopback_addresses():
    with pytest.raises(ConfigError, match="--subnet"):
        netem.plan(ring(3), {}, prefix="t")


@pytest.mark.xdist_group("netns")  # network namespaces and 198.18.0.0/15 addresses: one at a time
@NETNS
def test_preflight_names_the_missing_qdisc_or_passes():
    try:
        netem.preflight(need_netem=True)
    except netem.NetemUnavailable as exc:  # this machine: no sch_netem
        assert "netem" in str(exc) and "sch_netem" in str(exc)
    netem.preflight(need_netem=False)  # tbf + namespaces are available


@pytest.mark.xdist_group("netns")  # network namespaces and 198.18.0.0/15 addresses: one at a time
@NETNS
def test_up_and_down_with_rate_limits():
    prefix = f"q{os.getpid() % 1000}"
    topo = ring(3, subnet="198.18.0.0/16")
    links = {(a, b): LinkSpec(bandwidth_bps=20e6) for a in topo.ids for b in topo.ids if a != b}
    p = netem.plan(topo, links, prefix=prefix)
    try:
        netem.up(p)
        listed = _ns_list()
        assert all(ns in listed for ns in (*p.namespaces.values(), p.switch_ns))
        out = subprocess.run(["ip", "netns", "exec", p.namespaces[0], "tc", "qdisc", "show"],
                             capture_output=True, text=True).stdout
        assert "htb 1:" in out and "tbf" in out and "rate 20Mbit" in out
        addrs = subprocess.run(["ip", "-n", p.namespaces[1], "-4", "addr"], capture_output=True, text=True).stdout
        assert "198.18." in addrs
    finally:
        assert netem.down(p) == []
    listed = _ns_list()
    assert not any(ns in listed for ns in (*p.namespaces.values(), p.switch_ns))


def test_a_machine_without_iproute2_gets_errors_not_a_crash(tmp_path, monkeypatch):
    """Regression (seen on a GPU image with root and no iproute2): tearing a plan down raised
    FileNotFoundError from subprocess instead of reporting what it could not remove, and a
    command that hangs is cut off the same way."""
    p = netem.plan(ring(3, subnet="198.18.0.0/16"), {}, prefix="z")
    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, no tc
    errors = netem.down(p)
    assert len(errors) == len(p.down) and all("'ip'" in e and "not found" in e for e in errors), errors
    if os.geteuid() == 0:
        with pytest.raises(netem.NetemUnavailable, match="'ip' command"):
            netem.preflight(need_netem=False)
    slow = tmp_path / "ip"
    slow.write_text(f"#!/bin/sh\nexec {sleep} 5\n")
    slow.chmod(0o755)
    monkeypatch.setattr(netem, "COMMAND_TIMEOUT", 0.2)
    errors = netem.down(p)
    assert errors and all("timed out" in e for e in errors), errors
