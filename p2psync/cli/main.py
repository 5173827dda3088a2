"""``p2psync`` entry point: subcommands, and one line + exit code 2 for any bad input."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from p2psync import __version__
from p2psync.cli import topo_cmd
from p2psync.errors import ConfigError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="p2psync", description="p2psync: peer-to-peer training runtime "
                                "for heterogeneous, far-apart clusters")
    p.add_argument("--version", action="version", version=f"p2psync {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    topo_cmd.add_parser(sub)
    from p2psync.cli import netns_cmd, report_cmd, run_cmd

    run_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    netns_cmd.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except (ConfigError, ValueError) as exc:
        print(f"p2psync {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
