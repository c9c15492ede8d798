"""The documentation's commands and links stay true: every `ptq ...` command line in a fenced code block of
README.md or docs/*.md parses with the real argument parser (`ptq.cli.build_parser`), so a renamed or removed
flag fails here; every relative link of README.md names a file of the repository; `.ci/run` runs the
README's test command and docs build; and the MkDocs hook (`scripts/mkdocs_hooks.py`) keeps table pipes right.

A command is a line of a fenced block whose first word is `ptq`, or the part of a line after `&&` that starts
so; a line ending in `\\` continues on the next. In a block where some lines start with a `$ ` prompt (a
terminal transcript), only those are commands, the other lines are output. `ptq report: note: ...` is a
message ptq printed (its second word ends with a colon), not a command. A synopsis is written `usage: ptq ...`
so that it is not taken for a command.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import re
import shlex
from pathlib import Path
from typing import Optional

import pytest

from ptq.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, whether its block has `$ ` prompts) of every line inside a fenced code block,
    continuation lines joined."""
    lines, inside, pending, transcript = [], False, None, False
    all_lines = text.splitlines()
    for number, line in enumerate(all_lines, start=1):
        if FENCE.match(line):
            inside = not inside
            if inside:
                block = itertools.takewhile(lambda later: not FENCE.match(later), all_lines[number:])
                transcript = any(later.lstrip().startswith("$ ") for later in block)
            continue
        if not inside:
            continue
        if pending is not None:
            line = pending[1] + " " + line.strip()
            number = pending[0]
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1].rstrip())
            continue
        pending = None
        lines.append((number, line, transcript))
    return lines


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every `ptq` command line in the fenced blocks of a Markdown text."""
    found = []
    for number, line, transcript in fenced_lines(text):
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif transcript:  # in a block with prompts, a line without one is output
            continue
        for part in line.split("&&"):
            words = part.strip().split()
            if len(words) >= 2 and words[0] == "ptq" and not words[1].endswith(":"):
                found.append((number, part.strip()))
    return found


def no_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` and its subparsers (`ptq table set` is two deep) without abbreviated long options
    (`--num-image` would match `--num-images`): a doc must spell a flag as it is defined. argparse lists its
    subparsers only in its private `_actions`."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbreviations(sub)
    return parser


PARSER = no_abbreviations(build_parser())


def parse_error(command: str) -> Optional[str]:
    """None when `command` (a `ptq ...` line) parses, else argparse's message."""
    argv = shlex.split(command)[1:]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            PARSER.parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --help and --version exit with 0
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def all_commands() -> list[tuple[str, int, str]]:
    return [(page.relative_to(ROOT).as_posix(), number, command)
            for page in PAGES for number, command in commands(page.read_text(encoding="utf-8"))]


def test_the_docs_hold_commands_of_every_job():
    used = {shlex.split(command)[1] for _, _, command in all_commands()}
    assert {"calibrate", "run", "report", "debug", "tune", "table", "dsp-report", "ops"} <= used
    readme = {shlex.split(command)[1] for page, _, command in all_commands() if page == "README.md"}
    assert {"calibrate", "run", "report", "debug", "tune"} <= readme


@pytest.mark.parametrize("page, line, command", all_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_command_parses(page, line, command):
    error = parse_error(command)
    assert error is None, f"{page}:{line}: `{command}`: {error}"


def test_a_bad_flag_fails_the_check():
    good = "ptq calibrate examples/efficientnet_lite0.onnx --images examples/calib --mean 127 --std 128 --out out/"
    assert parse_error(good) is None
    assert "--no-such-flag" in parse_error(good + " --no-such-flag")
    assert parse_error("ptq calibrat examples/efficientnet_lite0.onnx --images examples/calib") is not None
    # an abbreviation of a real flag is refused too
    assert parse_error("ptq run m.onnx --quant q.json --images x --num-image 3") is not None
    assert parse_error("ptq run m.onnx --images x") is not None  # --quant is required
    assert parse_error("ptq table set t.quant.json getitem_6 --bits 16") is None
    assert parse_error("ptq table set t.quant.json getitem_6 --bit 16") is not None


def test_commands_are_found_in_blocks_only():
    text = "\n".join([
        "Run `ptq calibrate --bogus` in prose: not a command.",
        "```",
        "pip install -e . && ptq run m.onnx --quant q.json \\",
        "    --images x",
        "ptq report: note: out/hand.quant.json: edited",
        "usage: ptq calibrate MODEL [--out DIR]",
        "```",
        "```",
        "$ ptq table show out/a.quant.json getitem_6",
        "ptq report end to end (output of a bench script)",
        "```",
    ])
    assert commands(text) == [(3, "ptq run m.onnx --quant q.json --images x"),
                              (9, "ptq table show out/a.quant.json getitem_6")]


def readme_links() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [target for target in LINK.findall(text)
            if not re.match(r"^[a-z]+:", target) and not target.startswith("#")]


def test_readme_links_point_to_files():
    links = readme_links()
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert missing == []
    assert "docs/calibrate.md" in links  # the links were found


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = 'pip install -e ".[test,ray]" && python -m pytest -q'
    docs_command = 'pip install -e ".[docs]" && mkdocs build --strict'
    for command in (test_command, docs_command):
        assert command in readme and command in ci


def test_the_docs_hook_unescapes_pipes_in_table_code_spans_only():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    text = "| `--ray auto\\|local` | a \\| b |\nprose `x\\|y`"
    assert hooks.unescape_table_pipes(text) == "| `--ray auto|local` | a \\| b |\nprose `x\\|y`"
