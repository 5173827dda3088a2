"""``p2psync`` entry point: subcommands, and one line + exit code 2 for any bad input (a
:class:`~p2psync.errors.ConfigError`, raised where the input is read)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn, Sequence

from p2psync import __version__
from p2psync.cli import topo_cmd
from p2psync.cli.exit_codes import EXIT_USAGE
from p2psync.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="p2psync", description="p2psync: peer-to-peer training runtime "
                                "for heterogeneous, far-apart clusters")
    p.add_argument("--version", action="version", version=f"p2psync {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    topo_cmd.add_parser(sub)
    from p2psync.cli import keys_cmd, netns_cmd, report_cmd, run_cmd, sim_cmd

    run_cmd.add_parser(sub)
    keys_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    netns_cmd.add_parser(sub)
    sim_cmd.add_parser(sub)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; for ``run``, everything after the first ``--`` is the user's command
    (``args.cmd``), never seen by argparse, so ``-- python train.py --lr 0.1`` keeps ``--lr``.
    Other commands get ``--`` as argparse treats it."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        # top-level options take no value, so the first plain word names the command
        command = next((a for a in argv[:cut] if not a.startswith("-")), None)
        if command == "run":
            args = parser.parse_args(argv[:cut])
            args.cmd = argv[cut + 1:]
            return args
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except ConfigError as exc:  # p2psync's usage and configuration errors; anything else is a bug
        print(f"p2psync {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def hard_exit(code: int) -> NoReturn:
    """End a node process of the built-in job (``run TOPOLOGY --node I``) whose session has closed
    its sockets, metrics and run files: flush, and skip the interpreter's teardown of torch, numba
    and friends (0.3-1 s per process, every process at once at the end of a run)."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def entry() -> NoReturn:
    """The ``p2psync`` command (``python -m p2psync`` too): :func:`main`, then exit. A process
    that ran the built-in job (``run``: a node, or the launcher that imported torch to fork its
    nodes) skips the interpreter's teardown with :func:`hard_exit`: by then every file of the
    run is closed, and tearing torch down took 0.9 s of a 7 s ``--steps 1`` run."""
    rc = main()
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)  # as parse_args reads it
    if command == "run" and "torch" in sys.modules:
        hard_exit(rc)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
