"""The `herd` command: argument parsing and output only.

Each command group lives in its own module with ``register(subparsers)``; the
handler set with ``set_defaults(func=...)`` takes the parsed args and returns an
exit code. Errors of ours (every package's ``errors.py`` derives from
``HerdError``-like bases named in ``_OUR_PACKAGES``) become one line on stderr and
exit 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

_GROUPS = ("artifact", "gpus", "agent", "store", "placer", "job", "node", "logs", "demo", "pki", "version",
           "completion")
_OUR_PACKAGES = ("infra", "manifests", "p2p", "scheduler_link", "agent", "placer", "cli")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line on stderr (exit 2), naming the command and
    where its help is; every sub-parser is one of these (add_subparsers copies the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from cli.version import VersionAction
    p = Parser(prog="herd", description="GPU fleet node agent, p2p artifacts and placer")
    p.add_argument("--log-level", default=os.environ.get("HERD_LOG_LEVEL", "WARNING"),
                   help="logging level for daemons and commands (default WARNING)")
    p.add_argument("--version", action=VersionAction,
                   help="print herd's version, the wire version and Python's, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _GROUPS:
        try:
            mod = importlib.import_module(f"cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"cli.{name}":
                continue
            raise
        mod.register(sub)
    return p


def _is_ours(exc: BaseException) -> bool:
    mod = type(exc).__module__.split(".")[0]
    return mod in _OUR_PACKAGES


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("herd: interrupted", file=sys.stderr)
        return 130
    except CliError as e:
        print(f"herd: error: {e}", file=sys.stderr)
        return e.code
    except OSError as e:
        print(f"herd: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 1
    except Exception as e:
        if _is_ours(e):
            print(f"herd: error: {e}", file=sys.stderr)
            return 1
        raise
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
