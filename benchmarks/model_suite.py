"""The transformers model suite on every backend: the table of docs/model-suite.md, generated.

    python -m benchmarks.model_suite [--doc docs/model-suite.md] [--json benchmarks/results/model_suite.json]
    python -m benchmarks.model_suite --backends coreml --json benchmarks/results/model_suite.json --doc docs/model-suite.md

For each model of `compiler.models.model_suite` (tiny, random weights, from configs) and each
backend it compiles, runs the program (portable and XNNPACK with ExecuTorch's runtime, MLX
and Core ML in the reference executor; the Llama decoder for two steps, so its KV cache
matters), and
records: compiled or the error, the largest difference from eager, the fraction of ops
delegated, and the compile time. With `--doc` the table between the
`model-suite-table` markers of that file is replaced (tests/test_readme.py checks it
is the table the committed `--json` results give).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)

import torch  # noqa: E402

import compiler  # noqa: E402
from compiler.models import model_suite  # noqa: E402
from compiler.running.tolerance import max_abs_error  # noqa: E402
from compiler.tools import readme  # noqa: E402

BACKENDS = ("portable", "xnnpack", "coreml", "mlx")


def _max_error(got, want) -> float:
    want = want if isinstance(want, tuple) else (want,)
    return max(max_abs_error(g, w) for g, w in zip(got, want))


def _eager_and_program(name: str, artifact) -> float:
    """Largest |program - eager| over the model's checked calls (two decoding steps for the Llama)."""
    if name == "llama_static_cache":
        eager, _ = model_suite.llama_static_cache()
        calls = [model_suite.decode_inputs(step) for step in range(2)]
    else:
        eager, inputs = model_suite.SUITE[name]()
        calls = [inputs]
    loaded = compiler.LoadedProgram(artifact)
    error = 0.0
    for inputs in calls:
        with torch.no_grad():
            want = eager(*inputs)
        error = max(error, _max_error(loaded(inputs), want))
    return error


def measure(name: str, backend: str) -> dict:
    module, inputs = model_suite.SUITE[name]()
    start = time.perf_counter()
    try:
        artifact = compiler.compile(module, inputs, backend)
    except Exception as exc:
        return {"compiled": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    seconds = time.perf_counter() - start
    plan = artifact.program.plan
    result = {
        "compiled": True,
        "compile_s": seconds,
        "delegated": len(plan.delegated_nodes) / max(len(plan.nodes), 1),
        "delegates": len(artifact.program.delegates),
        "ops": len(plan.nodes),
    }
    result["max_abs_error"] = _eager_and_program(name, artifact)
    return result


def _cell(result: dict) -> str:
    if not result["compiled"]:
        return f"fails: {result['error'][:60]}"
    return f"yes / {result['max_abs_error']:.1e} / {result['delegated']:.0%} / {result['compile_s']:.1f} s"


def table(results: dict) -> str:
    lines = [
        "| model | " + " | ".join(BACKENDS) + " |",
        "|---" * (len(BACKENDS) + 1) + "|",
    ]
    for name, row in results.items():
        lines.append(f"| `{name}` | " + " | ".join(_cell(row[b]) for b in BACKENDS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(model_suite.SUITE), default=list(model_suite.SUITE))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--doc", help="replace the table between the model-suite-table markers of this file (docs/model-suite.md)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.getLogger().setLevel(logging.ERROR)

    # Cells measured before (the --json file) stay unless measured again, so one backend's
    # column can be re-measured alone and the whole table still written.
    results = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)["results"]
    for name in args.models:
        results.setdefault(name, {})
        for backend in args.backends:
            results[name][backend] = measure(name, backend)
            print(f"{name} {backend}: {_cell(results[name][backend])}", flush=True)
    print()
    complete = all(set(BACKENDS) <= set(results.get(name, {})) for name in model_suite.SUITE)
    text = table(results) if complete else json.dumps(results, indent=2)
    print(text)
    if args.doc:
        readme.write_file(args.doc, "model-suite-table", text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
