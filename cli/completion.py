"""`herd completion bash|zsh|fish`: a completion script generated from the parser itself
with ``shtab`` (static: the shell never runs Python to complete; see README, Design notes)."""

from __future__ import annotations

import argparse
import sys

SHELLS = ("bash", "zsh", "fish")


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    from cli.main import build_parser
    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("completion", help="print a shell completion script",
                       description="Print a completion script for SHELL. bash: "
                                   "`herd completion bash > /etc/bash_completion.d/herd`; zsh: put it in a "
                                   "file named _herd on $fpath; fish: `herd completion fish > "
                                   "~/.config/fish/completions/herd.fish`.")
    c.add_argument("shell", choices=SHELLS, help="the shell: " + " | ".join(SHELLS))
    c.set_defaults(func=cmd_completion)
