"""`cpinfer` command line: a thin layer that dispatches to one module per subcommand in `cpinfer.commands`."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each entry is a module in cpinfer.commands exposing `register(subparsers)`; the parser it adds sets `func`.
COMMANDS = ["demo", "serve", "generate", "bench", "plan", "calibrate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpinfer",
        description="Context-parallel long-context LLM inference (ring pass-KV / pass-Q, persistent sharded KV).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"cpinfer.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"cpinfer.commands.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"cpinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
