"""The node-level check (`compiler.check_nodes`) on real faults and on programs with none.

    python -m benchmarks.node_check [--faults] [--suite] [--only TEXT ...] [--markdown FILE]

Faults: every case of `benchmarks/locate_faults.py` (a fix switched off), as it is and behind a
softmax, a sigmoid and a max of its outputs (which squash the difference below the outputs'
tolerance): the output check's verdict, and whether the node check fails and names the fix's
node. A case whose fault the squashing op removes (the fix then changes no byte of the program:
an output aliasing an input, read by a softmax, is no longer an output) is said so.

No false alarms: every model of the transformers suite (`compiler.models.model_suite`) on every
backend, each at its default options (Core ML computing in float16, then checked again in
float32): the node check must pass.

Writes `benchmarks/results/node_check.md`. (The fuzz campaign's programs: `python -m compiler
fuzz --check-nodes`; the seed systems: their kit, with `compiler.check_nodes` on each compile.)
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks import locate_faults  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DEFAULT_MARKDOWN = os.path.join(RESULTS, "node_check.md")
SUITE_BACKENDS = ("portable", "xnnpack", "coreml", "mlx")


def _softmax(t: torch.Tensor) -> torch.Tensor:
    return torch.softmax(t * 0.01, -1)


def _sigmoid(t: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(t * 0.01 + 8)  # deep in the flat region: 1 - 3e-4


def _max(t: torch.Tensor) -> torch.Tensor:
    return t.amax(-1)


# How a fault is hidden: nothing, or a squashing op reading each output (integers as floats).
BEHIND = {"nothing": None, "softmax": _softmax, "sigmoid": _sigmoid, "max": _max}


class Behind(nn.Module):
    """The case's model with `squash` applied to each of its outputs."""

    def __init__(self, model: nn.Module, squash) -> None:
        super().__init__()
        self.model, self.squash = model, squash

    def forward(self, *inputs):
        out = self.model(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        squashed = tuple(self.squash(o if o.is_floating_point() else o.float()) for o in outs)
        return squashed if isinstance(out, tuple) else squashed[0]


def fault_row(case: locate_faults.Case, behind: str) -> dict:
    import compiler
    from compiler.running.runtime import compare_with_eager

    model, inputs = case.build()
    if BEHIND[behind] is not None:
        model = Behind(model, BEHIND[behind]).eval()
    options = dict(backend_options=case.options, verify=False, reproducer=False)
    with case.switches().off(case.switch):
        result = compiler.compile(model, inputs, case.backend, **options)
        try:
            checked = compare_with_eager(result, model, inputs)
            check = f"{'passes' if checked.passed else 'FAILS'} ({checked.max_abs_error:.2g})"
        except Exception as exc:  # the payload cannot run: the output check refuses it
            check = f"refuses: {type(exc).__name__}"
        start = time.perf_counter()
        found = compiler.check_nodes(result, model, inputs)
        seconds = time.perf_counter() - start
    no_fault = False
    if found.passed:  # is there a fault at all? the fix on must change the program
        fixed = compiler.compile(model, inputs, case.backend, **options)
        no_fault = fixed.pte == result.pte
    first = found.first
    named = found.refused is not None or any((d.node, d.op) == (case.node, case.op) or d.op == case.op for d in first)
    return {
        "id": case.id, "behind": behind, "backend": case.backend, "check": check,
        "nodes": "passes" if found.passed else "FAILS", "named": named, "no_fault": no_fault,
        "first": ", ".join(f"{d.node} {d.output_error:.2g}/{d.tolerance:.2g}" for d in first[:2])
        or (found.refused or "")[:80],
        "expected": case.node, "compared": found.compared, "seconds": round(seconds, 2),
    }


def suite_row(name: str, backend: str) -> dict:
    import compiler
    from compiler.models import model_suite

    module, inputs = model_suite.SUITE[name]()
    result = compiler.compile(module, inputs, backend)
    start = time.perf_counter()
    found = compiler.check_nodes(result, module, inputs)
    seconds = time.perf_counter() - start
    return {
        "model": name, "backend": backend, "nodes": "passes" if found.passed else "FAILS", "compared": found.compared,
        "unmeasured": len(found.unmeasured), "seconds": round(seconds, 1),
        "first": ", ".join(f"{d.node} ({d.op}) {d.output_error:.2g}/{d.tolerance:.2g}" for d in found.first[:2]),
    }


def fault_table(rows: list[dict]) -> str:
    lines = ["| fault (switch off) | behind | backend | output check | node check | names the fix's node | "
             "first nodes over (error/tolerance) | check s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["no_fault"]:
            verdict, named = "passes: **no fault** (the fix changes no byte here)", "-"
        else:
            verdict, named = r["nodes"], ("yes" if r["named"] else "**no**")
        lines.append(f"| `{r['id']}` | {r['behind']} | {r['backend']} | {r['check']} | {verdict} | {named} | "
                     f"{r['first']} | {r['seconds']} |")
    return "\n".join(lines)


def suite_table(rows: list[dict]) -> str:
    lines = ["| model | backend | node check | nodes compared | fused (not compared) | first over | check s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['nodes']} | {r['compared']} | {r['unmeasured']} | "
                     f"{r['first'] or '-'} | {r['seconds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", action="store_true", help="the locate faults, plain and behind squashing ops")
    parser.add_argument("--suite", action="store_true", help="the transformers model suite on every backend")
    parser.add_argument("--only", nargs="+", default=(), help="cases or models whose name holds one of these")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN)
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    both = not (args.faults or args.suite)
    text = "# The node check\n\n`python -m benchmarks.node_check` (`compiler.check_nodes`).\n"

    def wanted(name: str) -> bool:
        return not args.only or any(o in name for o in args.only)

    if args.faults or both:
        rows = []
        for case in locate_faults.CASES:
            if not wanted(case.id):
                continue
            for behind in BEHIND:
                rows.append(fault_row(case, behind))
                print(rows[-1], flush=True)
        text += "\n## Faults, each fix switched off\n\n" + fault_table(rows) + "\n"
    if args.suite or both:
        from compiler.models import model_suite

        rows = []
        for name in model_suite.SUITE:
            if not wanted(name):
                continue
            for backend in SUITE_BACKENDS:
                rows.append(suite_row(name, backend))
                print(rows[-1], flush=True)
        text += "\n## No false alarm: the model suite at each backend's defaults\n\n" + suite_table(rows) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.markdown) or ".", exist_ok=True)
    with open(args.markdown, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
