"""Compile-time benchmark: stock ExecuTorch vs this driver, same models, one process.

    python -m benchmarks [--quick] [--depths 12 24 48] [--json benchmarks/results/coreml.json]

For each depth of a pre-norm transformer block stack (d=256, 4 heads, seq 64,
batch 1) it compiles for Core ML twice, alternating: stock
(`torch.export` + `to_edge_transform_and_lower(ep, [CoreMLPartitioner()])` +
`to_executorch()`) and ours (`compiler.compile(..., backend="coreml")`), and
prints wall time per stage, total, peak RSS growth, and the ratios ours/stock.
It also times the dry run alone: skipped (the plain float stack) and running
(the same stack fed a uint8 frame, with one bfloat16 block) as a fraction of
the whole compile. With the models extra installed it also compiles the model
suite's 48-layer GPT-2 (`n_embd=128`) both ways. Ratios, not absolute times, are
what to compare: the machines are noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
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
from compiler.examples import Block, Transformer  # noqa: E402

DIM, HEADS, SEQ = 256, 4, 64


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss() -> Iterator[dict]:
    """Samples this process's resident memory while the block runs; reports the growth at its peak."""
    gc.collect()
    result = {"base": _rss_bytes(), "peak": _rss_bytes()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            result["peak"] = max(result["peak"], _rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        result["peak"] = max(result["peak"], _rss_bytes())
        result["growth_mb"] = (result["peak"] - result["base"]) / 2**20


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
        from compiler.model_suite import gpt2 as build
        import transformers  # noqa: F401
    except ImportError:
        return None
    return build(layers=layers)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def stock_compile(model, inputs) -> dict:
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with peak_rss() as memory:
        with torch.no_grad():
            ep, t_export = timed(lambda: torch.export.export(model, inputs))
        edge, t_lower = timed(lambda: to_edge_transform_and_lower(ep, partitioner=[CoreMLPartitioner()]))
        _, t_emit = timed(lambda: edge.to_executorch().buffer)
    stages = {"export": t_export, "to_edge_transform_and_lower": t_lower, "to_executorch": t_emit}
    return {"stages": stages, "total": sum(stages.values()), "rss_growth_mb": memory["growth_mb"]}


def our_compile(model, inputs) -> dict:
    with peak_rss() as memory:
        artifact, total = timed(lambda: compiler.compile(model, inputs, "coreml"))
    stages = {r.stage: r.seconds + r.verify_seconds for r in artifact.report.stages}
    dry_run = artifact.report.stage("dry_run")
    return {
        "stages": stages,
        "total": total,
        "rss_growth_mb": memory["growth_mb"],
        "dry_run_s": dry_run.seconds,
        "dry_run_note": dry_run.metrics.get("skipped") or dry_run.metrics.get("decomposed") or "ran, nothing dropped",
    }


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depth 4 only (a smoke run for CI)")
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    depths = [4] if args.quick else args.depths

    logging.getLogger("coremltools").setLevel(logging.ERROR)
    logging.getLogger("executorch").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # ExecuTorch warns through the root logger
    # Warm-up: imports, registries, coremltools' converter tables.
    our_compile(*stack(1))
    stock_compile(*stack(1))

    results = {"model": {"dim": DIM, "heads": HEADS, "seq": SEQ, "batch": 1}, "depths": {}}
    for depth in depths:
        model, inputs = stack(depth)
        stock = stock_compile(model, inputs)
        ours = our_compile(model, inputs)
        frame_model, frame_inputs = frame_stack(depth)
        running = our_compile(frame_model, frame_inputs)
        results["depths"][depth] = {
            "stock": stock,
            "ours": ours,
            "ratio_total": ours["total"] / stock["total"],
            "ratio_rss": ours["rss_growth_mb"] / max(stock["rss_growth_mb"], 1e-9),
            "dry_run_skipped_s": ours["dry_run_s"],
            "dry_run_running_s": running["dry_run_s"],
            "dry_run_running_fraction": running["dry_run_s"] / running["total"],
            "dry_run_running_note": running["dry_run_note"],
            "frame_stack_total_s": running["total"],
        }
        print(f"depth {depth}: stock {stock['total']:.2f} s, ours {ours['total']:.2f} s", flush=True)

    gpt2_layers = 4 if args.quick else 48
    made = gpt2(gpt2_layers)
    if made is not None:
        stock, ours = stock_compile(*made), our_compile(*made)
        results["gpt2"] = {"layers": gpt2_layers, "stock": stock, "ours": ours, "ratio_total": ours["total"] / stock["total"]}
        print(f"gpt2 ({gpt2_layers} layers): stock {stock['total']:.2f} s, ours {ours['total']:.2f} s", flush=True)

    first, last = min(depths), max(depths)
    if last != first:
        results["scaling_ours"] = results["depths"][last]["ours"]["total"] / results["depths"][first]["ours"]["total"]
        results["scaling_stock"] = (
            results["depths"][last]["stock"]["total"] / results["depths"][first]["stock"]["total"]
        )

    print()
    header = ["depth", "stock s", "ours s", "ours/stock", "stock RSS MB", "ours RSS MB", "RSS ratio",
              "dry run skipped s", "dry run running s", "dry run / compile"]
    rows = []
    for depth, r in results["depths"].items():
        rows.append([
            str(depth), f"{r['stock']['total']:.2f}", f"{r['ours']['total']:.2f}", f"{r['ratio_total']:.2f}",
            f"{r['stock']['rss_growth_mb']:.0f}", f"{r['ours']['rss_growth_mb']:.0f}", f"{r['ratio_rss']:.2f}",
            f"{r['dry_run_skipped_s']:.3f}", f"{r['dry_run_running_s']:.3f}",
            f"{r['dry_run_running_fraction']:.1%}",
        ])
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    print(_row(header, widths))
    print(_row(["-" * w for w in widths], widths))
    for row in rows:
        print(_row(row, widths))
    for depth, r in results["depths"].items():
        stock_stages = ", ".join(f"{k} {v:.2f}" for k, v in r["stock"]["stages"].items())
        our_stages = ", ".join(f"{k} {v:.2f}" for k, v in r["ours"]["stages"].items())
        print(f"\ndepth {depth} stock: {stock_stages}\ndepth {depth} ours:  {our_stages}")
    if "gpt2" in results:
        r = results["gpt2"]
        print(f"\nGPT-2, {r['layers']} layers, n_embd=128: stock {r['stock']['total']:.2f} s, ours "
              f"{r['ours']['total']:.2f} s, ours/stock {r['ratio_total']:.2f}")
    if "scaling_ours" in results:
        print(f"\nt({last})/t({first}): ours {results['scaling_ours']:.2f}, stock {results['scaling_stock']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
