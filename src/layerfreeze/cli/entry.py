"""The ``layerfreeze`` command's entry point (:func:`main`): parse, run the subcommand, turn a user's error into one
line on stderr and exit code 2 (rank 0 alone under torchrun), and the library's warnings into one line each."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from layerfreeze.cli import commands
from layerfreeze.cli.parser import build_parser, main_rank, subparser_of
from layerfreeze.errors import UserError


def _leave_process_group() -> None:
    """After an error, destroy the process group torchrun's ranks joined, if any (no barrier: a peer may not reach
    it), so the exit is a plain exit code and not gloo's "terminate called without an active exception"."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """The library's own warnings as one line for people (``layerfreeze: warning: ...``, rank 0 alone); other
    packages' warnings as Python prints them."""
    if "layerfreeze" not in Path(filename).parts:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
    elif main_rank():
        Console(stderr=True, soft_wrap=True).print(f"[bold yellow]layerfreeze: warning:[/] {escape(str(message))}",
                                                   highlight=False)


_PYTHON_SHOWWARNING = warnings.showwarning
#: Seconds a rank other than 0 waits before exiting on a user error under torchrun: the same error stops every rank at
#: once, and a rank that exits first makes torchrun stop rank 0 before it prints the one line (seen 2 times in 30).
RANK_EXIT_DELAY_S = 5.0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``layerfreeze`` command; returns the exit code.

    Every problem with the input is one line on stderr, ``layerfreeze: error: ...`` (under torchrun from rank 0
    alone; every rank exits with the same code), and exit code 2, before anything trains.
    """
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        subparser_of(parser, args).unknown(extras)  # type: ignore[attr-defined]
    # Logs and pipes get 120 columns (tables fold to fit); terminals keep their own width.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    err = Console(stderr=True, soft_wrap=True)
    if args.command is None:  # the help, and exit 2 as for any other missing argument (a script notices)
        parser.print_help()
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _run(args, console)
        except (UserError, FileNotFoundError) as exc:
            if main_rank():
                err.print(f"[bold red]layerfreeze: error:[/] {escape(str(exc))}", highlight=False)
            else:  # rank 0 speaks: let it print before torchrun, seeing this rank's exit, stops the others
                time.sleep(RANK_EXIT_DELAY_S)
            _leave_process_group()
            return 2
        except KeyboardInterrupt:  # before a run started (a run's own Ctrl-C is answered by its command)
            if main_rank():
                err.print("layerfreeze: interrupted", highlight=False)
            return 130


def _run(args: argparse.Namespace, console: Console) -> int:
    """Run the subcommand ``args`` names; its exit code."""
    if args.command == "train":
        return commands.cmd_train(args, console)
    if args.command == "compare":
        return commands.cmd_compare(args, console)
    if args.command == "plan":
        return commands.cmd_plan(args, console)
    if args.command == "blocks":
        return commands.cmd_blocks(args, console)
    if args.command == "report":
        from layerfreeze.runs.report import write_report

        console.print(f"report: {commands.shell_word(write_report(args.run_dir))}")
        return 0
    if args.command == "predictor":
        from layerfreeze.smartfrz import cli as smartfrz_cli

        return smartfrz_cli.run(args, console)
    if args.command == "config":
        return commands.cmd_config(args)
    if args.command == "strategies":
        return commands.cmd_strategies(console)
    return commands.cmd_assets(console)
