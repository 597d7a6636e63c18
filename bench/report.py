"""docs/BENCHMARKS.md's tables, rendered from the committed bench results (docs/bench/*.json).

    .venv/bin/python bench/report.py [--check] [--png]
    .venv/bin/python bench/report.py --record NAME --output bench/out/X.json --title T --command C [--notes N]

A record is one JSON file, ``docs/bench/NAME.json``: ``bench`` (the script under bench/), ``title``,
``date``, ``machine``, ``command``, optional ``source`` and ``notes``, and ``figures``: what the bench
printed. The page holds NAME's table between ``<!-- bench:begin NAME -->`` and ``<!-- bench:end -->``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "bench"
PAGE = ROOT / "docs" / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- bench:begin ([\w.-]+) -->\n)(.*?)(<!-- bench:end -->)", re.DOTALL)
REQUIRED = ("bench", "title", "date", "machine", "command", "figures")


def load_records(folder: Path = RESULTS) -> dict[str, dict]:
    """Every record in ``folder`` by its file stem; ValueError naming a file that lacks a field."""
    records = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"{path.name}: missing {', '.join(missing)}")
        records[path.stem] = record
    return records


def value(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return " / ".join(value(x) for x in v)
    return str(v).replace("|", "\\|")


def label(key: str) -> str:
    return key.replace("|", "\\|")


def _scalar(v: object) -> bool:
    return not isinstance(v, (dict, list)) or (isinstance(v, list) and all(_scalar(x) for x in v))


def _rows(v: object) -> list[tuple[str, dict]] | None:
    """``v`` as table rows (a dict of flat dicts, or a list of flat dicts), else None."""
    if (
        isinstance(v, dict)
        and v
        and all(isinstance(r, dict) and all(map(_scalar, r.values())) for r in v.values())
    ):
        return list(v.items())
    if isinstance(v, list) and v and all(isinstance(r, dict) and all(map(_scalar, r.values())) for r in v):
        return [("", r) for r in v]
    return None


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def figures_markdown(figures: dict, depth: int = 0) -> list[str]:
    """Any bench's JSON as tables, in its own key order: runs of scalars as one two-column table, a
    dict (or list) of flat dicts as one table with a row each, other dicts recursed under a label."""
    out: list[str] = []
    scalars: list[list[str]] = []

    def flush() -> None:
        if scalars:
            out.extend([*table(["figure", "value"], scalars), ""])
            scalars.clear()

    for key, v in figures.items():
        rows = _rows(v)
        if _scalar(v):
            scalars.append([label(key), value(v)])
            continue
        flush()
        out.append(f"{'*' * (2 if depth == 0 else 1)}{label(key)}{'*' * (2 if depth == 0 else 1)}")
        out.append("")
        if rows is not None:
            columns = list(dict.fromkeys(c for _, r in rows for c in r))
            first = [] if rows[0][0] == "" else [""]
            body = [([name] if first else []) + [value(r.get(c)) for c in columns] for name, r in rows]
            out.extend([*table(first + [label(c) for c in columns], body), ""])
        elif isinstance(v, dict):
            out.extend(figures_markdown(v, depth + 1))
        else:
            out.extend([f"`{json.dumps(v)}`", ""])
    flush()
    return out


def vs_llamacpp(figures: dict) -> list[str]:
    """bench_vs_llamacpp.py's report: one table per model, forkline next to llama.cpp."""
    out: list[str] = []
    for model, r in figures.get("models", {}).items():
        ours, theirs = r.get("forkline", {}), r.get("llama_cpp", {})
        rows = []
        for kind, case in (("prefill", "prefill {} tokens, tok/s"), ("decode", "decode at depth {}, tok/s")):
            for k, mine in ours.get(kind, {}).items():
                other = theirs.get(kind, {}).get(k)
                ratio = r.get("ratios", {}).get(kind, {}).get(k)
                rows.append([case.format(k), value(mine), value(other), value(ratio)])
        batched = r.get("batched", {})
        if "ratio" in batched:
            per_round = (
                f" (rounds {value(batched['ratio_per_round'])})" if batched.get("ratio_per_round") else ""
            )
            rows.append(
                ["8 sequences, aggregate over one sequence", value(batched["ratio"]) + per_round, "", ""]
            )
        http = r.get("http", {})
        if "forkline" in http and "error" not in http["forkline"]:
            mine, other, ratios = http["forkline"], http.get("llama_cpp", {}), http.get("ratios", {})
            rows.append(["HTTP: a prefix hit's first token, s", value(mine.get("hit_ttft_s")),
                         value(other.get("hit_ttft_s")), value(ratios.get("hit_ttft_vs_llama_server"))])  # fmt: skip
            rows.append(["HTTP: decode after the hit, tok/s", value(mine.get("decode_tok_s")),
                         value(other.get("decode_tok_s")), value(ratios.get("decode_vs_llama_server"))])  # fmt: skip
        out.append(f"**{model}** (forkline weights `{ours.get('weights_dtype', '?')}`)")
        out.append("")
        out.extend([*table(["case", "forkline", "llama.cpp", "forkline / llama.cpp"], rows), ""])
    rest = {k: v for k, v in figures.items() if k != "models"}
    return out + (figures_markdown(rest) if rest else [])


def workloads(figures: dict) -> list[str]:
    """bench_workloads.py's report: one row per workload and model, forkline next to llama-server."""
    head = ["workload", "forkline cached share", "ideal", "forkline / ideal", "llama-server cached share",
            "TTFT p50 forkline / llama-server", "wall forkline / llama-server", "bytes held / ideal radix"]  # fmt: skip
    out: list[str] = []
    for model, r in figures.get("models", {}).items():
        rows = []
        for name, w in r.get("workloads", {}).items():
            mine, theirs, ratios = w.get("forkline", {}), w.get("llama_server", {}), w.get("ratios", {})
            rows.append([name, value(mine.get("cached_share")), value(mine.get("ideal_share")),
                         value(ratios.get("cached_share_vs_ideal")), value(theirs.get("cached_share")),
                         value(ratios.get("ttft_p50")), value(ratios.get("wall")),
                         value(mine.get("bytes_held_vs_ideal_radix"))])  # fmt: skip
        out += [f"**{model}** (`{r.get('route', '?')}`)", "", *table(head, rows), ""]
        if sweep := r.get("sweep"):  # one row per setting of the swept prefix-service flag
            names = list(next(iter(sweep["settings"].values()), {}))
            rows = [[v, *(f"{s[n]['cached_share']} / {s[n]['ttft_p50_s']}" for n in names)] for v, s in sweep["settings"].items()]  # fmt: skip
            out += [f"`--{sweep['flag']}` (cached share / TTFT p50 s):", "", *table([sweep["flag"], *names], rows), ""]  # fmt: skip
    return out


def http_hits(figures: dict) -> list[str]:
    """bench_http_hits.py's report: a hit's first token per model and reused length, both doors."""
    head = ["model", "positions reused", "forkline hit TTFT p50, s", "llama-server hit TTFT p50, s",
            "forkline / llama-server", "cold TTFT forkline / llama-server"]  # fmt: skip
    rows = []
    for model, r in figures.get("models", {}).items():
        for length, mine in r.get("forkline", {}).items():
            theirs, ratios = r.get("llama_server", {}).get(length, {}), r.get("ratios", {}).get(length, {})
            rows.append([model, value(max(mine.get("hit_cached_tokens") or [0])),
                         value(mine.get("hit_ttft_p50_s")), value(theirs.get("hit_ttft_p50_s")),
                         value(ratios.get("hit_ttft_p50")), value(ratios.get("cold_ttft"))])  # fmt: skip
    return [*table(head, rows), ""]


def agent_turns(figures: dict) -> list[str]:
    """bench_agent_turns.py's report: per way, TTFT at turns 2 and last, p50, growth, computed
    positions per later turn and wall; then forkline's ratios to llama-server."""
    head = ["model", "server", "way", "TTFT turn 2, s", "TTFT last turn, s", "TTFT p50, s",
            "growth (last 3 / turns 2-4)", "positions computed per later turn", "wall, s"]  # fmt: skip
    rows, ratios = [], []
    for model, r in figures.get("models", {}).items():
        for server in ("forkline", "llama_server"):
            for way, w in r.get(server, {}).items():
                ttft, computed = (
                    w.get("ttft_s") or [0, 0],
                    [
                        p - c
                        for p, c in zip(w.get("prompt_tokens", []), w.get("cached_tokens", []), strict=False)
                    ],
                )
                rows.append([model, server, way, value(ttft[1]), value(ttft[-1]), value(w.get("ttft_p50_s")),
                             value(w.get("ttft_growth")), value(max(computed[1:], default=0)),
                             value(w.get("wall_s"))])  # fmt: skip
        for pair, q in r.get("ratios", {}).items():
            ratios.append([model, pair, value(q.get("ttft_p50")), value(q.get("wall"))])
    out = [*table(head, rows), ""]
    return out + [*table(["model", "forkline / llama-server", "TTFT p50", "wall"], ratios), ""]


def resume(figures: dict) -> list[str]:
    """bench_resume.py's report: per model and door, trials exact, the client's pause p50 / max, the
    longest pause over what a restart from scratch would wait, the positions a resume recomputed
    (gRPC reports them), and the uninterrupted decode rate (checkpoints cost there)."""
    head = ["model", "door", "trials exact", "pause p50, s", "pause max, s", "pause / restart (max)",
            "positions recomputed (min-max)", "decode tok/s"]  # fmt: skip
    rows = []
    for model, r in figures.get("models", {}).items():
        for door in ("grpc", "http"):
            trials = [t for t in r.get("trials", []) if t.get("door") == door]
            pauses = sorted(t["pause_s"] for t in trials) or [0]
            recomputed = [t["recomputed"] for t in trials if "recomputed" in t]
            spread = f"{min(recomputed)}-{max(recomputed)}" if recomputed else "-"
            ratio = max((t["pause_s"] / t["scratch_s"] for t in trials if t.get("scratch_s")), default=None)
            rows.append([model, door, f"{sum(t['exact'] for t in trials)} / {len(trials)}",
                         value(pauses[len(pauses) // 2]), value(pauses[-1]),
                         value(round(ratio, 3)) if ratio is not None else "-", spread,
                         value(r.get("decode_tok_s"))])  # fmt: skip
    return [*table(head, rows), ""]


def faults(figures: dict) -> list[str]:
    """bench/faults.py's report: per fault class, trials, outputs equal to the cold run, how they ended,
    the streams whose cached count was checked against the ids (and the positions they claimed), and
    those over the bound."""
    rows = [
        [
            name,
            str(c.get("trials")),
            str(c.get("exact")),
            ", ".join(f"{k} {v}" for k, v in c.get("ended", {}).items()),
            f"{c['cached_counts_checked']} ({c['reused_positions_checked']})"
            if "cached_counts_checked" in c
            else "-",
            str(len(c["cached_over_reused"])) if "cached_over_reused" in c else "-",
        ]
        for name, c in figures.get("classes", {}).items()
    ]
    head = ["fault class", "trials", "equal to the cold run", "how they ended"]
    head += ["cached counts checked (positions)", "over the ids' bound"]
    return [*table(head, rows), ""]


def speculative(figures: dict) -> list[str]:
    """bench_speculative.py's report: per model, task, mode and batch, plain and speculative decode tok/s,
    their ratio, identical outputs, drafts accepted, and llama-server's best n-gram type beside it."""
    lines: list[str] = []
    for name, r in figures.get("models", {}).items():
        rows = [
            [
                row["task"],
                row["mode"],
                str(row["sequences"]),
                f"{row['plain_tok_s']:.0f}",
                f"{row['lookup_tok_s']:.0f}",
                f"{row['ratio']:.2f}",
                row["identical"],
                f"{row['accepted']} / {row['drafted']}",
                f"{row['llama_best_spec']} {row['llama_spec_tok_s']:.0f} (plain {row['llama_plain_tok_s']:.0f})"
                if row.get("llama_best_spec")
                else "-",
                f"{row['vs_llama_spec']:.2f}" if row.get("vs_llama_spec") else "-",
            ]
            for row in r["rows"]
        ]
        head = ["task", "mode", "seqs", "plain tok/s", "speculative tok/s", "ratio", "identical"]
        head += ["accepted / drafted", "llama-server best n-gram, tok/s", "forkline / llama"]
        lines += [f"**{name}**", "", *table(head, rows), ""]
        if "ring_slots" in r:
            slots = r["ring_slots"]
            lines += [
                f"Sliding-window ring slots per sequence: {slots['plain']} plain, {slots['lookup']} with drafts.",
                "",
            ]
    return lines


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "bench_vs_llamacpp": vs_llamacpp,
    "bench_workloads": workloads,
    "bench_http_hits": http_hits,
    "bench_agent_turns": agent_turns,
    "bench_resume": resume,
    "bench_resume_checkpoints": resume,
    "faults": faults,
    "bench_speculative": speculative,
}


def render(record: dict) -> str:
    """One record's block: what was run where and when, then its figures."""
    lines = [f"*{record['title']}.* Measured {record['date']} on {record['machine']}.", ""]
    lines += [
        f"Command: `{record['command']}`" + (f" ({record['source']})" if record.get("source") else ""),
        "",
    ]
    lines += RENDERERS.get(record["bench"], figures_markdown)(record["figures"])
    notes = record.get("notes")
    for note in [notes] if isinstance(notes, str) else notes or []:
        lines += [note, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_page(text: str, records: dict[str, dict]) -> str:
    """``text`` with every marked block replaced by its record's rendering (KeyError: no record)."""
    return BLOCK.sub(lambda m: m.group(1) + render(records[m.group(2)]) + m.group(4), text)


def problems(text: str, records: dict[str, dict]) -> list[str]:
    """What keeps ``text`` from being the page these records render: blocks without a record, records
    without a block, and blocks whose tables differ from their record's."""
    found = []
    names = [m.group(2) for m in BLOCK.finditer(text)]
    found += [f"block {n}: no docs/bench/{n}.json" for n in names if n not in records]
    found += [f"docs/bench/{n}.json: no block in BENCHMARKS.md" for n in records if n not in names]
    for m in BLOCK.finditer(text):
        if m.group(2) in records and m.group(3) != render(records[m.group(2)]):
            found.append(
                f"block {m.group(2)}: differs from docs/bench/{m.group(2)}.json (run bench/report.py)"
            )
    return found


def write_png(records: dict[str, dict]) -> None:
    """The side-by-side bar chart, drawn by bench_vs_llamacpp's own plot from the committed record."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_vs_llamacpp import plot

    for name, record in records.items():
        if record["bench"] == "bench_vs_llamacpp":
            plot(record["figures"], str(ROOT / "docs" / "img" / f"{name}.png"))


def machine(load: list[float] | None = None) -> str:
    """This machine in words: CPU model, cores, the kernels' ISA, BLAS pin, load average (``load``: the
    run's own reading when the bench printed one, else read now)."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    model = names[0] if names else platform.processor() or platform.machine()
    isa = "AVX-512" if " avx512f" in cpuinfo else "AVX2" if " avx2" in cpuinfo else platform.machine()
    blas = os.environ.get("OPENBLAS_CORETYPE")
    pinned = f", OPENBLAS_CORETYPE={blas}" if blas else ""
    shown = ", ".join(f"{x:.1f}" for x in (load or os.getloadavg()))
    when = "at the run's start" if load else "at recording"
    return f"{model}, {os.cpu_count()} cores, {isa}, no GPU{pinned}, load average {shown} {when}"


def record(name: str, output: Path, title: str, command: str, notes: list[str]) -> Path:
    """``docs/bench/NAME.json`` from a bench's output JSON, dated today, with this machine."""
    path = RESULTS / f"{name}.json"
    previous = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    figures = json.loads(output.read_text(encoding="utf-8"))
    load = figures.get("load_average_1_5_15min") if isinstance(figures, dict) else None
    fields = {
        "bench": Path(command.split()[1]).stem if len(command.split()) > 1 else previous.get("bench", name),
        "title": title or previous.get("title", name),
        "date": datetime.date.today().isoformat(),
        "machine": machine(load),
        "command": command,
        "notes": notes,
        "figures": figures,
    }
    path.write_text(json.dumps(fields, indent=1) + "\n", encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the records")
    parser.add_argument("--png", action="store_true", help="also draw docs/img/ charts from the records")
    parser.add_argument("--record", metavar="NAME", help="write docs/bench/NAME.json from --output first")
    parser.add_argument("--output", type=Path, help="the bench's JSON output (with --record)")
    parser.add_argument("--title", default="", help="what the record measures (with --record)")
    parser.add_argument("--command", default="", help="the command that ran the bench (with --record)")
    parser.add_argument("--notes", action="append", default=[], help="a note under the table (repeatable)")
    args = parser.parse_args()
    if args.record:
        if args.output is None or not args.command:
            parser.error("--record needs --output and --command")
        print(record(args.record, args.output, args.title, args.command, args.notes))
    records = load_records()
    text = PAGE.read_text(encoding="utf-8")
    if args.check:
        found = problems(text, records)
        print("\n".join(found) or "BENCHMARKS.md matches docs/bench/")
        sys.exit(1 if found else 0)
    missing = [n for n in (m.group(2) for m in BLOCK.finditer(text)) if n not in records]
    if missing:
        sys.exit(f"BENCHMARKS.md blocks without a record: {', '.join(missing)}")
    PAGE.write_text(render_page(text, records), encoding="utf-8")
    if args.png:
        write_png(records)


if __name__ == "__main__":
    main()
