"""The stage cache on one big compile: change only an emit option, and only emit runs again.

    python -m benchmarks.stage_cache [--depth 48] [--backend coreml] [--runs 3]
        [--json benchmarks/results/stage_cache.json] [--markdown benchmarks/results/stage_cache.md]

In one process, after a warm-up compile (imports, registries): a compile without the cache,
a cold compile into an empty cache folder (it stores the stage outputs), a compile with one
emit option changed (`emit_extract_delegate_segments=False`: capture runs, the lowered
program is loaded, emit runs), and the same compile again (every stage a hit). Each is the
median of `--runs` rounds, each round in a fresh cache folder. Target: the emit-option
compile <= 0.2x the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import compiler
from benchmarks.compile_time import _quiet, stack

CHANGED = {"emit_extract_delegate_segments": False}


def _timed_compile(depth: int, backend: str, **options) -> tuple[float, object]:
    model, inputs = stack(depth)
    start = time.perf_counter()
    artifact = compiler.compile(model, inputs, backend, **options)
    return time.perf_counter() - start, artifact


def one_round(depth: int, backend: str) -> dict:
    folder = tempfile.mkdtemp(prefix="stage-cache-bench-")
    try:
        no_cache, _ = _timed_compile(depth, backend)
        cold, _ = _timed_compile(depth, backend, cache_dir=folder)
        changed, artifact = _timed_compile(depth, backend, cache_dir=folder, **CHANGED)
        hit, _ = _timed_compile(depth, backend, cache_dir=folder, **CHANGED)
        stored_mb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = {r.stage: {"seconds": r.seconds, "cached": r.cached} for r in artifact.report.stages}
    return {"no_cache": no_cache, "cold": cold, "emit_option_changed": changed, "full_hit": hit,
            "stored_mb": stored_mb, "changed_stages": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--backend", default="coreml", choices=("portable", "xnnpack", "coreml", "mlx"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    _quiet()
    _timed_compile(1, args.backend)
    rounds = [one_round(args.depth, args.backend) for _ in range(args.runs)]
    keys = ("no_cache", "cold", "emit_option_changed", "full_hit", "stored_mb")
    median = {k: statistics.median(r[k] for r in rounds) for k in keys}
    result = {"depth": args.depth, "backend": args.backend, "runs": args.runs, "median": median,
              "emit_option_changed_over_cold": median["emit_option_changed"] / median["cold"],
              "full_hit_over_cold": median["full_hit"] / median["cold"], "rounds": rounds}
    stages = rounds[0]["changed_stages"]
    lines = [
        f"Stage cache, transformer stack depth {args.depth}, {args.backend}, median of {args.runs} rounds "
        f"(`python -m benchmarks.stage_cache`).",
        "",
        "| compile | seconds | / cold |",
        "|---|---|---|",
        *(f"| {label} | {median[k]:.2f} | {median[k] / median['cold']:.3f} |" for k, label in (
            ("no_cache", "no cache"), ("cold", "cold (empty cache, stores)"),
            ("emit_option_changed", "emit option changed"), ("full_hit", "same again (full hit)"))),
        "",
        f"Stored: {median['stored_mb']:.0f} MB. The emit-option compile, stage by stage (first round): "
        + ", ".join(f"{s} {v['seconds']:.2f} s{' (cached)' if v['cached'] else ''}" for s, v in stages.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
