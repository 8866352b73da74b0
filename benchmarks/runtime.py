"""Run time against stock: our program and stock's of the same model, under ExecuTorch's runtime.

    python -m benchmarks.runtime [--models transformer_stack convnet mlp gpt2 siglip qwen3]
                                 [--backends portable xnnpack] [--seconds 6]
                                 [--model path.py:factory ...] [--pte NAME=OURS.pte,STOCK.pte ...]
                                 [--json benchmarks/results/runtime.json] [--markdown PATH] [--doc docs/benchmarks.md]
                                 [--rewrite]  (no measuring: the table and --doc from --json)

For each model and backend it builds two `.pte`s: ours (`compiler.compile`) and stock's
(`torch.export` + `to_edge_transform_and_lower(ep, [XnnpackPartitioner()])`, no partitioner for
portable, + `to_executorch()`), as `benchmarks/placement.py` does. Both are loaded by ExecuTorch's
runtime here with event tracing on (`Runtime.get().load_program(pte, enable_etdump=True)`), run
alternately in one process (ours, stock, stock, ours, ...: the two cores are shared and noisy, so
each pair of runs sees the same machine), and each program's ETDump is read by
`executorch.devtools.Inspector`. Per program: the median of `Method::execute` (ms, the runtime's
own clock), the delegate calls per run (`DELEGATE_CALL` events), and the share of each run spent in
CPU kernels (its `OPERATOR_CALL` events over its `Method::execute`), with the CPU ops that take the
most (their `native_call_*` events). The ratio is the median over runs of ours / stock of the same
pair. Wall-clock medians (`Method.execute` from Python, tracing on) are in the JSON too.

`--model path.py:factory` (or `name:key=value` of a built-in example, the CLI's MODEL form) adds a
model of your own; `--pte NAME=OURS.pte,STOCK.pte` measures two programs you built, fed random
inputs of the sizes their first method declares. Ratios, not absolute times, are what to compare.

ExecuTorch's threadpool (used by XNNPACK and by the portable library's parallel kernels) runs one
thread unless `--threads N`: on 2 cores shared with other work, with two threads Qwen3's portable
`mm`, well under a millisecond, took 230 ms a call in whole stretches of a run (both programs
alike; a kernel split over two threads waits for a worker the scheduler has not run, we think);
with one thread it has not happened here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

BACKENDS = ("portable", "xnnpack")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_SECTION = "runtime-table"
TOP_OPS = 5


def stack(depth: int = 4):
    """The compile-time benchmark's transformer stack (d=256, 4 heads, seq 64) at a small depth."""
    from compiler.models.examples import Transformer

    dim, heads, seq = 256, 4, 64
    torch.manual_seed(0)
    return Transformer(depth, dim, heads).eval(), (torch.randn(1, seq, dim),)


def _suite(name: str, **sizes) -> Callable:
    def build():
        from compiler.models import model_suite

        return model_suite.SUITE[name](**sizes)

    return build


def _example(name: str) -> Callable:
    def build():
        from compiler.models import examples

        return examples.EXAMPLES[name]()

    return build


# Name -> factory of (module, inputs[, dynamic_shapes]); the suite's need transformers.
MODELS: dict[str, Callable] = {
    "transformer_stack": stack,
    "convnet": _example("convnet"),
    "mlp": _example("mlp"),
    "gpt2": _suite("gpt2", layers=4),
    "siglip": _suite("siglip"),
    "qwen3": _suite("qwen3"),
}
SUITE_MODELS = ("gpt2", "siglip", "qwen3")


def _in_a_word(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:100]}"


def stock_pte(module, inputs, backend: str, dynamic_shapes=None) -> bytes:
    from executorch.exir import to_edge_transform_and_lower

    ep = torch.export.export(module, tuple(inputs), dynamic_shapes=dynamic_shapes)
    partitioner = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    return to_edge_transform_and_lower(ep, partitioner=partitioner).to_executorch().buffer


def our_pte(module, inputs, backend: str, dynamic_shapes=None) -> bytes:
    import compiler

    kwargs = {"dynamic_shapes": dynamic_shapes} if dynamic_shapes is not None else {}
    return compiler.compile(module, tuple(inputs), backend, **kwargs).pte


class Traced:
    """One `.pte` loaded by ExecuTorch's runtime with ETDump on; runs its `forward`."""

    def __init__(self, pte: bytes, method: str = "forward") -> None:
        from executorch.runtime import Runtime

        from compiler.ir.kernels import load_llm_kernels, load_quantized_kernels
        from compiler.process.dependency_output import DependencyOutput

        load_quantized_kernels()
        load_llm_kernels()
        with DependencyOutput():  # cpuinfo's talk as XNNPACK initializes
            self.program = Runtime.get().load_program(pte, enable_etdump=True, debug_buffer_size=0)
            self.method = self.program.load_method(method)
        self.wall: list[float] = []

    def __call__(self, inputs: Sequence[Any]) -> Sequence[Any]:
        start = time.perf_counter()
        outputs = self.method.execute(inputs)
        self.wall.append((time.perf_counter() - start) * 1e3)
        return outputs

    def events(self, folder: str, name: str):
        """The Inspector's `Execute` events of this program's ETDump."""
        from executorch.devtools import Inspector

        path = os.path.join(folder, f"{name}.etdp")
        self.program.write_etdump_result_to_file(path, os.path.join(folder, f"{name}.bin"))
        with warnings.catch_warnings():  # "Output Buffer not found": no tensors are logged, only times
            warnings.simplefilter("ignore")
            inspector = Inspector(etdump_path=path)
        return [event for block in inspector.event_blocks if block.name == "Execute" for event in block.events]


def random_inputs(pte: bytes, method: str = "forward") -> list[torch.Tensor]:
    """Inputs of the sizes and dtypes `method` declares: normal floats, zero integers."""
    from executorch.runtime import Runtime

    from compiler.running.reference import TORCH_DTYPES

    meta = Runtime.get().load_program(pte).metadata(method)
    found = []
    generator = torch.Generator().manual_seed(0)
    for index in range(meta.num_inputs()):
        info = meta.input_tensor_meta(index)
        dtype = TORCH_DTYPES.get(info.dtype(), torch.float32)
        sizes = tuple(info.sizes())
        if dtype.is_floating_point:
            found.append(torch.randn(sizes, generator=generator).to(dtype))
        else:
            found.append(torch.zeros(sizes, dtype=dtype))
    return found


def summarize(events, warmup: int) -> dict:
    """Per-run latency, delegate calls, CPU share and the CPU ops by time, from one program's events."""

    def runs(event) -> list[float]:
        return list(event.perf_data.raw[warmup:]) if event.perf_data is not None else []

    execute = next(e for e in events if e.name == "Method::execute")
    total = runs(execute)
    operator_calls = [runs(e) for e in events if e.name == "OPERATOR_CALL"]
    delegate_calls = [runs(e) for e in events if e.name == "DELEGATE_CALL"]
    cpu = [sum(call[i] for call in operator_calls) for i in range(len(total))]
    in_delegates = [sum(call[i] for call in delegate_calls) for i in range(len(total))]
    ops: dict[str, float] = {}
    for event in events:
        if event.name.startswith("native_call_") and event.perf_data is not None:
            op = event.name[len("native_call_"):]
            ops[op] = ops.get(op, 0.0) + statistics.median(runs(event))
    top = sorted(ops.items(), key=lambda item: -item[1])[:TOP_OPS]
    return {
        "runs": len(total),
        "median_ms": statistics.median(total),
        "delegate_calls": len(delegate_calls),
        "cpu_kernel_calls": len(operator_calls),
        "cpu_share": statistics.median(c / t for c, t in zip(cpu, total) if t > 0),
        "delegate_share": statistics.median(d / t for d, t in zip(in_delegates, total) if t > 0),
        "top_cpu_ops": [{"op": op, "median_ms": ms} for op, ms in top],
        "_per_run": total,
    }


def measure_pair(ours: bytes, stock: bytes, inputs: Sequence[Any], seconds: float = 4.0,
                 warmup: int = 5, min_runs: int = 20, max_runs: int = 300) -> dict:
    """Both programs run alternately with event tracing; each one's summary and the median ratio."""
    leaves = [leaf for leaf in pytree.tree_leaves(tuple(inputs))]
    programs = {"ours": Traced(ours), "stock": Traced(stock)}
    outputs = {}
    for _ in range(warmup):
        for side, program in programs.items():
            outputs[side] = program(leaves)
    outputs = {side: [t.clone() if isinstance(t, torch.Tensor) else t for t in out] for side, out in outputs.items()}
    one_pair = (statistics.median(programs["ours"].wall) + statistics.median(programs["stock"].wall)) / 1e3
    count = int(min(max_runs, max(min_runs, seconds / max(one_pair, 1e-6))))
    for i in range(count):
        order = ("ours", "stock") if i % 2 == 0 else ("stock", "ours")
        for side in order:
            programs[side](leaves)
    with tempfile.TemporaryDirectory() as folder:
        row = {side: summarize(program.events(folder, side), warmup) for side, program in programs.items()}
    for side, program in programs.items():
        row[side]["wall_median_ms"] = statistics.median(program.wall[warmup:])
    mine, theirs = row["ours"].pop("_per_run"), row["stock"].pop("_per_run")
    row["ratio"] = statistics.median(a / b for a, b in zip(mine, theirs) if b > 0)
    row["ratio_of_medians"] = row["ours"]["median_ms"] / row["stock"]["median_ms"]
    row["wall_ratio"] = statistics.median(
        a / b for a, b in zip(programs["ours"].wall[warmup:], programs["stock"].wall[warmup:]) if b > 0
    )
    row["max_abs_difference"] = max(
        (float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
         for a, b in zip(outputs["ours"], outputs["stock"])
         if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape),
        default=0.0,
    )
    return row


def set_threads(count: int) -> None:
    from executorch.extension.pybindings import portable_lib

    from compiler.process.dependency_output import DependencyOutput

    with DependencyOutput():  # "Resetting threadpool to N threads."
        portable_lib._unsafe_reset_threadpool(count)


def threads() -> int:
    from executorch.extension.pybindings import portable_lib

    return portable_lib._threadpool_get_thread_count()


def measure_model(name: str, factory: Callable, backend: str, seconds: float) -> dict:
    start = time.perf_counter()
    row: dict = {"model": name, "backend": backend}
    try:
        module, inputs, *rest = factory()
        dynamic = rest[0] if rest else None
        ours = our_pte(module, inputs, backend, dynamic)
        module, inputs, *rest = factory()  # stock gets a fresh module
        theirs = stock_pte(module, inputs, backend, dynamic)
        row |= measure_pair(ours, theirs, inputs, seconds)
    except Exception as exc:
        row["error"] = _in_a_word(exc)
    row["seconds"] = time.perf_counter() - start
    return row


def measure_files(name: str, ours_path: str, stock_path: str, seconds: float) -> dict:
    row: dict = {"model": name, "backend": "given"}
    try:
        with open(ours_path, "rb") as f:
            ours = f.read()
        with open(stock_path, "rb") as f:
            theirs = f.read()
        row |= measure_pair(ours, theirs, random_inputs(ours), seconds)
    except Exception as exc:
        row["error"] = _in_a_word(exc)
    return row


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _ops(side: dict) -> str:
    return ", ".join(f"{o['op'].removesuffix('.out')} {_ms(o['median_ms'])}" for o in side["top_cpu_ops"][:3]) or "-"


COLUMNS = (
    "model", "backend", "ms ours / stock", "ratio", "delegate calls ours / stock",
    "CPU share ours / stock", "top CPU ops, ours (ms)",
)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if "error" in row:
            lines.append(f"| `{row['model']}` | {row['backend']} | fails: {row['error'].replace('|', '/')} | | | | |")
            continue
        mine, theirs = row["ours"], row["stock"]
        lines.append(
            f"| `{row['model']}` | {row['backend']} | {_ms(mine['median_ms'])} / {_ms(theirs['median_ms'])} "
            f"| {row['ratio']:.2f}x | {mine['delegate_calls']} / {theirs['delegate_calls']} "
            f"| {mine['cpu_share']:.0%} / {theirs['cpu_share']:.0%} | {_ops(mine)} |"
        )
    return "\n".join(lines)


def doc_text(rows: list[dict]) -> str:
    """The docs' section: the table and how it was measured, in a line."""
    return (
        "Medians of `Method::execute` from each program's ETDump (ExecuTorch's runtime here, "
        "event tracing on, ours and stock's run alternately; ratio = median of ours / stock per pair "
        "of runs); delegate calls and the CPU share (time in `OPERATOR_CALL` events over the run) "
        "per run. From `benchmarks/results/runtime.json`.\n\n" + table(rows)
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--model", action="append", default=[], metavar="MODEL",
                        help="path.py:factory or name:key=value (the CLI's MODEL form); repeatable")
    parser.add_argument("--pte", action="append", default=[], metavar="NAME=OURS.pte,STOCK.pte",
                        help="two programs you built, run on random inputs; repeatable")
    parser.add_argument("--threads", type=int, default=1,
                        help="ExecuTorch's threadpool size (0: leave it); 1 by default, see the module's docstring")
    parser.add_argument("--seconds", type=float, default=6.0, help="time per row's alternating runs")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "runtime.json"))
    parser.add_argument("--markdown", help="the table (default: beside --json, as .md)")
    parser.add_argument("--rewrite", action="store_true", help="measure nothing: rewrite the table and --doc from --json")
    parser.add_argument("--doc", help="rewrite the runtime-table section of this file (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    args.markdown = args.markdown or os.path.splitext(args.json)[0] + ".md"
    logging.getLogger().setLevel(logging.ERROR)

    todo: list[tuple[str, Callable]] = []
    try:
        import transformers  # noqa: F401
        have_suite = True
    except ImportError:
        have_suite = False
    for name in args.models:
        if name in SUITE_MODELS and not have_suite:
            print(f"{name}: skipped (needs transformers, the models extra)")
            continue
        todo.append((name, MODELS[name]))
    for spec in args.model:
        from compiler.models.examples import resolve_model

        todo.append((spec, (lambda s: lambda: resolve_model(s))(spec)))

    if args.rewrite:
        with open(args.json) as f:
            rows = json.load(f)["rows"]
        write_tables(rows, args.markdown, args.doc)
        return rows
    if args.threads > 0:
        set_threads(args.threads)
    rows = []
    for name, factory in todo:
        for backend in args.backends:
            row = measure_model(name, factory, backend, args.seconds)
            rows.append(row)
            print(table([row]).splitlines()[-1], f"({row['seconds']:.0f} s)", flush=True)
    for given in args.pte:
        name, _, paths = given.partition("=")
        ours_path, _, stock_path = paths.partition(",")
        rows.append(measure_files(name, ours_path, stock_path, args.seconds))
        print(table([rows[-1]]).splitlines()[-1], flush=True)

    print()
    print(table(rows))
    import executorch

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "executorch": getattr(executorch, "__version__", None),
                   "threads": threads(), "rows": rows}, f, indent=2)
    write_tables(rows, args.markdown, args.doc)
    return rows


def write_tables(rows: list[dict], markdown: str, doc: str | None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(markdown)), exist_ok=True)
    with open(markdown, "w") as f:
        f.write("# Run time: ours against stock\n\n")
        f.write(f"`python -m benchmarks.runtime` (torch {torch.__version__}). ")
        f.write(doc_text(rows) + "\n")
    if doc:
        from compiler.tools import readme

        readme.write_file(doc, DOC_SECTION, doc_text(rows))


if __name__ == "__main__":
    main()
