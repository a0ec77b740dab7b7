"""`cpinfer` command line: a thin layer that dispatches to one module per subcommand in `cpinfer.commands`."""
from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from cpinfer import __version__

# Each entry is a module in cpinfer.commands exposing `register(subparsers)`; the parser it adds sets `func`.
COMMANDS = ["demo", "serve", "generate", "bench", "plan", "calibrate"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose "unrecognized arguments" error says why for an option it knows it lacks (`unsupported`:
    another tool's option → what to do instead, set by a command), else names the closest flag it knows."""

    unsupported: dict[str, str] = {}

    def suggest(self, unknown: list[str]) -> str:
        known = sorted(self._option_string_actions)
        words = []
        for arg in unknown:
            flag = arg.split("=", 1)[0]
            if flag in self.unsupported:
                words.append(f"{arg} ({self.unsupported[flag]})")
                continue
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("-") else []
            words.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
        return f"unrecognized arguments: {' '.join(words)}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="cpinfer",
        description="Context-parallel long-context LLM inference (ring pass-KV / pass-Q, persistent sharded KV).",
    )
    parser.add_argument("--version", action="version", version=f"cpinfer {__version__}")
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
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, with its usage and the closest flag it has
        target = _subparser(parser, args.command) or parser
        target.error(target.suggest(unknown) if isinstance(target, Parser) else f"unrecognized arguments: "
                     f"{' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from cpinfer.launch.common import set_cli_program

    set_cli_program(True)  # a rank that dies is never told to guard a script: this program is not one
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"cpinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        set_cli_program(False)


def _subparser(parser: argparse.ArgumentParser, command: str | None):
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None
