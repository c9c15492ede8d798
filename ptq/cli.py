"""The `ptq` command line: one subcommand per module in `ptq.commands`."""
from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import threading
import warnings
from typing import Optional

from ptq import __version__
from ptq.core.notes import Note

# Each module defines `add_arguments(parser)` and `run(args) -> int`, and a one-line `HELP`.
SUBCOMMANDS = ("calibrate", "run", "ops", "report", "debug", "dsp-report", "tune", "table")


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2, no traceback."""


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called when the help is printed: building the parser
    (which every command does) imports only the small modules holding the options' choices and defaults
    (`ptq.core.option_defaults`), never what the help merely lists (the calibrators)."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="ptq", description="Post-training quantization for ONNX models.")
    parser.add_argument("--version", action="version", version=f"ptq {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"ptq.commands.{name.replace('-', '_')}")
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


# options whose value may start with a minus sign that argparse does not read as a negative number ("-2,3.5"):
# `--range -2,3.5` is passed on as `--range=-2,3.5`
SIGNED_VALUE_FLAGS = ("--range",)


def join_signed_values(argv: list[str]) -> list[str]:
    """`FLAG -VALUE` -> `FLAG=-VALUE` for the SIGNED_VALUE_FLAGS (argparse would take -VALUE for a flag)."""
    joined: list[str] = []
    k = 0
    while k < len(argv):
        value = argv[k + 1] if k + 1 < len(argv) else ""
        if argv[k] in SIGNED_VALUE_FLAGS and value.startswith("-") and not value.startswith("--"):
            joined.append(f"{argv[k]}={argv[k + 1]}")
            k += 2
        else:
            joined.append(argv[k])
            k += 1
    return joined


INTERRUPTED = 130  # the shell's exit status for a command stopped by Ctrl-C (128 + SIGINT)


def one_blas_thread() -> None:
    """OPENBLAS_NUM_THREADS=1 unless the user chose a value; effective only before numpy is first imported
    (building the parser imports it). The integer graph's matmuls are small, and OpenBLAS's second thread
    spins between them on the other core: 20 EfficientNet-Lite0 images run faster on one thread (1.97 s
    against 2.13 s), and `ptq report`'s worker thread needs that core."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def print_notes(command: str):
    """A `warnings.showwarning` that prints a `ptq.core.notes.Note` as one line, `ptq CMD: note: ...`, and any other
    warning as Python does."""
    python_way = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Note):
            print(f"ptq {command}: note: {message}", file=sys.stderr)
        else:
            python_way(message, category, filename, lineno, file, line)

    return show


class LogFormat(logging.Formatter):
    """`ptq: warning: message` (warnings and errors), `ptq: message` (information: the steps of `ptq tune`)."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"ptq: {level}{record.getMessage()}"


def log_to_stderr() -> None:
    """The `ptq` loggers print on stderr in that format (the Python API leaves logging to its caller)."""
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormat())
    logging.basicConfig(handlers=[handler])


def main(argv: Optional[list[str]] = None) -> int:
    one_blas_thread()
    log_to_stderr()
    args = build_parser().parse_args(join_signed_values(sys.argv[1:] if argv is None else list(argv)))
    if not getattr(args, "quiet", False):  # the notice of a first run that compiles the kernels
        logging.getLogger("ptq.kernels").setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = print_notes(args.command)
            return int(args.handler(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"ptq {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outputs are written atomically: nothing half-written is left behind
        print(f"ptq {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def leave(code: int) -> None:
    """End the `ptq` process with status `code` without the interpreter's teardown: what `sys.exit` would do
    first still happens (the threads that are not daemons are joined, the exit handlers run, stdout and stderr
    are flushed), then the process ends, skipping the destruction of every module and object (numba's compiled
    code, onnxruntime, the model): a one-image `ptq report` spent 0.35 s of its 1.4 s of CPU there (`bench/startup.py`).
    Everything the command writes is written and closed before it returns (`ptq.core.atomic`)."""
    # the interpreter's own first steps at exit: threading's exit hooks (an idle thread pool's workers are told
    # to stop) and the join of the threads that are not daemons; then the exit handlers (logging's flush, the
    # pools' and temp dirs' clean-up)
    threading._shutdown()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # stdout closed early (`ptq ops | head`): the status Python's own exit gives then
        code = code or 120
    os._exit(code)


def entry() -> None:
    """The `ptq` script: `main()` on the process's arguments, then `leave`."""
    leave(main())


if __name__ == "__main__":  # `python -m ptq.cli`: a plain exit, so that wrappers (`python -m cProfile -m ptq.cli`) finish
    sys.exit(main())
