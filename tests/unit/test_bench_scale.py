"""bench/scale.py on tiny sizes: every figure is measured, the exponents are fitted and the
report names the targets."""

from __future__ import annotations

import logging

import pytest

from bench import scale


def test_exponent_is_the_log_log_slope() -> None:
    assert scale.exponent([(4, 8.0), (16, 32.0), (64, 128.0)]) == pytest.approx(1.0)
    assert scale.exponent([(4, 16.0), (16, 256.0)]) == pytest.approx(2.0)
    assert scale.exponent([(4, None), (16, 1.0)]) is None


def test_topologies_of_each_kind_have_the_sizes_asked() -> None:
    assert len(scale.topology("bcube", 16).ids) == 16 and len(scale.topology("bcube", 8).ids) == 8
    assert len(scale.topology("ring", 5).ids) == 5
    with pytest.raises(ValueError):
        scale.topology("bcube", 12)
    assert scale.topology("groups", 16).params["groups"] == 4 and len(scale.topology("groups", 8).ids) == 8
    with pytest.raises(ValueError):
        scale.topology("groups", 7)


def test_a_mesh_of_groups_is_nearly_square_and_loses_a_member_not_a_gateway() -> None:
    assert [scale.group_shape(n) for n in (16, 64, 256, 1024, 8, 128, 12)] == \
        [(4, 4), (8, 8), (16, 16), (32, 32), (2, 4), (8, 16), (3, 4)]
    assert scale.victim(scale.topology("groups", 64)) == 33  # 32 is group 4's gateway
    assert scale.victim(scale.topology("groups", 12)) == 6   # a member of group 1 (4..7), not its gateway
    assert scale.victim(scale.topology("mesh", 64)) == 32


def test_a_quick_run_measures_every_figure_and_reports(capsys: pytest.CaptureFixture[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)
    results = scale.main(["--sizes", "4,8", "--kinds", "ring,bcube", "--virtual-seconds", "6", "--kill-at", "2",
                          "--in-process", "--png", "scale-test.png", "--allreduce-mb", "1"])
    kinds = [("ring", 4), ("ring", 8), ("bcube", 4), ("bcube", 8)]
    assert [(r["kind"], r["n"]) for r in results] == kinds * 2
    for r in results[4:]:  # the allreduces
        assert "error" not in r and 0 < r["virtual_s"] <= r["bound_lat_s"] * 1.05, r
    for r in results[:4]:
        assert r["invariants"] == "held"
        assert 0 < r["detection_s"] <= r["bound_s"] and 0 <= r["convergence_s"] < 1 and 0 <= r["join_convergence_s"] < 1
        assert r["coord_msgs_per_vs"] > 0 and r["cpu_per_vs"] > 0
    out = capsys.readouterr().out
    assert "Fitted exponents" in out and "coordinator messages grow as N^" in out
    assert "Allreduce in virtual time against the bandwidth bound" in out


def test_a_measurement_leaves_the_loggers_as_it_found_them() -> None:
    """Quiet while it simulates, then the ``p2psync`` logger's level is what it was (the bench
    runs in-process here, and later tests of this process read the logs)."""
    import logging

    log = logging.getLogger("p2psync")
    before = log.level
    scale.measure("ring", 4, virtual_s=2.0, kill_at=1.0)
    assert log.level == before


def test_an_allreduce_in_virtual_time_meets_the_bandwidth_bound_of_its_nics() -> None:
    """4 MB over 1 Gb/s links and NICs: a ring and a one-switch mesh take the single-NIC bound
    2(N-1)/N * S / rate plus at most the ring's latencies; BCube(2, 2) (two NICs a node)
    no more than that; the result is the sum (zeros) on every node."""
    for kind in ("ring", "mesh"):
        r = scale.measure_allreduce(kind, 4, 4.0)
        assert r["bound_s"] == pytest.approx(2 * 3 / 4 * 4e6 * 8 / 1e9, rel=1e-3)
        assert r["bound_s"] * 0.99 <= r["virtual_s"] <= r["bound_lat_s"] * 1.05, r
    b = scale.measure_allreduce("bcube", 4, 4.0)
    assert b["virtual_s"] <= b["bound_lat_s"] * 1.05, b
    assert "| ring | 4 | 4 |" in scale.allreduce_report([scale.measure_allreduce("ring", 4, 4.0)])
