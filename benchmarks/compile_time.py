"""Compile-time benchmark: stock ExecuTorch vs this driver, same models, one process.

    python -m benchmarks [--quick] [--backends coreml xnnpack mlx] [--depths 12 24 48] [--runs 3]
                         [--json benchmarks/results/compile_time.json] [--markdown benchmarks/results/compile_time.md]

For each backend and each depth of a pre-norm transformer block stack (d=256, 4 heads,
seq 64, batch 1) it compiles `--runs` times each way, alternating: stock (`torch.export`
+ `to_edge_transform_and_lower(ep, [<backend's partitioner>])` + `to_executorch()`) and
ours (`compiler.compile(..., backend=...)`, each timed as a process's first compile: the node
decompositions earlier compiles made are forgotten). It reports the median of each: wall time per
stage and in all, the ratio ours/stock, and the delegates and CPU kernel calls of both
programs; and the peak growth of heap in use (malloc's, from `mallinfo2`) and of
resident memory during one more compile each way, each in a fresh process after a
warm-up (in one process, what earlier compiles left in the allocator's caches blurs
it; resident memory also depends on which freed pages the allocator keeps, so heap
in use is what the ratio compares). Where stock cannot lower the stack, ours is timed alone and stock's error
is shown.

It also times the dry run: skipped (the plain stack) and running (the same stack fed a
uint8 frame, with one bfloat16 block, where rules move kept ops to the CPU), and what the
running one adds to that compile (its time less the decomposition it hands on to the
decompose stage) as a fraction of the compile. With the models extra installed it compiles the model suite's
48-layer GPT-2 (`n_embd=128`) for Core ML both ways. Ratios, not absolute times, are
what to compare: the machines are noisy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import multiprocessing
import os
import statistics
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import compiler  # noqa: E402
from compiler.models.examples import Block, Transformer  # noqa: E402
from compiler.passes import node_decompositions  # noqa: E402
from compiler.stages.emit import pte_calls  # noqa: E402

DIM, HEADS, SEQ = 256, 4, 64
BACKENDS = ("coreml", "xnnpack", "mlx")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not had back (all arenas, and mmapped blocks), from
    glibc's `mallinfo2`: unlike resident memory, it does not depend on which freed pages
    the allocator happens to keep."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallocInfo
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@contextmanager
def peak_memory() -> Iterator[dict]:
    """Samples this process's heap in use and resident memory while the block runs; reports
    the growth of each at its peak (MB)."""
    gc.collect()
    base = {"heap": _heap_bytes(), "rss": _rss_bytes()}
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while True:
            peak["heap"] = max(peak["heap"], _heap_bytes())
            peak["rss"] = max(peak["rss"], _rss_bytes())
            if done.wait(0.003):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result: dict = {}
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        result["heap_growth_mb"] = (peak["heap"] - base["heap"]) / 2**20
        result["rss_growth_mb"] = (peak["rss"] - base["rss"]) / 2**20


class FrameStack(nn.Module):
    """The same stack fed a uint8 camera frame, with one block in bfloat16: rules move kept ops to the CPU."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.stack = Transformer(depth, DIM, HEADS)
        self.bf16_block = Block(DIM, HEADS).to(torch.bfloat16)

    def forward(self, frame):
        x = frame.float() / 255.0
        x = self.bf16_block(x.to(torch.bfloat16)).float()
        return self.stack(x)


def stack(depth: int):
    torch.manual_seed(0)
    return Transformer(depth, DIM, HEADS).eval(), (torch.randn(1, SEQ, DIM),)


def frame_stack(depth: int):
    torch.manual_seed(0)
    return FrameStack(depth).eval(), (torch.randint(0, 255, (1, SEQ, DIM), dtype=torch.uint8),)


def gpt2(layers: int):
    """The model suite's GPT-2, or None without the models extra."""
    try:
        from compiler.models.model_suite import gpt2 as build
        import transformers  # noqa: F401
    except ImportError:
        return None
    return build(layers=layers)


def stock_partitioner(backend: str):
    if backend == "coreml":
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        return CoreMLPartitioner()
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return XnnpackPartitioner()
    from executorch.backends.mlx.partitioner import MLXPartitioner

    return MLXPartitioner()


def placement_counts(pte: bytes) -> dict:
    """Delegate calls and CPU kernel calls in a `.pte`'s plan, read the same way for both."""
    calls = pte_calls(pte)
    return {"delegates": calls.delegates, "cpu_ops": calls.cpu_calls}


def counted(numbers: dict, pte: bytes) -> dict:
    return numbers | placement_counts(pte)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _quiet() -> None:
    """Stock's dependencies log as they work (ExecuTorch through the root logger too)."""
    for name in ("coremltools", "executorch", ""):
        logging.getLogger(name).setLevel(logging.ERROR)


def _peak_growth(backend: str, way: str, model_name: str, size: int, answer) -> None:
    """In a fresh child process: warm up, then one compile; sends its peak memory growth (MB)."""
    _quiet()
    build = {"stack": stack, "gpt2": gpt2}[model_name]
    compile_once = stock_compile if way == "stock" else our_compile
    compile_once(*stack(1), backend)
    with peak_memory() as memory:
        compile_once(*build(size), backend)  # the .pte is read (placement counts) after the window
    answer.send(memory)


def peak_growth_in_child(backend: str, way: str, model_name: str, size: int) -> dict:
    """Peak growth (MB) of heap in use and of resident memory during one compile, in a fresh
    (spawned) process: in this one, what earlier compiles left in the allocator's caches
    hides or inflates it."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_peak_growth, args=(backend, way, model_name, size, send))
    child.start()
    while child.is_alive() and not receive.poll(1):
        pass
    nan = float("nan")  # the child failed
    growth = receive.recv() if receive.poll() else {"heap_growth_mb": nan, "rss_growth_mb": nan}
    child.join()
    return growth


def stock_compile(model, inputs, backend: str) -> tuple[dict, bytes]:
    """Stock's compile, timed stage by stage; its numbers and its `.pte`."""
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        ep, t_export = timed(lambda: torch.export.export(model, inputs))
    edge, t_lower = timed(lambda: to_edge_transform_and_lower(ep, partitioner=[stock_partitioner(backend)]))
    pte, t_emit = timed(lambda: edge.to_executorch().buffer)
    stages = {"export": t_export, "to_edge_transform_and_lower": t_lower, "to_executorch": t_emit}
    return {"stages": stages, "total": sum(stages.values())}, pte


def our_compile(model, inputs, backend: str) -> tuple[dict, bytes]:
    """Our compile, timed stage by stage; its numbers and its `.pte`. Timed as a process's first
    compile of these widths: the node decompositions earlier compiles made are forgotten."""
    node_decompositions.forget_recipes()
    # precision "model": the bfloat16 block stays bfloat16, as stock compiles it (auto would make
    # it float32, another program than stock's).
    artifact, total = timed(lambda: compiler.compile(model, inputs, backend, precision="model"))
    stages = {r.stage: r.seconds + r.verify_seconds for r in artifact.report.stages}
    dry_run = artifact.report.stage("dry_run")
    return {
        "stages": stages,
        "total": total,
        "dry_run_s": dry_run.seconds,
        # What the dry run adds: its time less the decomposition and the partition search it
        # handed on to the decompose and partition stages.
        "dry_run_added_s": dry_run.seconds - dry_run.metrics.get("decomposition_handed_on_s", 0.0)
        - dry_run.metrics.get("search_handed_on_s", 0.0),
        "dry_run_note": dry_run.metrics.get("skipped") or dry_run.metrics.get("decomposed") or "ran, nothing dropped",
    }, artifact.pte


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def median_of(runs: list[dict]) -> dict:
    """The median of each number over the runs (stage by stage); the words of the first run."""
    first = runs[0]
    out = {k: v for k, v in first.items() if not isinstance(v, (int, float, dict))}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
    out["totals"] = [r["total"] for r in runs]
    return out


def compare(model_name: str, size: int, backend: str, runs: int) -> dict:
    """`runs` alternating compiles each way; stock's error instead of its numbers where it fails."""
    build = {"stack": stack, "gpt2": gpt2}[model_name]
    stock_runs, our_runs, stock_error = [], [], None
    for _ in range(runs):
        if stock_error is None:
            try:
                stock_runs.append(counted(*stock_compile(*build(size), backend)))
            except Exception as exc:  # stock's own failure is a result, not a crash of the benchmark
                stock_error = _error(exc)
        our_runs.append(counted(*our_compile(*build(size), backend)))
    ours = median_of(our_runs)
    ours |= peak_growth_in_child(backend, "ours", model_name, size)
    result = {"ours": ours}
    if stock_error:
        result["stock_error"] = stock_error
    else:
        stock = median_of(stock_runs)
        stock |= peak_growth_in_child(backend, "stock", model_name, size)
        result |= {
            "stock": stock,
            "ratio_total": ours["total"] / stock["total"],
            "ratio_heap": ours["heap_growth_mb"] / max(stock["heap_growth_mb"], 1e-9),
        }
    return result


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return [_row(header, widths), _row(["-" * w for w in widths], widths), *(_row(r, widths) for r in rows)]


def render(results: dict) -> str:
    lines = []
    for backend, per_backend in results["backends"].items():
        lines += [f"## {backend}", ""]
        header = ["depth", "stock s", "ours s", "ours/stock", "heap MB stock/ours", "heap ratio", "RSS MB stock/ours",
                  "delegates stock/ours", "CPU ops stock/ours", "dry run skipped s", "dry run running s",
                  "of which added s", "added / compile"]
        rows = []
        for depth, r in per_backend["depths"].items():
            ours, stock = r["ours"], r.get("stock")
            rows.append([
                str(depth),
                f"{stock['total']:.2f}" if stock else "failed",
                f"{ours['total']:.2f}",
                f"{r['ratio_total']:.2f}" if stock else "-",
                f"{stock['heap_growth_mb']:.0f}/{ours['heap_growth_mb']:.0f}" if stock else f"-/{ours['heap_growth_mb']:.0f}",
                f"{r['ratio_heap']:.2f}" if stock else "-",
                f"{stock['rss_growth_mb']:.0f}/{ours['rss_growth_mb']:.0f}" if stock else f"-/{ours['rss_growth_mb']:.0f}",
                f"{stock['delegates']:.0f}/{ours['delegates']:.0f}" if stock else f"-/{ours['delegates']:.0f}",
                f"{stock['cpu_ops']:.0f}/{ours['cpu_ops']:.0f}" if stock else f"-/{ours['cpu_ops']:.0f}",
                f"{r['dry_run_skipped_s']:.3f}",
                f"{r['dry_run_running_s']:.3f}",
                f"{r['dry_run_running_added_s']:.3f}",
                f"{r['dry_run_running_fraction']:.1%}",
            ])
        if rows:
            lines += ["```", *_table(header, rows), "```", ""]
        for depth, r in per_backend["depths"].items():
            if "stock_error" in r:
                lines.append(f"depth {depth} stock failed: {r['stock_error']}")
            else:
                lines.append(f"depth {depth} stock: " + ", ".join(f"{k} {v:.2f}" for k, v in r["stock"]["stages"].items()))
            lines.append(f"depth {depth} ours:  " + ", ".join(f"{k} {v:.2f}" for k, v in r["ours"]["stages"].items()))
            lines.append(f"depth {depth} dry run when it runs: {r['dry_run_running_note']}")
            lines.append("")
        if "scaling_ours" in per_backend:
            scaling = f"t({per_backend['last']})/t({per_backend['first']}): ours {per_backend['scaling_ours']:.2f}"
            if "scaling_stock" in per_backend:
                scaling += f", stock {per_backend['scaling_stock']:.2f}"
            lines += [scaling, ""]
        if "gpt2" in per_backend:
            r = per_backend["gpt2"]
            stock = f"stock {r['stock']['total']:.2f} s" if "stock" in r else f"stock failed ({r['stock_error']})"
            line = f"GPT-2 (model suite), {r['layers']} layers, n_embd=128: {stock}, ours {r['ours']['total']:.2f} s"
            if "stock" in r:
                line += (
                    f", ours/stock {r['ratio_total']:.2f}; heap MB stock/ours "
                    f"{r['stock']['heap_growth_mb']:.0f}/{r['ours']['heap_growth_mb']:.0f} ({r['ratio_heap']:.2f})"
                )
            lines += [line, ""]
            if "stock" in r:
                lines.append("GPT-2 stock: " + ", ".join(f"{k} {v:.2f}" for k, v in r["stock"]["stages"].items()))
            lines += ["GPT-2 ours:  " + ", ".join(f"{k} {v:.2f}" for k, v in r["ours"]["stages"].items()), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depth 4, one run, Core ML only (a smoke run for CI)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--runs", type=int, default=3, help="compiles each way per depth; the median is reported")
    parser.add_argument("--no-gpt2", action="store_true", help="leave out the model suite's GPT-2")
    parser.add_argument("--gpt2-layers", type=int, default=48, help="GPT-2's depth (each backend benchmarked)")
    parser.add_argument("--no-stacks", action="store_true", help="only GPT-2: leave out the transformer stacks")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args()
    depths, runs, backends = ([4], 1, ["coreml"]) if args.quick else (args.depths, args.runs, args.backends)

    _quiet()

    results = {"model": {"dim": DIM, "heads": HEADS, "seq": SEQ, "batch": 1}, "runs": runs, "backends": {}}
    for backend in backends:
        our_compile(*stack(1), backend)  # warm-up: imports, registries, converter tables
        stock_compile(*stack(1), backend)
        per_backend = {"depths": {}}
        for depth in [] if args.no_stacks else depths:
            result = compare("stack", depth, backend, runs)
            running, _ = our_compile(*frame_stack(depth), backend)
            result |= {
                "dry_run_skipped_s": result["ours"]["dry_run_s"],
                "dry_run_running_s": running["dry_run_s"],
                "dry_run_running_added_s": running["dry_run_added_s"],
                "dry_run_running_fraction": running["dry_run_added_s"] / running["total"],
                "dry_run_running_note": running["dry_run_note"],
                "frame_stack_total_s": running["total"],
            }
            per_backend["depths"][depth] = result
            stock = f"{result['stock']['total']:.2f} s" if "stock" in result else "failed"
            print(f"{backend} depth {depth}: stock {stock}, ours {result['ours']['total']:.2f} s", flush=True)
        first, last = min(depths), max(depths)
        if last != first and not args.no_stacks:
            at = per_backend["depths"]
            per_backend |= {"first": first, "last": last, "scaling_ours": at[last]["ours"]["total"] / at[first]["ours"]["total"]}
            if "stock" in at[first] and "stock" in at[last]:
                per_backend["scaling_stock"] = at[last]["stock"]["total"] / at[first]["stock"]["total"]
        if not args.no_gpt2 and gpt2(1) is not None:
            layers = 4 if args.quick else args.gpt2_layers
            per_backend["gpt2"] = {"layers": layers, **compare("gpt2", layers, backend, runs)}
            print(f"{backend} gpt2 {layers}: ours {per_backend['gpt2']['ours']['total']:.2f} s", flush=True)
        results["backends"][backend] = per_backend

    text = render(results)
    print("\n" + text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                "# Compile-time benchmark: stock ExecuTorch vs ours\n\n"
                f"This machine: {os.cpu_count()} cores, torch {torch.__version__}; medians of {runs} alternating runs "
                "in one process.\n\n"
                "Command: `python -m benchmarks --json benchmarks/results/compile_time.json "
                "--markdown benchmarks/results/compile_time.md`\n\n" + text
            )


if __name__ == "__main__":
    main()
