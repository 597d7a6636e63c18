"""Reading-load figures of the source tree (JSON): lines, docstring share, long files, classes, docstrings.

python scripts/code_stats.py [--top N] [PACKAGE ...]   # default: engine_service prefix_service clients
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_service", "prefix_service", "clients")
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 300
LONG_MODULE_DOCSTRING = 15


def _docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    """The string constants that are docstrings (module, class, function), in any nesting."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append(first.value)
    return found


def file_stats(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    docs = _docstring_nodes(tree)
    doc_lines = sum(d.end_lineno - d.lineno + 1 for d in docs)
    module_doc = docs[0] if docs and tree.body and tree.body[0].value is docs[0] else None  # type: ignore[attr-defined]
    classes = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return {
        "lines": len(text.splitlines()),
        "code_lines": sum(1 for line in text.splitlines() if line.strip()),
        "docstring_lines": doc_lines,
        "module_docstring_lines": 0 if module_doc is None else module_doc.end_lineno - module_doc.lineno + 1,
        "classes": classes,
    }


def tree_stats(packages: tuple[str, ...]) -> dict:
    files = {
        str(p.relative_to(ROOT)): file_stats(p)
        for pkg in packages
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }
    lines = sum(f["code_lines"] for f in files.values())  # non-blank: the share is of what a reader reads
    doc_lines = sum(f["docstring_lines"] for f in files.values())
    return {
        "packages": list(packages),
        "files": len(files),
        "non_blank_lines": lines,
        "docstring_lines": doc_lines,
        "docstring_share": round(doc_lines / lines, 4) if lines else 0.0,
        "files_over_400": {p: f["lines"] for p, f in files.items() if f["lines"] > MAX_FILE_LINES},
        "classes_over_300": {
            f"{p}:{name}": n for p, f in files.items() for name, n in f["classes"] if n > MAX_CLASS_LINES
        },
        "module_docstrings_15_plus": {
            p: f["module_docstring_lines"]
            for p, f in files.items()
            if f["module_docstring_lines"] >= LONG_MODULE_DOCSTRING
        },
        "_per_file": files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(PACKAGES))
    parser.add_argument("--top", type=int, default=0, help="also list the N files with most docstring lines")
    args = parser.parse_args()
    stats = tree_stats(tuple(args.packages))
    per_file = stats.pop("_per_file")
    if args.top:
        ranked = sorted(per_file.items(), key=lambda kv: -kv[1]["docstring_lines"])[: args.top]
        stats["most_docstring_lines"] = {p: f["docstring_lines"] for p, f in ranked}
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
