"""Where a decode step's time goes (issue 22 item 2): one sequence, greedy, the fused kernel path.

For each depth: the graph's primitive nodes, the main thread's CPU time for a step (graph build and
evaluation: on few cores it competes with the kernels' threads), the Python graph-building time of a
step, its evaluation (synchronous), the evaluation without the head (layers + K/V writes), the 30
layers' attention alone over the cache's K/V (recorded from the six-op layer path), and the bytes a token must read (weights as stored -- block data plus float32 scales / mins --
and as the GGUF file stores them, K/V at that depth) against the time, as GB/s. Then per matrix
class the fused_linear kernel's speed over the model's 30 distinct matrices with 1 and 2 pool threads
(the small q/k/v and o matrices show the fixed cost of a call). Medians of repeated runs; the load
average is recorded, since the machine is shared.

    .venv/bin/python bench/profile_decode.py [--model smollm2-135m] [--depths 16 4096]

Prints JSON and writes bench/out/profile_decode.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import mlx.core as mx  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

GGUF_BYTES_PER_32 = {"q8_0": 34, "q4_1": 20}  # a block's bytes in the file (float16 scale / min)


def median_time(fn, reps: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def graph_nodes(outputs: list) -> int:
    """Primitive nodes MLX evaluates for ``outputs`` (its DOT export's labelled nodes)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return len(re.findall(r'label ="[A-Za-z]', dot.getvalue()))


def stored_bytes(proj) -> int:
    return sum(int(a.nbytes) for a in proj.fused_args() if a is not None)


def file_bytes(proj) -> int:
    wq = proj.fused_args()[0]
    elements = wq.shape[0] * proj.tensor.scales.shape[1] * 32
    return elements // 32 * GGUF_BYTES_PER_32[proj.format]


def step_profile(model, depth: int, reps: int) -> dict:
    import engine_service.model.deterministic as det
    import engine_service.model.layers as layers
    from engine_service.cache.batch_control import Segment
    from engine_service.greedy import new_cache, prefill

    cache = new_cache(model, depth + 8, kv_dtype="auto")
    seq = cache.seq_new()
    mx.eval(prefill(model, cache, seq, [1000 + (i * 7919) % 29000 for i in range(depth)]))
    tok = mx.array([5], dtype=mx.int32)
    built: dict = {}

    def build(head: bool = True) -> list:
        cache.rewind(seq, depth)
        step = cache.begin_step([Segment(seq, depth, 1)])
        out = model(step, mx.array([depth], dtype=mx.int32), tokens=tok)
        built["views"] = step
        return [*step.state(), mx.argmax(out[0])] if head else list(step.state())

    build_s = median_time(build, reps)
    eval_s = median_time(lambda: mx.eval(build()), reps) - build_s
    main_s = median_time(lambda: mx.eval(build()), reps, clock=time.thread_time)
    no_head_s = median_time(lambda: mx.eval(build(head=False)), reps) - build_s
    # the attention alone: the kernel over each layer's cache view, 30 calls in one evaluation
    calls = []
    original = det.attend

    def record(q, views, positions, window, scale):
        calls.append((q, views, positions, window, scale))
        return original(q, views, positions, window, scale)

    det.attend = record
    layers.LAYER_OP = False  # the layer op calls the attention kernel inside itself
    try:
        mx.eval(build())
    finally:
        det.attend = original
        layers.LAYER_OP = True
    inputs = [(mx.array(q), v, p, w, s) for q, v, p, w, s in calls]
    attention_s = median_time(lambda: mx.eval([original(*c) for c in inputs]), reps)
    kv_bytes = sum(int(p.keys.nbytes + p.values.nbytes) for _, views, _, _, _ in inputs for p in views)
    return {
        "graph_nodes": graph_nodes(build()),
        "main_thread_ms": round(main_s * 1e3, 2),
        "build_ms": round(build_s * 1e3, 2),
        "eval_ms": round(eval_s * 1e3, 2),
        "eval_without_head_ms": round(no_head_s * 1e3, 2),
        "attention_ms": round(attention_s * 1e3, 2),
        "kv_mb": round(kv_bytes / 1e6, 1),
        "attention_gb_s": round(kv_bytes / attention_s / 1e9, 1),
        "tok_s_sync": round(1 / (build_s + eval_s), 1),
    }


def matrix_classes(model, ext) -> dict:
    x = mx.random.normal((1, model.config.hidden_size))
    mx.eval(x)
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        projs = [getattr(layer, name) for layer in model.layers]
        src = mx.random.normal((1, projs[0].tensor.in_features))
        mx.eval(src)
        nbytes = sum(stored_bytes(p) for p in projs)
        row = {"mb": round(nbytes / 1e6, 1)}
        for threads in (1, 2):
            ext.set_num_threads(threads)
            t = median_time(lambda projs=projs, src=src: mx.eval([ext.fused_linear(src, *p.fused_args()) for p in projs]), 9)  # fmt: skip
            row[f"us_per_call_t{threads}"] = round(t / len(projs) * 1e6, 1)
            row[f"gb_s_t{threads}"] = round(nbytes / t / 1e9, 1)
        out[name] = row
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    row = {"mb": round(stored_bytes(head) / 1e6, 1)}
    for threads in (1, 2):
        ext.set_num_threads(threads)
        t = median_time(lambda: mx.eval(ext.fused_linear(x, *head.fused_args())), 9)
        row[f"gb_s_t{threads}"] = round(stored_bytes(head) / t / 1e9, 1)
    out["head"] = row
    ext.set_num_threads(2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--depths", nargs="+", type=int, default=[16, 4096])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    from engine_service.model import load_model
    from engine_service.model.cpu_kernels import kernels

    ext = kernels()
    if ext is None:
        raise SystemExit("the compiled kernels are not built (bash scripts/setup.sh)")
    model = load_model(args.model).model
    projs = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    weights = sum(stored_bytes(p) for p in projs) + stored_bytes(head)
    in_file = sum(file_bytes(p) for p in projs) + file_bytes(head)
    report: dict = {
        "model": args.model,
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "weights_mb_per_token_as_stored": round(weights / 1e6, 1),
        "weights_mb_per_token_in_gguf": round(in_file / 1e6, 1),
        "head_mb": round(stored_bytes(head) / 1e6, 1),
        "depths": {},
    }
    for depth in args.depths:
        r = step_profile(model, depth, args.reps)
        r["weights_and_kv_gb_s"] = round((weights + r["kv_mb"] * 1e6) / (r["eval_ms"] / 1e3) / 1e9, 1)
        report["depths"][str(depth)] = r
        print(json.dumps({depth: r}), file=sys.stderr, flush=True)
    report["matrices"] = matrix_classes(model, ext)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "profile_decode.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
