"""Every MIL op type our Core ML backend emits into its delegate payloads.

    python -m benchmarks.coreml_mil_ops [--json FILE]
    $PY -m benchmarks.coreml_mil_ops --policies --seed-kit ../shared/seed-systems --skip-builtin

Compiles the built-in examples (`compiler.models.examples.EXAMPLES`) and the model suite
(`compiler.models.model_suite.SUITE`, factory defaults except GPT-2 at 2 layers) for Core ML at
the default compute precision (float16) and at float32, plus the Llama static-cache step
for iOS18 (where the KV cache becomes Core ML state). With `--policies` it also compiles
the LeRobot policies of the seed kit (`policies.build(name)`); that kit is imported only
then, from `--seed-kit DIR`, and only works in the kit's own venv (`$PY` of its env.sh):
the project does not depend on it.

Each payload is read back with `compiler.backends.coreml.payload.read_models`, and per op
type it records the runs it appears in, how often, the dtypes of its outputs and the
distinct values of its mode-like constant inputs (strings and bools: gelu's mode, conv's
pad_type, matmul's transpose_x...). Results are merged into the JSON by run label (a run
with the same label is replaced), so the project venv and the kit's venv can each add
their part; the op table is recomputed from all runs held.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from collections import Counter, defaultdict

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
logging.getLogger("coremltools").setLevel(logging.ERROR)

import torch  # noqa: E402

import compiler  # noqa: E402
from compiler.backends.coreml.payload import read_models  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(__file__), "results", "coreml_mil_ops.json")
POLICIES = ("act", "smolvla", "pi0", "multi_task_dit")
SUITE_OVERRIDES = {"gpt2": {"layers": 2}}
# Constant values kept per op input: strings (modes) and bools (flags). Numbers are shapes,
# axes and weights, too many and not modes.
MODE_TYPES = (str, bool)


def _precisions() -> dict:
    """Label -> backend_options for each compute precision measured."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    fp32 = CoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)
    return {"fp16": None, "fp32": {"compile_specs": [fp32]}}


def _jsonable(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _mode_constants(constants: dict) -> dict:
    out = {}
    for name, value in constants.items():
        value = _jsonable(value)
        if isinstance(value, MODE_TYPES):
            out[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) <= 8:
            out[name] = "|".join(value)
    return out


def measure(factory, backend_options) -> dict:
    """Compile one model for Core ML and tally its payloads' ops."""
    built = factory()
    module, inputs = built[0], built[1]
    kwargs = {"dynamic_shapes": built[2]} if len(built) > 2 and built[2] is not None else {}
    if backend_options is not None:
        kwargs["backend_options"] = backend_options
    start = time.perf_counter()
    try:
        with torch.no_grad():
            artifact = compiler.compile(module, inputs, "coreml", **kwargs)
        models = read_models(artifact.pte)
    except Exception as exc:  # recorded, and the next model goes on
        lines = str(exc).strip().splitlines() or [""]
        return {"compiled": False, "error": f"{type(exc).__name__}: {lines[0][:400]}",
                "seconds": round(time.perf_counter() - start, 2)}
    counts: Counter = Counter()
    dtypes: dict = defaultdict(set)
    constants: dict = defaultdict(lambda: defaultdict(set))
    for model in models:
        for op in model.ops:
            counts[op.type] += 1
            dtypes[op.type].update(op.outputs.values())
            for name, value in _mode_constants(op.constants).items():
                constants[op.type][name].add(json.dumps(value))
    return {
        "compiled": True,
        "seconds": round(time.perf_counter() - start, 2),
        "payloads": len(models),
        "specification_versions": sorted({m.specification_version for m in models}),
        "ops": dict(sorted(counts.items())),
        "dtypes": {k: sorted(v) for k, v in sorted(dtypes.items())},
        "constants": {k: {n: sorted(vals) for n, vals in sorted(c.items())}
                      for k, c in sorted(constants.items())},
    }


def _jobs(args) -> list[tuple[str, object, object]]:
    """(label, factory, backend_options) for every compile of this invocation."""
    import functools

    precisions = _precisions()
    models: list[tuple[str, object]] = []
    if not args.skip_builtin:
        from compiler.models.examples import EXAMPLES
        from compiler.models.model_suite import SUITE

        models += [(f"examples/{name}", factory) for name, factory in EXAMPLES.items()]
        models += [(f"suite/{name}", functools.partial(factory, **SUITE_OVERRIDES.get(name, {})))
                   for name, factory in SUITE.items()]
    if args.policies:
        kit = os.path.abspath(args.seed_kit)
        if kit not in sys.path:
            sys.path.insert(0, kit)
        import policies  # the seed kit's, only here

        models += [(f"policies/{name}", functools.partial(policies.build, name)) for name in POLICIES]
    if args.only:
        models = [(label, f) for label, f in models if any(o in label for o in args.only)]
    jobs = []
    for label, factory in models:
        for precision, options in precisions.items():
            jobs.append((f"{label}@{precision}", factory, options))
        if label == "suite/llama_static_cache":
            jobs.append((f"{label}@fp16+iOS18", factory, {"minimum_deployment_target": "iOS18"}))
    return jobs


def aggregate(runs: dict) -> dict:
    """Op type -> the runs it appears in, its counts, dtypes and mode-like constant values."""
    table: dict = {}
    for label, run in sorted(runs.items()):
        if not run.get("compiled"):
            continue
        for op_type, count in run["ops"].items():
            entry = table.setdefault(op_type, {"count": 0, "runs": {}, "models": set(), "precisions": set(),
                                               "dtypes": set(), "constants": defaultdict(set)})
            entry["count"] += count
            entry["runs"][label] = count
            model, _, precision = label.partition("@")
            entry["models"].add(model)
            entry["precisions"].add(precision)
            entry["dtypes"].update(run["dtypes"].get(op_type, []))
            for name, values in run["constants"].get(op_type, {}).items():
                entry["constants"][name].update(values)
    return {
        op_type: {
            "count": e["count"],
            "models": sorted(e["models"]),
            "precisions": sorted(e["precisions"]),
            "dtypes": sorted(e["dtypes"]),
            "constants": {n: [json.loads(v) for v in sorted(vals)] for n, vals in sorted(e["constants"].items())},
            "runs": e["runs"],
        }
        for op_type, e in sorted(table.items())
    }


def summary(ops: dict, runs: dict) -> str:
    width = max(len(k) for k in ops) if ops else 8
    lines = [f"{'op type':<{width}}  models  runs  count  dtypes", "-" * (width + 40)]
    for op_type, e in ops.items():
        lines.append(f"{op_type:<{width}}  {len(e['models']):>6}  {len(e['runs']):>4}  {e['count']:>5}  "
                     f"{','.join(e['dtypes'])}")
    failed = {k: v["error"] for k, v in runs.items() if not v.get("compiled")}
    lines.append(f"{len(ops)} op types over {len(runs) - len(failed)} compiled runs")
    for label, error in failed.items():
        lines.append(f"FAILED {label}: {error}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=DEFAULT_JSON, help="results file (merged by run label)")
    parser.add_argument("--policies", action="store_true", help="also the seed kit's LeRobot policies (kit venv only)")
    parser.add_argument("--seed-kit", default=os.path.join("..", "shared", "seed-systems"), help="the seed kit's folder")
    parser.add_argument("--skip-builtin", action="store_true", help="not the examples and the model suite")
    parser.add_argument("--only", nargs="*", help="only the models whose label contains one of these")
    parser.add_argument("--fresh", action="store_true", help="drop the runs already in the JSON")
    args = parser.parse_args(argv)

    results = {"runs": {}}
    if os.path.exists(args.json) and not args.fresh:
        with open(args.json) as f:
            results = json.load(f)
    runs = results.setdefault("runs", {})
    start = time.perf_counter()
    for label, factory, options in _jobs(args):
        run = measure(factory, options)
        runs[label] = run
        status = f"{sum(run['ops'].values())} ops, {len(run['ops'])} types" if run["compiled"] else run["error"]
        print(f"{label:<42} {run['seconds']:>7.1f}s  {status}", flush=True)
        results["ops"] = aggregate(runs)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:  # after every run, so a long run keeps what it has
            json.dump(results, f, indent=1, sort_keys=False)
            f.write("\n")
    elapsed = time.perf_counter() - start
    groups = ([] if args.skip_builtin else ["examples", "suite"]) + (["policies"] if args.policies else [])
    results.setdefault("wall_seconds", {})["+".join(groups) + ("" if not args.only else " (partial)")] = round(elapsed, 1)
    results["ops"] = aggregate(runs)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(summary(results["ops"], runs))
    print(f"wall time {elapsed:.0f}s")


if __name__ == "__main__":
    main()
