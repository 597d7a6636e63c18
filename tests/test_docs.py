"""The docs stay true: relative links and anchors resolve, INTERFACES.md names only what exists,
BENCHMARKS.md's tables are what bench/report.py renders from docs/bench/*.json, the README is short.
Each check has a negative control."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
ROOTS = ("engine_service", "prefix_service", "clients", "protos")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # repeated headings: -1, -2, ...
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def link_problems(page: Path, text: str | None = None) -> list[str]:
    """Every relative link of ``page`` that names no file in the repository, or no heading there."""
    text = page.read_text(encoding="utf-8") if text is None else text
    problems = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md":
            body = text if dest == page else dest.read_text(encoding="utf-8")
            if anchor not in anchors(body):
                problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


def resolve(path: str) -> object:
    """``a.b.c.Name.attr`` imported: the longest importable module, then attributes (AttributeError,
    ImportError when nothing resolves)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        value = importlib.import_module(name)
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ImportError(f"no module in {path}")


ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|([^|]*)\|", re.MULTILINE)


def interface_problems(text: str) -> list[str]:
    """Every module of an INTERFACES.md table row that does not import, and every name in its entry
    points column that the module lacks."""
    problems = []
    for module, names in ROW.findall(text):
        if module.split(".")[0] not in ROOTS:
            continue
        for name in [""] + re.findall(r"`([^`]+)`", names):
            if name and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
                problems.append(f"{module}: `{name}` is not a name")
                continue
            full = f"{module}.{name}" if name else module
            try:
                resolve(full)
            except (ImportError, AttributeError) as exc:
                problems.append(f"{full}: {type(exc).__name__}: {exc}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    assert link_problems(page) == []


def test_control_a_broken_link_and_a_missing_anchor_are_reported() -> None:
    page = DOCS / "ARCHITECTURE.md"
    text = (
        "# Here\n\n[a](MODELS.md#no-such-heading) [b](NOWHERE.md) [c](#here) [d](../../out.md) `[e](x.md)`\n"
    )
    found = link_problems(page, text)
    assert len(found) == 3, found
    assert "no heading #no-such-heading" in found[0] and "no such file" in found[1]
    assert "leaves the repository" in found[2]


def test_slugs_follow_github() -> None:
    assert slug("Deterministic reuse (`--deterministic`)") == "deterministic-reuse---deterministic"
    assert slug("The prefix service's share") == "the-prefix-services-share"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_interfaces_names_exist() -> None:
    text = (DOCS / "INTERFACES.md").read_text(encoding="utf-8")
    assert len(ROW.findall(text)) > 50  # the tables are read at all
    assert interface_problems(text) == []


def test_control_a_made_up_name_is_reported() -> None:
    text = (
        "| module | entry points | what |\n|---|---|---|\n"
        "| `engine_service.api.errors` | `ForklineError`, `NoSuchError`, `ForklineError.nope` | x |\n"
        "| `engine_service.no_such_module` | `Thing` | x |\n"
        "| `prefix_service.cache.index` | `token_key(tokens)` | x |\n"
    )
    found = interface_problems(text)
    assert any("NoSuchError" in p for p in found), found
    assert any("ForklineError.nope" in p for p in found), found
    assert any("no_such_module" in p for p in found), found
    assert any("is not a name" in p for p in found), found
    assert not any(p.startswith("engine_service.api.errors.ForklineError:") for p in found), found


def _report():
    spec = importlib.util.spec_from_file_location("bench_report_under_test", ROOT / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_tables_are_rendered_from_the_committed_results() -> None:
    report = _report()
    records = report.load_records()
    assert records, "no docs/bench/*.json"
    for name, record in records.items():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]), name
        assert record["machine"].strip() and record["command"].strip(), name
    assert report.problems(report.PAGE.read_text(encoding="utf-8"), records) == []


def test_control_an_edited_figure_or_a_missing_record_is_reported() -> None:
    report = _report()
    records = report.load_records()
    text = report.PAGE.read_text(encoding="utf-8")
    edited = copy.deepcopy(records)
    edited["moves"]["figures"]["move_fit"]["overhead_s"] = 0.5
    assert any("block moves: differs" in p for p in report.problems(text, edited))
    fewer = {k: v for k, v in records.items() if k != "moves"}
    assert any("block moves: no docs/bench/moves.json" in p for p in report.problems(text, fewer))
    hand_edited = text.replace("| 0.011 |", "| 0.012 |", 1)
    assert hand_edited != text
    assert report.problems(hand_edited, records)


def test_the_report_renders_any_bench_json() -> None:
    report = _report()
    record = {
        "bench": "bench_x",
        "title": "t",
        "date": "2026-01-01",
        "machine": "m",
        "command": "c",
        "figures": {"a": 1.5, "rows": {"x": {"p50": 1, "p99": [2, 3]}}, "nested": {"b": True}, "c": None},
    }
    out = report.render(record)
    assert "| a | 1.5 |" in out and "| x | 1 | 2 / 3 |" in out and "| b | yes |" in out and "| c | - |" in out


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/"


def doc_pointer_problems(sources: dict[str, str]) -> list[str]:
    """Every ``docs/NAME.md`` (or ``docs/NAME.md#anchor``) a source file names that does not exist."""
    problems = []
    for name, text in sources.items():
        for page, anchor in re.findall(r"(?<![\w/.])docs/([\w/-]+)\.md(?:#([\w-]+))?", text):
            doc = DOCS / f"{page}.md"
            if not doc.exists():
                problems.append(f"{name}: docs/{page}.md does not exist")
            elif anchor and anchor not in anchors(doc.read_text(encoding="utf-8")):
                problems.append(f"{name}: docs/{page}.md has no #{anchor}")
    return problems


def test_code_points_at_docs_pages_that_exist() -> None:
    sources = {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for folder in ("engine_service", "prefix_service", "clients", "bench", "scripts", "tests", "deploy")
        for pattern in ("*.py", "*.yaml")
        for p in (ROOT / folder).rglob(pattern)
        if p != Path(__file__).resolve()
    }
    assert doc_pointer_problems(sources) == []
    assert doc_pointer_problems({"x.py": "see docs/NOWHERE.md"}) == ["x.py: docs/NOWHERE.md does not exist"]
    assert doc_pointer_problems({"x.py": "see docs/HTTP.md#nowhere"}) == [
        "x.py: docs/HTTP.md has no #nowhere"
    ]
