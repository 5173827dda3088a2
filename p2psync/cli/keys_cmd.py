"""``p2psync keys gen TOPOLOGY --dir DIR``: a key pair per node for a keyed (CurveZMQ) cluster.

Writes ``DIR/node-<id>.key`` (mode 0600: the node's secret key and its relay keys, see
:mod:`p2psync.transport.keys`) and the public keys into TOPOLOGY (or ``-o FILE``). Give each
host only its own nodes' key files; run with ``p2psync run TOPOLOGY --keys DIR`` (or
``P2PSYNC_KEYS=DIR``). The folder is created with mode 0700; an existing one that is group- or
world-writable or another user's is refused, as runs refuse it
(:func:`p2psync.transport.keys.check_key_dir`).
"""

from __future__ import annotations

import argparse
import sys

from p2psync.errors import ConfigError
from p2psync.topology import load, save
from p2psync.transport.keys import generate, with_public_keys, write_key_dir


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("keys", help="generate the keys of an authenticated (CurveZMQ) cluster",
                       description="Keys of a keyed cluster: every connection runs CurveZMQ and a "
                                   "peer must hold the key the topology lists for its node id.")
    ksub = p.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    g = ksub.add_parser("gen", help="one key pair per node: secret files in --dir, public keys into the topology")
    g.add_argument("topology", help="topology JSON file (rewritten with the public keys unless -o)")
    g.add_argument("--dir", required=True, help="folder for the secret key files (created, mode 0700)")
    g.add_argument("-o", "--output", help="write the keyed topology here instead of over TOPOLOGY")
    g.add_argument("--force", action="store_true", help="replace key files that exist in --dir")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    topo = load(args.topology)
    keys = generate(topo)
    paths = write_key_dir(args.dir, keys, force=args.force)
    out = args.output or args.topology
    try:
        save(with_public_keys(topo, keys), out)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the key files in {args.dir} are written: run again with --force)") from None
    print(f"wrote {len(paths)} secret key files to {args.dir} (mode 0600; give each host only its own) "
          f"and the public keys to {out}", file=sys.stderr)
    return 0


__all__ = ["add_parser", "run"]
