"""One owner per input rule: the rules issue 34 found written several times live in one module each, and
the source is scanned for the old copies (each scan is shown to catch a planted copy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_service", "prefix_service", "clients")

# rule -> (a copy's pattern, the one module allowed to hold it, what that owner holds)
RULES: dict[str, tuple[re.Pattern[str], str, str]] = {
    "vocabulary": (
        re.compile(r"outside the vocabulary \[|0 <= \w+ < \w*vocab"),
        "engine_service/api/limits.py",
        "is outside the vocabulary [0,",
    ),
    "empty input": (
        re.compile(r"Argument\(f?\"input[^\"]* is empty"),
        "engine_service/api/limits.py",
        'InvalidArgument(f"{field} is empty")',
    ),
    "fits max_session_tokens": (
        re.compile(r"exceeds? (the engine's )?max_session_tokens"),
        "engine_service/api/limits.py",
        "exceeds max_session_tokens=",
    ),
    "conversation": (
        re.compile(r"\(\"system\", \w+\.system\)|\"role\": \"system\", \"content\": \w+\.system"),
        "engine_service/api/prompts.py",
        '(("system", self.system),)',
    ),
    "chat rendering": (re.compile(r"\bchat\.format\("), "engine_service/api/prompts.py", "chat.format("),
    "prompt capture": (
        re.compile(r"update\.position >= |\.tokens and not self\._prompt"),
        "engine_service/api/stream_events.py",
        "def prompt_snapshot_due(",
    ),
    "text input": (
        re.compile(r"TextPrompt\(\s*msg\.text"),
        "engine_service/serving/engine_wire/prompts.py",
        "TextPrompt(msg.text",
    ),
}


def sources(root: Path = ROOT) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for package in PACKAGES
        for p in sorted((root / package).rglob("*.py"))
    }


def copies(files: dict[str, str]) -> list[str]:
    """``rule: file:line`` for every copy of a rule outside its owner."""
    found = []
    for rule, (pattern, owner, _) in RULES.items():
        for name, text in files.items():
            if name == owner:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{rule}: {name}:{number}")
    return found


def test_every_input_rule_has_one_owner() -> None:
    assert copies(sources()) == []


def test_each_owner_holds_its_rule() -> None:
    """The owners really hold the rules (a renamed message would otherwise make the scan vacuous)."""
    files = sources()
    for rule, (_, owner, holds) in RULES.items():
        assert holds in files[owner], f"{rule}: {owner} no longer holds it"
    both = [files["engine_service/sessions/capture.py"], files["prefix_service/cache/capture.py"]]
    assert all("prompt_snapshot_due(" in text for text in both)  # the one capture rule, called by both


@pytest.mark.parametrize(
    "planted",
    [
        'raise InvalidArgument(f"token {t} is outside the vocabulary [0, {n})")',
        "bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)",
        'raise InvalidArgument("input is empty")',
        'raise InvalidArgument(f"input of {n} positions exceeds the engine\'s max_session_tokens={m}")',
        'messages = [("system", prompt.system), ("user", prompt.text)]',
        'messages = [{"role": "system", "content": prompt.system}]',
        'ids = tok.encode(loaded.chat.format([{"role": "user", "content": text}]))',
        "if update.tokens and not self._prompt_requested:",
        "return TextPrompt(msg.text, msg.chat, msg.system)",
    ],
)
def test_control_a_planted_copy_is_found(planted: str) -> None:
    files = {"prefix_service/planted.py": f"def f():\n    {planted}\n"}
    assert copies(files) != []
