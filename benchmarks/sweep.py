"""Sweep benchmark: a process pool's speed-up and a warm cache's.

    python -m benchmarks.sweep [--depths 16 14 12 10] [--backends xnnpack portable]
                               [--json benchmarks/results/sweep.json] [--markdown benchmarks/results/sweep.md]

Eight jobs (transformer block stacks of four depths, d=64, for XNNPACK and portable, largest
first so neither worker idles at the end; no two share a cache key, so a cold sweep reuses
nothing within itself) are compiled by `compiler.sweep` three times in this process: cold
with `workers=1`, cold with `workers=2` (each in a fresh cache folder), then the `workers=2`
sweep again on its now warm cache; a one-job sweep first starts the fork server the workers
fork from, so each timed run finds it running, as any later sweep in a process does. Then
the sweep runs as `python -m compiler sweep` in a fresh process twice, cold (an empty cache
folder) and warm, as a user re-running it does (`benchmarks.fresh_process`): the warm one
takes every job's program from the program cache and starts no worker. Targets: 2 workers
>= 1.6x faster than 1 on 2 cores; warm <= 0.1x the cold time, in one process and as fresh
processes. The machine's load average before each run, and how many cores two pure-Python
loops get at once right after an in-process one, are recorded beside it: on a shared machine
other work takes cores a pool would use; ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks import fresh_process
from compiler.stages import STAGE_NAMES
from compiler.tools import sweeps


def jobs(depths, backends) -> list[dict]:
    return [{"model": [f"transformer:depth={d}" for d in depths], "backend": list(backends)}]


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def parallel_capacity(n: int = 20_000_000) -> dict:
    """How much of 2 cores this machine gives now: a pure-Python loop alone, then two at once
    in two spawned processes. On 2 free cores each of the two takes as long as the one alone
    (capacity 2.0); other work on a shared machine brings it towards 1.0, which caps any
    pool's speed-up."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_spin, [1000, 1000]))  # started
        alone = pool.submit(_spin, n).result()
        both = max(pool.map(_spin, [n, n]))
    return {"one_loop_seconds": alone, "two_loops_seconds": both, "capacity": 2 * alone / both}


def timed(job_list, workers: int, cache_dir: str) -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    rows = sweeps.sweep(job_list, workers=workers, cache_dir=cache_dir)
    wall = time.perf_counter() - start
    failed = [row for row in rows if not row.passed]
    if failed:
        raise SystemExit(f"sweep failed: {failed[0].label}: {failed[0].error}")
    capacity = parallel_capacity()
    stage_sum = {stage: sum(row.stage_seconds.get(stage, 0.0) for row in rows) for stage in STAGE_NAMES}
    job_seconds = sum(row.seconds for row in rows)
    compile_seconds = sum(row.compile_seconds or 0.0 for row in rows)
    return {
        "workers": workers,
        "wall_seconds": wall,
        "load_average_before": load,
        # Measured right after the sweep (see parallel_capacity).
        "parallel_capacity_after": capacity["capacity"],
        "jobs": len(rows),
        "job_seconds_sum": job_seconds,
        "compile_seconds_sum": compile_seconds,
        "stage_seconds_sum": stage_sum,
        "cached_stages": sum(len(row.cached_stages) for row in rows),
        # Wall time no job accounts for: starting the workers, dispatch.
        "startup_seconds": wall - job_seconds / min(workers, len(rows)),
        "rows": [
            {"job": row.label, "backend": row.backend, "seconds": row.seconds, "compile_seconds": row.compile_seconds,
             "cached_stages": list(row.cached_stages), "stage_seconds": dict(row.stage_seconds)}
            for row in rows
        ],
    }


def _every_job_cached(count: int):
    """Whether a `python -m compiler sweep` run's table says each of `count` jobs took every stage from the cache."""
    def full_hit(done: dict) -> bool:
        rows = [line for line in done["stdout"].splitlines() if ", ".join(STAGE_NAMES) in line]
        return len(rows) == count
    return full_hit


def fresh_cli(job_list, folder: str) -> dict:
    """The sweep as `python -m compiler sweep` in fresh processes: cold (an empty cache folder), then warm."""
    jobs_file = os.path.join(folder, "jobs.json")
    with open(jobs_file, "w") as f:
        json.dump(job_list, f)
    arguments = ["sweep", jobs_file, "--workers", "2", "--cache-dir", os.path.join(folder, "cache-cli")]
    count = len(sweeps.expand_jobs(job_list))
    return fresh_process.cold_then_warm(arguments, fresh_process.snapshot(folder), _every_job_cached(count))


def markdown(result: dict) -> str:
    cold1, cold2, warm = result["cold_workers_1"], result["cold_workers_2"], result["warm_workers_2"]
    speedup = cold1["wall_seconds"] / cold2["wall_seconds"]
    warm_ratio = warm["wall_seconds"] / cold2["wall_seconds"]
    fresh = result["fresh_cli"]
    loads = [run["load_average_before"] for run in (cold1, cold2, warm, fresh["cold"], fresh["warm"])]
    lines = [
        f"Sweep of {cold1['jobs']} jobs ({', '.join(result['models'])} x {', '.join(result['backends'])}) "
        f"on {result['cpus']} CPUs (`python -m benchmarks.sweep`). Load average before the runs: "
        f"{min(loads):.1f} to {max(loads):.1f} on {result['cpus']} cores (this benchmark's previous run and others' "
        "work on a shared machine); ratios within this run are what count.",
        "",
        "In one process (`compiler.sweep`, wall time, worker start-up included; the fork server already running):",
        "",
        "| run | workers | cache | wall s | sum of job s | cached stages | load avg before | cores free after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run, cache in (("cold", cold1, "empty"), ("cold", cold2, "empty"), ("warm", warm, "the cold run's")):
        lines.append(
            f"| {name} | {run['workers']} | {cache} | {run['wall_seconds']:.1f} | {run['job_seconds_sum']:.1f} | "
            f"{run['cached_stages']} | {run['load_average_before']:.1f} | {run['parallel_capacity_after']:.2f} |"
        )
    lines += [
        "",
        f"As fresh processes (`{fresh['command']}`, all included: python, imports, the fork server when a job "
        "needs a worker):",
        "",
        "| run | wall s | load avg before |",
        "|---|---|---|",
        f"| cold (empty cache) | {fresh['cold']['wall_seconds']:.1f} | {fresh['cold']['load_average_before']:.1f} |",
        f"| warm (the cold run's cache) | {fresh['warm']['wall_seconds']:.2f} | "
        f"{fresh['warm']['load_average_before']:.1f} |",
        "",
        f"- 2 workers vs 1: {speedup:.2f}x faster (target >= 1.6x): {'met' if speedup >= 1.6 else 'missed'}",
        "  (`cores free`: how many of the 2 cores two pure-Python loops got at once, right after the run:"
        " 2.0 on an idle machine; a pool cannot beat it)",
        f"- warm vs cold in one process (2 workers): {warm_ratio:.3f}x the time (target <= 0.1x): "
        f"{'met' if warm_ratio <= 0.1 else 'missed'}",
    ]
    if warm["cached_stages"] < warm["jobs"] * len(STAGE_NAMES):
        lines.append(
            "  (served by workers from the stage cache, capture included, not by the program cache: this process "
            "computed the compiler's source digest once, and a source of the checkout changed during the run)"
        )
    lines += [
        f"- warm vs cold as fresh processes: {fresh['warm_over_cold']:.3f}x the time (target <= 0.1x): "
        f"{'met' if fresh['warm_over_cold'] <= 0.1 else 'missed'}; every job served from the program cache: "
        f"{'yes' if fresh['warm_full_hit'] else 'NO'}",
        f"- of the fresh warm run's {fresh['warm']['wall_seconds']:.2f} s, {fresh['startup_seconds']:.2f} s is python "
        "and the CLI's imports; the rest is reading the jobs, computing their keys, loading the entries and writing "
        "the outputs (no worker starts, no torch is imported)",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 14, 12, 10])
    parser.add_argument("--backends", nargs="+", default=["xnnpack", "portable"])
    parser.add_argument("--json", default="benchmarks/results/sweep.json")
    parser.add_argument("--markdown", default="benchmarks/results/sweep.md")
    args = parser.parse_args()
    job_list = jobs(args.depths, args.backends)
    result = {
        "models": [f"transformer:depth={d}" for d in args.depths],
        "backends": args.backends,
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as folder:
        print("starting the fork server (a one-job sweep)...", flush=True)
        sweeps.sweep([{"model": "mlp", "backend": "portable"}], workers=1, cache=False)
        for workers in (1, 2):
            cache_dir = os.path.join(folder, f"cache-{workers}")  # a fresh folder per cold run
            print(f"cold sweep, {workers} worker(s)...", flush=True)
            result[f"cold_workers_{workers}"] = timed(job_list, workers, cache_dir)
        print("warm sweep, 2 workers...", flush=True)
        result["warm_workers_2"] = timed(job_list, 2, os.path.join(folder, "cache-2"))
        print("cold then warm sweep, fresh CLI processes...", flush=True)
        result["fresh_cli"] = fresh_cli(job_list, folder)
    text = markdown(result)
    print("\n" + text)
    for path, content in ((args.json, json.dumps(result, indent=2) + "\n"), (args.markdown, text)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)


if __name__ == "__main__":
    main()
