"""Keys of a keyed cluster: one CurveZMQ key pair per node, plus pairwise relay keys.

Why: without keys anyone who can reach a port is a peer (docs/architecture.md, "Identity is a key"). With
keys, every socket runs CurveZMQ (pyzmq's own CURVE and ZAP support, no custom crypto): the
topology lists every node's public key, a ZAP handler maps the key that completed a handshake to
a node id (:mod:`p2psync.transport.zap`) and a message's claimed source must match it.

Files, written by ``p2psync keys gen cluster.json --dir keys/`` (:func:`generate`,
:func:`write_key_dir`): ``keys/node-<id>.key``, mode 0600 in a 0700 folder, one JSON object::

    {"format": 1, "node": 3, "public": "<Z85>", "secret": "<Z85>",
     "relay": {"0": "<64 hex>", "1": "<64 hex>", ...}}

The public keys go into the topology (``nodes[i].curve_public``); a secret key never does.
``relay`` holds one random 32-byte key per other node, shared by exactly that pair: a control
message relayed through other nodes carries its origin's HMAC under the key it shares with the
destination (:mod:`p2psync.transport.relay_auth`), so the destination verifies the origin even
though CURVE only authenticates the last hop. :func:`load_node_keys` refuses a file that others
can read, that belongs to another node or another user, or whose public key is not the
topology's, and a key folder that is group- or world-writable or another user's
(:func:`check_key_dir`, as ssh treats ``~/.ssh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import zmq

from p2psync.errors import ConfigError, translate
from p2psync.files import open_new
from p2psync.topology import Topology

FORMAT = 1
RELAY_KEY_BYTES = 32
ENV_KEYS = "P2PSYNC_KEYS"


@dataclass(frozen=True, kw_only=True)
class NodeKeys:
    """One node's CurveZMQ key pair (Z85) and its relay key with every other node."""

    node: int
    public: bytes
    secret: bytes = field(repr=False)
    relay: Mapping[int, bytes] = field(default_factory=dict, repr=False)


def key_file(directory: str | Path, node: int) -> Path:
    return Path(directory) / f"node-{node}.key"


def generate(topo: Topology) -> dict[int, NodeKeys]:
    """Fresh keys for every node of ``topo``: a CURVE key pair each, a relay key per pair."""
    pairs = {n: zmq.curve_keypair() for n in topo.ids}
    relay: dict[int, dict[int, bytes]] = {n: {} for n in topo.ids}
    for a in topo.ids:
        for b in topo.ids:
            if a < b:
                relay[a][b] = relay[b][a] = secrets.token_bytes(RELAY_KEY_BYTES)
    return {n: NodeKeys(node=n, public=pub, secret=sec, relay=relay[n]) for n, (pub, sec) in pairs.items()}


def with_public_keys(topo: Topology, keys: Mapping[int, NodeKeys]) -> Topology:
    """``topo`` with every node's public key (the file ``p2psync keys gen`` rewrites)."""
    return replace(topo, nodes=tuple(replace(n, curve_public=keys[n.id].public.decode()) for n in topo.nodes))


def _owner_ok(uid: int) -> bool:
    """Files and folders holding secrets may belong to this process's user or to root (as ssh
    accepts ``~/.ssh`` and its keys)."""
    return uid in (os.geteuid(), 0)


def _owner(uid: int) -> str:
    """A user's name (its uid where it has none)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def check_key_dir(directory: str | Path) -> None:
    """Refuse (ConfigError naming the path and the fix) a key folder that another user could
    change: one that is group- or world-writable (anyone in the group could replace a node's key
    file with their own) or that belongs to another user, as ssh refuses such a ``~/.ssh``. A
    folder that does not exist is left to the caller (reading a key file from it names it)."""
    d = Path(directory)
    try:
        st = d.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot read the key folder {d}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{d} is not a folder (the key files go into a folder of their own)")
    if not _owner_ok(st.st_uid):
        me = _owner(os.geteuid())
        raise ConfigError(f"the key folder {d} belongs to user {_owner(st.st_uid)}, not to {me}: they could "
                          f"replace the keys in it (use a folder of your own, or chown {me} {d}; chmod 700 {d})")
    if st.st_mode & 0o022:
        raise ConfigError(f"the key folder {d} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}): "
                          f"others could replace the keys in it (chmod 700 {d})")


def check_secret_file(path: Path, st: os.stat_result) -> None:
    """A secret key file (``st``: its stat) readable and writable by its owner only, and owned
    by this user (or root); ConfigError naming the path and the fix otherwise."""
    if not _owner_ok(st.st_uid):
        me = _owner(os.geteuid())
        raise ConfigError(f"{path} belongs to user {_owner(st.st_uid)}, not to {me}: a secret key must be "
                          f"its user's own (chown {me} {path}; chmod 600 {path})")
    if st.st_mode & 0o077:
        raise ConfigError(f"{path}: a secret key must be readable by its owner only "
                          f"(mode {st.st_mode & 0o777:o}; chmod 600 {path})")


def write_key_dir(directory: str | Path, keys: Mapping[int, NodeKeys], *, force: bool = False) -> list[Path]:
    """One secret file per node (mode 0600, written to a temporary file and renamed); the
    folder is created with mode 0700 (whatever the umask). An existing folder must pass
    :func:`check_key_dir` (not group- or world-writable, this user's). Existing key files are
    kept unless ``force``."""
    d = Path(directory)
    check_key_dir(d)
    if not d.exists():
        with translate({OSError: lambda e: ConfigError(f"cannot create the key folder {d}: {e.strerror}")}):
            d.mkdir(mode=0o700, parents=True)
            os.chmod(d, 0o700)  # mkdir's mode passes through the umask
    paths = [key_file(d, n) for n in sorted(keys)]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise ConfigError(f"{existing[0]} exists: keys are not overwritten (--force replaces them)")
    for n, path in zip(sorted(keys), paths):
        k = keys[n]
        doc = {"format": FORMAT, "node": n, "public": k.public.decode(), "secret": k.secret.decode(),
               "relay": {str(p): v.hex() for p, v in sorted(k.relay.items())}}
        tmp = path.with_name(f".{path.name}.tmp")
        with translate({OSError: lambda e: ConfigError(f"cannot write the key file {path}: {e.strerror}")}):
            with open_new(tmp, 0o600) as f:
                f.write(json.dumps(doc, indent=1).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    return paths


def load_node_keys(directory: str | Path, topo: Topology, node: int) -> NodeKeys:
    """Node ``node``'s keys from ``directory``, checked against the topology (ConfigError)."""
    if not topo.keyed:
        raise ConfigError(f"--keys {directory}: the topology lists no public keys (write them with "
                          "'p2psync keys gen TOPOLOGY --dir DIR')")
    check_key_dir(directory)
    path = key_file(directory, node)
    with translate({OSError: lambda e: ConfigError(f"cannot read node {node}'s key file {path}: {e.strerror}")}):
        st = path.stat()
        text = path.read_text()
    check_secret_file(path, st)
    with translate({json.JSONDecodeError: lambda e: ConfigError(f"{path}: not a key file (invalid JSON: {e.msg})")}):
        doc = json.loads(text)
    return _parse(doc, path, topo, node)


def _parse(doc: Any, path: Path, topo: Topology, node: int) -> NodeKeys:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a p2psync key file (format {FORMAT})")
    if doc.get("node") != node:
        raise ConfigError(f"{path}: holds the keys of node {doc.get('node')!r}, not of node {node}")
    pub, sec = doc.get("public"), doc.get("secret")
    if not isinstance(pub, str) or not isinstance(sec, str) or len(pub) != 40 or len(sec) != 40:
        raise ConfigError(f"{path}: public and secret must be 40-character Z85 keys")
    with translate({(zmq.ZMQError, ValueError): lambda e: ConfigError(
            f"{path}: the secret key is not a valid Z85 CurveZMQ key")}):
        derived = zmq.curve_public(sec.encode())
    if derived != pub.encode():
        raise ConfigError(f"{path}: the secret key does not belong to its public key")
    if topo.node(node).curve_public != pub:
        raise ConfigError(f"{path}: node {node}'s public key in the topology is another one "
                          "(keys and topology from different 'p2psync keys gen' runs?)")
    raw = doc.get("relay")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: missing relay keys")
    relay: dict[int, bytes] = {}
    for peer in topo.ids:
        if peer == node:
            continue
        value = raw.get(str(peer))
        try:
            key = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            key = b""
        if len(key) != RELAY_KEY_BYTES:
            raise ConfigError(f"{path}: no valid relay key for node {peer}")
        relay[peer] = key
    return NodeKeys(node=node, public=pub.encode(), secret=sec.encode(), relay=relay)


def node_keys(directory: str | None, topo: Topology, node: int, *, topo_path: str) -> NodeKeys | None:
    """Node ``node``'s keys for a run: required (and checked) when the topology lists public
    keys, refused when it does not; None for an unkeyed cluster, which is said once per run
    (:func:`warn_unauthenticated`)."""
    if topo.keyed:
        if not directory:
            raise ConfigError(f"{topo_path} lists public keys (a keyed cluster): give --keys DIR with the "
                              f"nodes' key files (or set {ENV_KEYS})")
        return load_node_keys(directory, topo, node)
    if directory:
        raise ConfigError(f"--keys {directory}: {topo_path} lists no public keys; write them with "
                          f"'p2psync keys gen {topo_path} --dir {directory}'")
    warn_unauthenticated(topo_path)
    return None


#: set in the environment of the processes a launcher starts for a run it has already said is
#: unauthenticated (:func:`warned_env`): they do not say it again
ENV_WARNED = "P2PSYNC_UNAUTHENTICATED_WARNED"
_warned_unauthenticated = False


def warn_unauthenticated(topo_path: str) -> None:
    """Say once per run that a run without keys authenticates nobody: once per process, and
    not at all in a process whose launcher said it already (:data:`ENV_WARNED`)."""
    global _warned_unauthenticated
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        if os.environ.get(ENV_WARNED) == "1":
            return
        with contextlib.suppress(OSError):  # a node's log on a full disk: the run goes on
            print(f"p2psync: warning: the cluster in {topo_path} is unauthenticated (no keys): anyone who "
                  "can reach its ports can join as a peer; see 'p2psync keys gen'", file=sys.stderr, flush=True)


def warned_env() -> dict[str, str]:
    """What to add to the environment of a process this one starts for the same run (a node, or
    the script it becomes): the warning is not repeated there if it was given here."""
    return {ENV_WARNED: "1"} if _warned_unauthenticated else {}


__all__ = ["ENV_KEYS", "ENV_WARNED", "NodeKeys", "check_key_dir", "check_secret_file", "generate", "key_file", "load_node_keys", "node_keys", "warn_unauthenticated",
           "warned_env", "with_public_keys", "write_key_dir"]
