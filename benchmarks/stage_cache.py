"""The stage cache on one big compile: change only an emit option, and only emit runs again.

    python -m benchmarks.stage_cache [--depth 48] [--backend coreml] [--runs 3]
        [--json benchmarks/results/stage_cache.json] [--markdown benchmarks/results/stage_cache.md]

In one process, after a warm-up compile (imports, registries): a compile without the cache,
a cold compile into an empty cache folder (it stores the stage outputs), a compile with one
emit option changed (`emit_extract_delegate_segments=False`: capture runs, the lowered
program is loaded, emit runs), and the same compile again (every stage a hit). Each is the
median of `--runs` rounds, each round in a fresh cache folder. Target: the emit-option
compile <= 0.2x the cold one. Then the same model as `python -m compiler compile` in a fresh
process twice, cold (an empty cache folder) and warm, as a user re-running it does
(`benchmarks.fresh_process`): the warm one takes the program from the program cache, with
no capture and no import of torch or ExecuTorch. Target: warm <= 0.1x cold.
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
from benchmarks import fresh_process
from benchmarks.compile_time import _quiet, stack

CHANGED = {"emit_extract_delegate_segments": False}


def _timed_compile(depth: int, backend: str, **options) -> tuple[float, object]:
    model, inputs = stack(depth)
    start = time.perf_counter()
    artifact = compiler.compile(model, inputs, backend, **options)
    return time.perf_counter() - start, artifact


def one_round(depth: int, backend: str) -> dict:
    load = os.getloadavg()[0]
    folder = tempfile.mkdtemp(prefix="stage-cache-bench-")
    try:
        no_cache, _ = _timed_compile(depth, backend)
        cold, _ = _timed_compile(depth, backend, cache_dir=folder)
        changed, artifact = _timed_compile(depth, backend, cache_dir=folder, **CHANGED)
        hit, _ = _timed_compile(depth, backend, cache_dir=folder, **CHANGED)
        # The entries and the weight store beside them (each weight once, `compiler/driver/weight_store.py`).
        stored_mb = sum(os.path.getsize(os.path.join(top, f)) for top, _, files in os.walk(folder) for f in files) / 2**20
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = {r.stage: {"seconds": r.seconds, "cached": r.cached} for r in artifact.report.stages}
    return {"no_cache": no_cache, "cold": cold, "emit_option_changed": changed, "full_hit": hit,
            "stored_mb": stored_mb, "changed_stages": rows, "load_average_before": load}


def fresh_cli(depth: int, backend: str) -> dict:
    """The compile as `python -m compiler compile` in fresh processes: cold, then warm."""
    folder = tempfile.mkdtemp(prefix="stage-cache-cli-")
    report = os.path.join(folder, "report.json")
    arguments = ["compile", f"transformer:depth={depth}", "--backend", backend, "--cache-dir",
                 os.path.join(folder, "cache"), "-o", os.path.join(folder, "model.pte"), "--report-json", report, "-q"]

    def full_hit(done: dict) -> bool:
        with open(report) as f:
            return all(stage["cached"] for stage in json.load(f)["stages"])

    try:
        return fresh_process.cold_then_warm(arguments, fresh_process.snapshot(folder), full_hit)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def markdown(result: dict) -> str:
    median, rounds, fresh = result["median"], result["rounds"], result["fresh_cli"]
    loads = [r["load_average_before"] for r in rounds]
    stages = rounds[0]["changed_stages"]
    lines = [
        f"Stage cache, transformer stack depth {result['depth']}, {result['backend']}, median of {result['runs']} rounds "
        f"(`python -m benchmarks.stage_cache`); load average before the rounds {min(loads):.1f} to {max(loads):.1f} "
        f"on {os.cpu_count()} cores: ratios within this run are what count.",
        "",
        "| compile | seconds | / cold |",
        "|---|---|---|",
        *(f"| {label} | {median[k]:.2f} | {median[k] / median['cold']:.3f} |" for k, label in (
            ("no_cache", "no cache"), ("cold", "cold (empty cache, stores)"),
            ("emit_option_changed", "emit option changed"), ("full_hit", "same again (full hit)"))),
        "",
        f"Stored: {median['stored_mb']:.0f} MB (the entries and their weights, each stored once). The emit-option compile, stage by stage (first round): "
        + ", ".join(f"{s} {v['seconds']:.2f} s{' (cached)' if v['cached'] else ''}" for s, v in stages.items()),
        "",
        f"As fresh processes (`{fresh['command']}` with a temporary folder; python and every import included):",
        "",
        "| compile | seconds | / cold | load avg before |",
        "|---|---|---|---|",
        *(f"| {label} | {fresh[k]['wall_seconds']:.2f} | {fresh[k]['wall_seconds'] / fresh['cold']['wall_seconds']:.3f} "
          f"| {fresh[k]['load_average_before']:.1f} |" for k, label in (("cold", "cold (empty cache)"), ("warm", "warm"))),
        "",
        f"Warm vs cold: {fresh['warm_over_cold']:.3f}x (target <= 0.1x): "
        f"{'met' if fresh['warm_over_cold'] <= 0.1 else 'missed'}; every stage from the cache: "
        f"{'yes' if fresh['warm_full_hit'] else 'NO'}. Of the warm run, {fresh['startup_seconds']:.2f} s is python and "
        "the CLI's imports; the rest is the key, loading the entry and writing the .pte and the report.",
    ]
    return "\n".join(lines) + "\n"


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
    fresh = fresh_cli(args.depth, args.backend)
    result = {"depth": args.depth, "backend": args.backend, "runs": args.runs, "median": median,
              "emit_option_changed_over_cold": median["emit_option_changed"] / median["cold"],
              "full_hit_over_cold": median["full_hit"] / median["cold"], "rounds": rounds, "fresh_cli": fresh}
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
