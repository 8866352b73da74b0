"""Core ML programs checked against eager PyTorch on this machine, model by model.

    python -m benchmarks.coreml_check [--only NAME ...] [--markdown FILE] [--json FILE]

Compiles the built-in examples (`compiler.models.examples.EXAMPLES`) and the model suite
(`compiler.models.model_suite.SUITE`, factory defaults: GPT-2 at 48 layers) for Core ML at the
default compute precision (float16) and at float32, runs each program with `compiler.run`
(on Linux each Core ML payload runs in the MIL reference interpreter) and compares it with
eager through `compiler.running.runtime.compare_with_eager`, at the tolerance the check picks for
the program's precision (1e-4 absolute for float32; 1e-2 x the largest |eager output| when
a delegate computes in float16). The Llama static-cache step also decodes two steps on one
loaded program, below iOS18 (the cache a CPU buffer) and for iOS18 (the cache Core ML state,
which Core ML keeps in float16 whatever the compute precision, so the float16 rule applies).

Writes a Markdown table (model, precision, delegates, CPU ops, max abs error, largest
|eager|, tolerance, pass) to `benchmarks/results/coreml_check.md` and the same rows as
JSON. A float32 error is the real test of the interpreter's semantics; a float16 one
measures Core ML's own rounding. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import time
import warnings

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
logging.getLogger("coremltools").setLevel(logging.ERROR)

import torch  # noqa: E402

import compiler  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from compiler.running.runtime import CheckResult, LoadedProgram, compare_with_eager  # noqa: E402
from compiler.running.tolerance import Tolerance  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DEFAULT_MARKDOWN = os.path.join(RESULTS, "coreml_check.md")
DEFAULT_JSON = os.path.join(RESULTS, "coreml_check.json")


def precisions() -> dict:
    """Label -> backend_options for each compute precision checked (float16 is Core ML's default)."""
    return {"fp16": {}, "fp32": {"compute_precision": "float32"}}


def check(factory, backend_options: dict | None = None, steps=None) -> dict:
    """Build one model, compile it for Core ML, run it here and compare with eager; a row of
    the table (a failure to build, compile or run is recorded as the row's error).

    With `steps` (a list of input tuples) the program is loaded once and run on each in turn
    beside a fresh eager module (`factory` again: same weights, its own state), so state the
    program keeps (a KV cache) must carry from step to step as eager's does; the row holds the
    largest error over the steps, against the tolerance the check picks for the program.
    """
    start = time.perf_counter()
    row: dict = {}
    try:
        built = factory()
        module, inputs = built[0], built[1]
        kwargs = {"backend_options": backend_options} if backend_options else {}
        if len(built) > 2 and built[2] is not None:
            kwargs["dynamic_shapes"] = built[2]
        with torch.no_grad():
            artifact = compiler.compile(module, inputs, "coreml", **kwargs)
            stats = artifact.program.stats()
            row.update(delegates=stats.delegates, cpu_ops=stats.cpu_ops)
            result = compare_with_eager(artifact, module, inputs) if steps is None else _steps(artifact, factory, steps)
        row.update(
            max_abs_error=result.max_abs_error,
            largest_expected=result.largest_expected,
            tolerance=result.tolerance.absolute,
            tolerance_rule=result.tolerance.rule,
            passed=result.passed,
        )
    except Exception as exc:  # recorded, and the next model goes on
        lines = str(exc).strip().splitlines() or [""]
        row.update(passed=False, error=f"{type(exc).__name__}: {lines[0][:300]}")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _steps(artifact, factory, steps) -> CheckResult:
    """The program, loaded once, and a fresh eager module run on each step's inputs in turn."""
    eager = factory()[0]
    loaded = LoadedProgram(artifact)
    largest = max_abs = max_rel = 0.0
    outputs = 0
    for step_inputs in steps:
        expected = [t for t in pytree.tree_leaves(eager(*step_inputs)) if isinstance(t, torch.Tensor)]
        actual = loaded(step_inputs)
        outputs += len(expected)
        for got, want in zip(actual, expected):
            diff = (got.double() - want.double()).abs()
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, (diff / want.double().abs().clamp_min(1e-6)).max().item())
            largest = max(largest, want.abs().max().item())
    tolerance = Tolerance.for_precision(loaded.computes_in_float16, largest)
    return CheckResult(max_abs, max_rel, outputs, largest, tolerance)


def jobs(only=None) -> list[tuple[str, str, object, dict, object]]:
    """(model, precision, factory, backend_options, steps) for every check of this invocation."""
    from compiler.models.examples import EXAMPLES
    from compiler.models.model_suite import SUITE, decode_inputs

    models = [(f"examples/{n}", f) for n, f in EXAMPLES.items()] + [(f"suite/{n}", f) for n, f in SUITE.items()]
    if only:
        models = [(label, f) for label, f in models if any(o in label for o in only)]
    out = []
    for label, factory in models:
        for precision, options in precisions().items():
            out.append((label, precision, factory, options, None))
        if label == "suite/llama_static_cache":
            # Two decoding steps on one loaded program: the second reads the cache the first wrote
            # (below iOS18 the cache is a CPU buffer the delegate reads and returns; from iOS18 on
            # it is Core ML state inside the delegate).
            steps = [decode_inputs(0), decode_inputs(1)]
            for precision, options in precisions().items():
                out.append((f"{label}, 2 steps", precision, factory, options, steps))
                out.append((f"{label}, 2 steps", f"{precision}, iOS18 state", factory,
                            {**options, "minimum_deployment_target": "iOS18"}, steps))
    return out


def _number(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    from importlib.metadata import version

    head = (
        f"# Core ML `--check` on this machine (Linux: MIL reference interpreter; {platform.machine()}, "
        f"torch {torch.__version__}, executorch {version('executorch')}, "
        f"coremltools {version('coremltools')})\n\n"
        f"Command: `{command}` ({seconds:.0f} s)\n\n"
        "Tolerance: 1e-4 absolute for a program computing in float32; 1e-2 x the largest |eager output| "
        "when a delegate computes in float16 (Core ML's default compute precision).\n\n"
    )
    table = [
        "| model | precision | delegates | CPU ops | max abs error | largest \\|eager\\| | tolerance | pass |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        verdict = "yes" if r["passed"] else ("**no**" if "error" not in r else f"**no**: {r['error']}")
        table.append(
            f"| {r['model']} | {r['precision']} | {r.get('delegates', '-')} | {r.get('cpu_ops', '-')} | "
            f"{_number(r.get('max_abs_error'))} | {_number(r.get('largest_expected'))} | "
            f"{_number(r.get('tolerance'))} | {verdict} |"
        )
    passed = sum(r["passed"] for r in rows)
    return head + "\n".join(table) + f"\n\n{passed} of {len(rows)} checks pass.\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="only the models whose label contains one of these")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN, help="the table's file")
    parser.add_argument("--json", default=DEFAULT_JSON, help="the rows as JSON")
    args = parser.parse_args(argv)

    rows = []
    start = time.perf_counter()
    for label, precision, factory, options, steps in jobs(args.only):
        row = {"model": label, "precision": precision, **check(factory, options, steps)}
        rows.append(row)
        outcome = row.get("error") or (
            f"max abs error {row['max_abs_error']:.3g}, tolerance {row['tolerance']:.3g}, "
            f"{'OK' if row['passed'] else 'MISMATCH'}"
        )
        print(f"{label:<30} {precision:<18} {row['seconds']:>6.1f}s  {outcome}", flush=True)
    elapsed = time.perf_counter() - start
    command = "python -m benchmarks.coreml_check" + (f" --only {' '.join(args.only)}" if args.only else "")
    for path, text in ((args.markdown, markdown(rows, command, elapsed)),
                       (args.json, json.dumps({"command": command, "rows": rows}, indent=1) + "\n")):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    print(f"{sum(r['passed'] for r in rows)} of {len(rows)} checks pass; wall time {elapsed:.0f}s")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
