"""Placement against stock: delegates and CPU ops of our programs beside stock's.

    python -m benchmarks.placement [--backends xnnpack coreml mlx] [--models mlp lstm ...]
                                   [--json benchmarks/results/placement.json] [--markdown PATH]

For every example of `compiler.models.examples`, an LSTM (two layers), and every model of
`compiler.models.model_suite` (small sizes; skipped without transformers), on each backend, it
compiles both ways: ours (`compiler.compile`) and stock (`torch.export` +
`to_edge_transform_and_lower(ep, [<backend's partitioner>])` + `to_executorch()`), and
counts in each `.pte` the delegate calls and the CPU kernel calls, and in each lowered
program the ops inside delegates. Both programs are run (`compiler.run`; Core ML payloads in
the MIL interpreter) and compared with eager. Where either fails the error is shown in a word.

Ours should never have more of either unless one of our rules moved an op with a reason:
for each row where ours has more, the reasons our placement plan gave for the CPU ops
stock does not have (or has fewer of) are listed. A row with more and no reason of a rule
(only "does not support" / "refused it", which stock would say too) is marked `CHECK`.

Ours should never place below stock where stock's program is right: a row where stock's
program matches eager and ours fails or calls more CPU kernels is marked `BELOW STOCK`. A rule that keeps an op off a delegate must rest on a failure its
test shows; a row marked so is a rule without one (or a search that lost an op).
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import os
import time
import traceback
import warnings
from typing import Callable

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' progress bars
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

import torch  # noqa: E402

import compiler  # noqa: E402
from compiler.models import examples, model_suite  # noqa: E402
from compiler.stages.emit import pte_calls  # noqa: E402
from benchmarks.compile_time import stock_partitioner  # noqa: E402

BACKENDS = ("xnnpack", "coreml", "mlx")

# Reasons any partitioner gives for what it does not take: not a rule of ours.
_NOT_A_RULE = (
    "does not support",
    "partitioner refused it",
    "but not with these dtypes",
    "out of every delegate",
)


class Lstm(torch.nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 16, num_layers=layers, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def lstm(layers: int = 2, steps: int = 6):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Lstm(layers).eval(), (torch.randn(1, steps, 8),)


# Small sizes: the counts, not the times, are what this measures.
_SUITE_SIZES = {"gpt2": {"layers": 2}}


def models() -> dict[str, Callable]:
    """Name -> factory of (module, inputs): the examples, the LSTM, the suite if installed."""
    found: dict[str, Callable] = dict(examples.EXAMPLES)
    found["lstm"] = lstm
    try:
        import transformers  # noqa: F401
    except ImportError:
        return found
    for name, factory in model_suite.SUITE.items():
        sizes = _SUITE_SIZES.get(name, {})
        found[name] = (lambda f, s: lambda: f(**s))(factory, sizes)
    return found


def delegated_ops(program) -> int:
    """Ops inside the delegates of a lowered Edge program (their original programs' calls)."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    return sum(
        1
        for module in program.graph_module.children()
        if isinstance(module, LoweredBackendModule)
        for node in module.original_module.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem
    )


def counts(pte: bytes, lowered, module, inputs) -> dict:
    """Delegate calls, ops inside delegates, CPU kernel calls, CPU op name -> calls, of a
    `.pte`'s first plan, and whether the program matches eager."""
    calls = pte_calls(pte)
    found = {
        "delegates": calls.delegates,
        "delegated_ops": delegated_ops(lowered),
        "cpu_ops": calls.cpu_calls,
        "ops": dict(calls.cpu_ops),
    }
    try:
        check = compiler.compare_with_eager(pte, module, inputs)
        found["matches_eager"] = check.passed
        found["max_abs_error"] = check.max_abs_error
    except Exception as exc:  # a runtime that cannot run it: not a verdict on the program
        found["run_error"] = _in_a_word(exc)
    return found


def _in_a_word(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:100]}"


def stock(module, inputs, backend: str) -> dict:
    from executorch.exir import to_edge_transform_and_lower

    try:
        ep = torch.export.export(module, inputs)
        edge = to_edge_transform_and_lower(ep, partitioner=[stock_partitioner(backend)])
        lowered = edge.exported_program()
        return counts(edge.to_executorch().buffer, lowered, module, inputs)
    except Exception as exc:
        return {"error": _in_a_word(exc)}


def _kernel_name(op: str) -> str:
    """Our plan's op name (`aten.addmm.default`) as the `.pte` names its kernel (`aten::addmm`)."""
    namespace, rest = op.split(".", 1) if "." in op else ("aten", op)
    return f"{namespace}::{rest.split('.', 1)[0]}"


def ours(module, inputs, backend: str) -> tuple[dict, object]:
    try:
        artifact = compiler.compile(module, inputs, backend)
    except Exception as exc:
        traceback.print_exc()  # to stderr: the table has the error in a word
        return {"error": _in_a_word(exc)}, None
    return counts(artifact.pte, artifact.stages["lower"].program, module, inputs), artifact


def reasons_for_more(mine: dict, theirs: dict, artifact) -> list[str]:
    """Our plan's reasons for the CPU ops we have more of than stock (distinct, in order)."""
    extra = {op for op, n in mine["ops"].items() if n > theirs["ops"].get(op, 0)}
    found: dict[str, None] = {}
    for node in artifact.program.plan.cpu_nodes:
        if _kernel_name(node.op) in extra and node.reason:
            found.setdefault(f"{node.op}: {node.reason}")
    return list(found)


def below_stock(mine: dict, theirs: dict) -> bool:
    """Whether stock's program is right and ours fails or leaves more on the CPU. The ops
    inside delegates are not compared: fold leaves ours fewer ops in all (constant
    subgraphs, rotary tables, masks), so an op stock delegates and ours does not shows as a
    CPU call."""
    if not theirs.get("matches_eager"):
        return False
    return "error" in mine or mine["cpu_ops"] > theirs["cpu_ops"]


def is_rule(reason: str) -> bool:
    return not any(words in reason.split(": ", 1)[-1] for words in _NOT_A_RULE)


def measure(name: str, factory: Callable, backend: str) -> dict:
    start = time.perf_counter()
    module, inputs = factory()[:2]
    mine, artifact = ours(module, inputs, backend)
    module, inputs = factory()[:2]  # a fresh module: compiling must not have touched it, but stock gets its own
    theirs = stock(module, inputs, backend)
    row = {"model": name, "backend": backend, "ours": mine, "stock": theirs, "seconds": time.perf_counter() - start}
    row["below_stock"] = below_stock(mine, theirs)
    if "error" in mine or "error" in theirs:
        return row
    more = mine["delegates"] > theirs["delegates"] or mine["cpu_ops"] > theirs["cpu_ops"]
    row["more_than_stock"] = more
    if more:
        row["reasons"] = reasons_for_more(mine, theirs, artifact)
        row["explained"] = bool(row["reasons"]) and all(is_rule(r) for r in row["reasons"])
    return row


def _pair(row: dict, key: str) -> str:
    mine, theirs = row["ours"], row["stock"]
    left = "fails" if "error" in mine else str(mine[key])
    right = "fails" if "error" in theirs else str(theirs[key])
    return f"{left} / {right}"


def _eager(side: dict) -> str:
    if "error" in side:
        return "-"
    if "run_error" in side:
        return "cannot run"
    return "yes" if side["matches_eager"] else f"NO ({side['max_abs_error']:.2g})"


def _note(row: dict) -> str:
    notes = ["BELOW STOCK"] if row.get("below_stock") else []
    notes += [f"{side} fails: {row[side]['error']}" for side in ("ours", "stock") if "error" in row[side]]
    notes += [f"{side} cannot run: {row[side]['run_error']}" for side in ("ours", "stock") if "run_error" in row[side]]
    if row.get("more_than_stock"):
        if not row["explained"]:
            notes.append("CHECK: more than stock without a rule's reason")
        notes += row["reasons"]
    return "; ".join(notes).replace("|", "\\|")


def table(rows: list[dict]) -> str:
    lines = [
        "| model | backend | delegates ours / stock | delegated ops ours / stock | CPU ops ours / stock "
        "| matches eager ours / stock | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['model']}` | {row['backend']} | {_pair(row, 'delegates')} | {_pair(row, 'delegated_ops')} "
            f"| {_pair(row, 'cpu_ops')} | {_eager(row['ours'])} / {_eager(row['stock'])} | {_note(row)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    available = models()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--models", nargs="+", choices=list(available), default=list(available))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here (default: beside --json, as .md)")
    args = parser.parse_args(argv)
    if args.json and not args.markdown:
        args.markdown = os.path.splitext(args.json)[0] + ".md"
    logging.getLogger().setLevel(logging.ERROR)
    rows = []
    for name in args.models:
        for backend in args.backends:
            row = measure(name, available[name], backend)
            rows.append(row)
            print(
                f"{name:22} {backend:8} delegates {_pair(row, 'delegates'):9} delegated "
                f"{_pair(row, 'delegated_ops'):9} cpu ops {_pair(row, 'cpu_ops'):9} "
                f"({row['seconds']:.1f} s) {_note(row)[:160]}",
                flush=True,
            )
    text = table(rows)
    print()
    print(text)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write("# Placement: ours against stock\n\n")
            f.write(f"`python -m benchmarks.placement` (torch {torch.__version__}). ")
            f.write(
                "Counts are delegate calls and CPU kernel calls in the `.pte`, and the ops inside "
                "delegates in the lowered program; both programs are run and compared with eager "
                "(Core ML payloads in the MIL interpreter).\n\n"
            )
            f.write(text + "\n")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
