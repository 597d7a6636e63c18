"""Every command's --help reads like a manual: each option says what it does and, where it has one,
its default; the description is plain text (no reST markup)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import clients.run_llm_batched
import engine_service.__main__
import engine_service.greedy
import prefix_service.__main__

ROOT = Path(__file__).resolve().parents[1]

# python -m <module> -> its parser
COMMANDS = {
    "engine_service": engine_service.__main__.build_parser,
    "prefix_service": prefix_service.__main__.build_parser,
    "clients.run_llm_batched": clients.run_llm_batched.build_parser,
    "engine_service.greedy": engine_service.greedy.build_parser,
}


def help_problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is missing from ``parser``'s help: an action without help text, an optional flag whose
    help does not say its default (``default: <value>`` where the default is a value), reST markup."""
    problems = []
    if "``" in parser.format_help():
        problems.append("reST double backticks in the help")
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not action.help:
            problems.append(f"{name}: no help text")
            continue
        text = formatter._expand_help(action)
        if not action.option_strings or action.required:
            continue
        default = action.default
        if default is None or isinstance(
            default, bool
        ):  # said in words: "default: the model's", "off by default"
            if "default" not in text:
                problems.append(f"{name}: the help does not say what happens without the flag")
        elif f"default: {default}" not in text:
            problems.append(f"{name}: the help does not show its default {default!r}")
    return problems


@pytest.mark.parametrize("module", COMMANDS)
def test_every_option_has_help_and_its_default(module) -> None:
    assert help_problems(COMMANDS[module]()) == []


@pytest.mark.parametrize("module", COMMANDS)
def test_help_runs_and_lists_every_option(module) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "``" not in proc.stdout
    for action in COMMANDS[module]()._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout


def test_checker_sees_what_is_missing() -> None:
    """Negative control: each kind of gap is reported, a complete parser passes."""
    bad = argparse.ArgumentParser(description="run ``it``")
    bad.add_argument("--silent", type=int, default=3)
    bad.add_argument("--hidden_default", type=int, default=3, help="a count")
    bad.add_argument("--path", default=None, help="a path")
    bad.add_argument("--flag", action="store_true", help="turns it on")
    bad.add_argument("things", nargs="+")
    assert help_problems(bad) == [
        "reST double backticks in the help",
        "--silent: no help text",
        "--hidden_default: the help does not show its default 3",
        "--path: the help does not say what happens without the flag",
        "--flag: the help does not say what happens without the flag",
        "things: no help text",
    ]
    good = argparse.ArgumentParser(description="run it")
    good.add_argument("--count", type=int, default=3, help="a count (default: %(default)s)")
    good.add_argument("--path", default=None, help="a path (default: the model's)")
    good.add_argument("--flag", action="store_true", help="turns it on; off by default")
    good.add_argument("--needed", required=True, help="must be given")
    assert help_problems(good) == []
