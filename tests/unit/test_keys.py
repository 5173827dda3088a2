"""Keys of a keyed cluster, the topology's public keys, ``p2psync keys gen`` and the checks a
run makes before starting anything; untrusted names (issue 16). In-process, no sockets."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from p2psync.api.runtime import checked_run_id, default_run_id
from p2psync.cli.main import main
from p2psync.errors import ConfigError, ProtocolError
from p2psync.topology import load, loads, mesh, ring, save, topology_to_dict
from p2psync.training.config import RunConfig
from p2psync.transport.keys import generate, key_file, load_node_keys, with_public_keys, write_key_dir
from p2psync.transport.relay_auth import ReplayWindow
from p2psync.wire.schema import valid_run_id


def test_keys_gen_writes_secrets_0600_and_public_keys_into_the_topology(tmp_path: Path, capsys) -> None:
    topo = tmp_path / "c.json"
    save(ring(3), topo)
    assert main(["keys", "gen", str(topo), "--dir", str(tmp_path / "k")]) == 0
    t = load(topo)
    assert t.keyed and len(t.node_by_key) == 3
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    for i in t.ids:
        f = key_file(tmp_path / "k", i)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        doc = json.loads(f.read_text())
        assert doc["secret"] not in topo.read_text()
        keys = load_node_keys(tmp_path / "k", t, i)
        assert keys.public.decode() == t.node(i).curve_public and set(keys.relay) == set(t.ids) - {i}
    a, b = (load_node_keys(tmp_path / "k", t, i) for i in (0, 1))
    assert a.relay[1] == b.relay[0] and a.relay[2] != a.relay[1]  # one key per pair
    assert main(["keys", "gen", str(topo), "--dir", str(tmp_path / "k")]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


def test_key_files_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    base = ring(2)
    keys = generate(base)
    t = with_public_keys(base, keys)
    write_key_dir(tmp_path, keys)
    os.chmod(key_file(tmp_path, 0), 0o644)
    with pytest.raises(ConfigError, match="owner only"):
        load_node_keys(tmp_path, t, 0)
    other = with_public_keys(base, generate(base))  # keys of another 'keys gen'
    with pytest.raises(ConfigError, match="another one"):
        load_node_keys(tmp_path, other, 1)
    key_file(tmp_path, 1).unlink()
    with pytest.raises(ConfigError, match="cannot read node 1"):
        load_node_keys(tmp_path, t, 1)


def test_topology_public_keys_on_every_node_or_none() -> None:
    t = with_public_keys(mesh(2), generate(mesh(2)))
    assert loads(json.dumps(topology_to_dict(t))).node_by_key == t.node_by_key
    d = topology_to_dict(t)
    del d["nodes"][1]["curve_public"]
    with pytest.raises(ConfigError, match=r"nodes\[1\].curve_public"):
        loads(json.dumps(d))
    d = topology_to_dict(t)
    d["nodes"][1]["curve_public"] = d["nodes"][0]["curve_public"]
    with pytest.raises(ConfigError, match="duplicate"):
        loads(json.dumps(d))
    d["nodes"][1]["curve_public"] = "not a key"
    with pytest.raises(ConfigError, match="40 Z85"):
        loads(json.dumps(d))


def test_run_refuses_keys_that_do_not_match_the_topology(tmp_path: Path, capsys) -> None:
    plain, keyed = tmp_path / "plain.json", tmp_path / "keyed.json"
    save(mesh(2), plain)
    save(mesh(2), keyed)
    assert main(["keys", "gen", str(keyed), "--dir", str(tmp_path / "k")]) == 0
    capsys.readouterr()
    assert main(["run", str(keyed), "--steps", "1"]) == 2
    assert "give --keys DIR" in capsys.readouterr().err
    assert main(["run", str(plain), "--steps", "1", "--keys", str(tmp_path / "k")]) == 2
    assert "lists no public keys" in capsys.readouterr().err
    assert main(["run", str(keyed), "--steps", "1", "--keys", str(tmp_path)]) == 2
    assert "cannot read node 0's key file" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["../up", "a/b", "/abs/path", ".hidden", "a..b", "", "x" * 129, "a\\b", "a b"])
def test_run_ids_are_plain_folder_names(bad: str) -> None:
    assert not valid_run_id(bad)
    with pytest.raises(ConfigError, match="plain folder name"):
        RunConfig(topology="t.json", run_id=bad)
    with pytest.raises(ProtocolError, match="not a plain folder name"):
        checked_run_id(bad, 0)


def test_good_run_ids_and_default_names_pass() -> None:
    for good in ("r4", "20250101-120000-ring-4-ssgd", "a.b_c+d-1"):
        assert valid_run_id(good) and checked_run_id(good, 0) == good
    odd = mesh(2)
    from dataclasses import replace

    assert valid_run_id(default_run_id(replace(odd, name="../../etc/x y"), "ssgd"))
    with pytest.raises(ProtocolError):
        checked_run_id(42, 0)


def test_replay_window_takes_each_counter_once_in_any_order_and_forgets_old_lives() -> None:
    w = ReplayWindow(window=8)
    assert [w.accept(1, 5, c) for c in (3, 1, 2, 3, 1)] == [True, True, True, False, False]
    assert w.accept(1, 5, 20) and not w.accept(1, 5, 12)  # older than the window: refused
    assert w.accept(1, 5, 13) and not w.accept(1, 5, 13)  # inside it: once
    assert w.accept(2, 1, 3)  # origins are independent
    assert not w.accept(1, 4, 100)  # an older incarnation
    assert w.accept(1, 6, 1) and not w.accept(1, 5, 21)  # a new life starts afresh


def _keyed_dir(tmp_path: Path) -> tuple[Path, "object"]:
    base = ring(2)
    keys = generate(base)
    d = tmp_path / "k"
    write_key_dir(d, keys)
    return d, with_public_keys(base, keys)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_a_key_folder_others_can_write_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    d, t = _keyed_dir(tmp_path)
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match=rf"key folder {d} is group- or world-writable .*chmod 700 {d}"):
        load_node_keys(d, t, 0)
    with pytest.raises(ConfigError, match="chmod 700"):  # nor are keys written into it
        write_key_dir(d, generate(ring(2)), force=True)
    os.chmod(d, 0o750)  # readable by the group is not writable: the files' own mode guards them
    assert load_node_keys(d, t, 0).node == 0


def test_a_key_folder_or_file_of_another_user_is_refused(tmp_path: Path) -> None:
    d, t = _keyed_dir(tmp_path)
    other = os.geteuid() + 4242
    if os.geteuid() != 0:  # chown to another user needs root
        pytest.skip("needs root to give a folder to another user")
    os.chown(d, other, -1)
    with pytest.raises(ConfigError, match=rf"key folder {d} belongs to user {other}, not to .*chown"):
        load_node_keys(d, t, 0)
    os.chown(d, 0, -1)
    os.chown(key_file(d, 1), other, -1)
    with pytest.raises(ConfigError, match=rf"{key_file(d, 1)} belongs to user {other}"):
        load_node_keys(d, t, 1)
    assert load_node_keys(d, t, 0).node == 0


def test_keys_gen_creates_the_folder_0700_and_refuses_a_loose_one(tmp_path: Path, capsys) -> None:
    topo = tmp_path / "c.json"
    save(ring(2), topo)
    assert main(["keys", "gen", str(topo), "--dir", str(tmp_path / "a" / "k")]) == 0
    assert stat.S_IMODE((tmp_path / "a" / "k").stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    assert main(["keys", "gen", str(topo), "--dir", str(loose), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"chmod 700 {loose}" in err and not list(loose.iterdir())
    f = tmp_path / "file"
    f.write_text("")
    assert main(["keys", "gen", str(topo), "--dir", str(f)]) == 2
    assert "is not a folder" in capsys.readouterr().err
