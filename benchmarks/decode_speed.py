"""Decode speed at real size: one decode step of a Llama-shaped model under ExecuTorch's runtime,
against the memory-bandwidth bound.

    python -m benchmarks.decode_speed [--size 1b] [--programs ours:float ours:8da4w optimum:float optimum:8da4w]
                                      [--optimum-python /tmp/optimum-venv/bin/python] [--steps 16] [--keep DIR]

The size's `save_pretrained` folder (`benchmarks.scale`: random weights, bfloat16) is compiled for
XNNPACK with the backend's LLM ops (ExecuTorch's `llama::` SDPA and KV-cache update): ours with the
generation job (`compiler.generate`, which TextLLMRunner runs), float32 and `8da4w` (group 32), and,
with `--optimum-python`, optimum-executorch's `optimum-cli export executorch --recipe xnnpack
--use_custom_sdpa --use_custom_kv_cache` with and without `--qlinear 8da4w` (it runs in a venv of its
own: see `benchmarks.optimum_comparison`). Each export and each timing runs in a process of its own.

Timing: the program is loaded by ExecuTorch's runtime (`compiler.run`'s loader, the file mapped);
its `forward` is called as the runner calls it, one token at a time: `PROMPT` prompt tokens, then
`--steps` greedy decode steps, each timed; the median is the row's step time. The bound is the bytes
a step must read divided by the read bandwidth of this machine: each timing process measures it before
its program loads, with as many threads as ExecuTorch's threadpool runs (torch's and numpy's sums of
a buffer far larger than the caches; the best of five each), and the bound takes the best any process
of the run measured. A step reads every weight but the token embedding's table (one row of it) and
the KV cache up to its position: the program's file less the float32 embedding table, plus the
cache. Results: benchmarks/results/decode_speed.{json,md} (`--render` writes the markdown again from
the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from benchmarks import scale
from benchmarks.optimum_comparison import DEFAULT_PYTHON, optimum_export

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "decode_speed.json")
DEFAULT_MARKDOWN = os.path.join(HERE, "results", "decode_speed.md")
PROGRAMS = ("ours:float", "ours:8da4w", "optimum:float", "optimum:8da4w")
PROMPT = 8
OPTIMUM_FLAGS = ["--use_custom_sdpa", "--use_custom_kv_cache"]
# Bytes read when measuring bandwidth: far beyond any cache.
BANDWIDTH_BYTES = 1 << 30
GB = 1e9
# The issue's targets: 8da4w per step against float32's, and against the bound.
TARGET_SPEEDUP = 2.0
TARGET_OVER_BOUND = 1.5


def _compile_ours(job: dict) -> dict:
    """The generation job's program for the folder, in this (child) process."""
    import compiler

    options = {"cache": False}
    if job["scheme"] != "float":
        options |= {"quantize": job["scheme"], "quantize_group_size": scale.GROUP_SIZE}
    start = time.perf_counter()
    done = compiler.generate(job["folder"], "xnnpack", output_dir=job["output"], max_cache_len=scale.CACHE, **options)
    return {"pte": str(done.pte_path), "compile_s": time.perf_counter() - start, "llm_ops": done.llm_ops}


def read_bandwidth(threads: int) -> float:
    """Bytes per second this machine reads with `threads` threads: the best of five reads of a buffer
    far larger than the caches, each by the faster of two readers (torch's sum on its threads; numpy's
    sum of one slice a thread), so the bound is not a slow reader's."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy
    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(BANDWIDTH_BYTES // 4)
    slices = numpy.array_split(buffer.numpy(), threads)
    with ThreadPoolExecutor(threads) as pool:
        readers = (buffer.sum, lambda: list(pool.map(numpy.sum, slices)))
        best = float("inf")
        for read in readers:
            read()
            for _ in range(5):
                start = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


def step_bytes(size: str, program_bytes: int, position: int) -> int:
    """Bytes one decode step at `position` reads: every weight of the program but the embedding's
    float32 table, one row of it, and the KV cache's keys and values so far."""
    shape = scale.SIZES[size]
    head = shape["hidden"] // shape["heads"]
    embedding = shape["vocab"] * shape["hidden"] * 4
    cache = 2 * shape["layers"] * shape["kv_heads"] * head * (position + 1) * 4
    return program_bytes - embedding + shape["hidden"] * 4 + cache


def _time(job: dict) -> dict:
    """Load the program with ExecuTorch's runtime and time its decode steps, in this (child) process."""
    import torch
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    from compiler.ir.kernels import load_llm_kernels
    from compiler.running.runtime import LoadedProgram

    threads = _threadpool_get_thread_count()
    bandwidth = read_bandwidth(threads)
    load_llm_kernels()  # optimum's program calls the llama:: ops too
    start = time.perf_counter()
    program = LoadedProgram(job["pte"])
    load_s = time.perf_counter() - start
    token, tokens, seconds = 1, [], []
    for position in range(PROMPT + job["steps"]):
        start = time.perf_counter()
        (logits,) = program([torch.tensor([[token]]), torch.tensor([position])])
        if position >= PROMPT:
            seconds.append(time.perf_counter() - start)
            token = int(logits[0, -1].argmax())
            tokens.append(token)
        else:
            token = 1 + (7 * position) % 1000  # a fixed prompt
    return {"threads": threads, "bandwidth": bandwidth, "load_s": load_s, "step_s": statistics.median(seconds),
            "step_min_s": min(seconds), "tokens": tokens}


def _child(role: str, job: dict, timeout: float) -> tuple[dict, int]:
    """Run `role` in a process of its own; its result and its peak resident bytes."""
    result, peak, status, _ = scale.child_result("benchmarks.decode_speed", f"--{role}", job, timeout)
    if result is None:
        how = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exited {os.WEXITSTATUS(status)}"
        raise RuntimeError(f"{role} {how} at {peak / GB:.1f} GB without a result")
    return result, peak


def _optimum(job: dict, python: str) -> dict:
    quantized = ["--qlinear", job["scheme"], "--qlinear_group_size", str(scale.GROUP_SIZE)]
    flags = [*OPTIMUM_FLAGS, *(quantized if job["scheme"] != "float" else [])]
    pte, seconds = optimum_export(python, job["folder"], flags, job["output"], max_seq_len=scale.CACHE)
    return {"pte": pte, "compile_s": seconds, "llm_ops": "llama"}


def measure(size: str, program: str, folder: str, output: str, steps: int, python: str, timeout: float) -> dict:
    way, scheme = program.split(":")
    job = {"folder": folder, "scheme": scheme, "output": output, "steps": steps}
    row: dict = {"size": size, "way": way, "scheme": scheme}
    made_file = os.path.join(output, "made.json")
    try:
        if os.path.exists(made_file):  # kept from an earlier run (--keep): timed again, not compiled
            with open(made_file) as f:
                made = json.load(f)
        else:
            if way == "ours":
                made, peak = _child("compile", job, timeout)
                made["compile_peak_rss"] = peak
            else:
                made = _optimum(job, python)
            with open(made_file, "w") as f:
                json.dump(made, f)
        row |= made
        row["pte_bytes"] = os.path.getsize(made["pte"])
        timed, peak = _child("time", job | {"pte": made["pte"]}, timeout)
        row |= timed | {"run_peak_rss": peak, "status": "ok"}
        row["step_bytes"] = step_bytes(size, row["pte_bytes"], PROMPT + steps // 2)
        row["bound_s"] = row["step_bytes"] / row["bandwidth"]
    except (RuntimeError, OSError) as exc:
        row |= {"status": "fails", "error": str(exc).splitlines()[0][:300]}
    return row


def render(rows: list[dict]) -> str:
    header = ["size", "program", "scheme", "status", ".pte MB", "bytes a step reads GB", "read bandwidth GB/s",
              "bound ms", "decode step ms (median)", "fastest step ms", "over the bound (median)", "float32 step / this step",
              "greedy tokens as ours float32's", "export s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # The machine's bandwidth is the best any process of the run measured: its reads vary from one
    # process to the next, and a bound from a slow read would flatter the step.
    bandwidth = max((r["bandwidth"] for r in rows if r["status"] == "ok"), default=None)
    for row in rows:
        if row["status"] == "ok":
            row = row | {"bound_s": row["step_bytes"] / bandwidth}
        float_row = next((r for r in rows if r["size"] == row["size"] and r["way"] == row["way"]
                          and r["scheme"] == "float" and r["status"] == "ok"), None)
        ours_float = next((r for r in rows if r["size"] == row["size"] and r["way"] == "ours"
                           and r["scheme"] == "float" and r["status"] == "ok"), None)
        ok = row["status"] == "ok"
        same = (sum(a == b for a, b in zip(row["tokens"], ours_float["tokens"])) if ok and ours_float else None)
        cells = [
            row["size"], "ours" if row["way"] == "ours" else "optimum-executorch", row["scheme"],
            row["status"] if ok else f"{row['status']}: {row.get('error', '')}",
            f"{row['pte_bytes'] / 1e6:.0f}" if row.get("pte_bytes") else "-",
            f"{row['step_bytes'] / GB:.2f}" if ok else "-",
            f"{bandwidth / GB:.1f} ({row['threads']} threads)" if ok else "-",
            f"{row['bound_s'] * 1e3:.1f}" if ok else "-",
            f"{row['step_s'] * 1e3:.1f}" if ok else "-",
            f"{row['step_min_s'] * 1e3:.1f}" if ok else "-",
            f"{row['step_s'] / row['bound_s']:.2f}x" if ok else "-",
            f"{float_row['step_s'] / row['step_s']:.2f}x" if ok and float_row else "-",
            f"{same} of {len(row['tokens'])}" if same is not None else "-",
            f"{row['compile_s']:.0f}" if row.get("compile_s") else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        f"One decode step of the model's `forward` under ExecuTorch's runtime (XNNPACK with the `llama::` SDPA and "
        f"KV-cache ops; the median of the timed steps after {PROMPT} prompt tokens, on {os.cpu_count()} cores). "
        "Bound: the bytes a step reads (the program's file less the float32 embedding table, plus one row of it "
        "and the KV cache so far) over the read bandwidth, the best measured by any of the run's processes (each "
        "measures before it loads its program, with the runtime's thread count). "
        f"Targets: 8da4w at least {TARGET_SPEEDUP:g}x faster a step than float32, and within "
        f"{TARGET_OVER_BOUND:g}x of its bound. Export: the seconds to write the program from the folder "
        "(ours: `compiler.generate`; optimum-executorch: `optimum-cli`, its process).",
    ]
    return "\n".join(lines + notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1b", choices=list(scale.SIZES))
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    parser.add_argument("--optimum-python", default=DEFAULT_PYTHON)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--folders", default=scale.DEFAULT_FOLDERS)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--keep", help="keep the programs in this folder; a program kept there is timed again, "
                        "not compiled again")
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN)
    parser.add_argument("--render", action="store_true", help="write --markdown from --json, measuring nothing")
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    parser.add_argument("--time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile or args.time:
        scale._quiet()
        result = _compile_ours(json.loads(args.compile)) if args.compile else _time(json.loads(args.time))
        print(json.dumps(result), flush=True)
        return
    if args.render:
        with open(args.json) as f, open(args.markdown, "w") as out:
            out.write(render(json.load(f)["rows"]))
        return
    folder = scale.write_folder(args.size, args.folders)
    rows = []
    outputs = args.keep or tempfile.mkdtemp(prefix="decode-")
    for program in args.programs:
        output = os.path.join(outputs, f"{args.size}-{program.replace(':', '-')}")
        os.makedirs(output, exist_ok=True)
        row = measure(args.size, program, folder, output, args.steps, args.optimum_python, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not args.keep:
            shutil.rmtree(output, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows}, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
