"""The quantization table: every scheme each backend takes, ours against ExecuTorch's recipe.

    python -m benchmarks.quantization [--models ...] [--backends ...] [--schemes ...] [--quick]
    $PY -m benchmarks.quantization --policies --seed-kit ../shared/seed-systems

For each model, backend (portable, xnnpack, coreml, mlx) and scheme x granularity the backend
takes (`compiler.stages.schemes.SCHEMES`; portable: PT2E's int8 schemes), plus a float32
baseline per backend and model, it compiles the model with our stage cache off (cold times),
and with the ExecuTorch recipe that builds the same program (`executorch.export.export` with
`ExportRecipe.get_recipe(RecipeType, ...)`; the float32 baseline: `xnnpack_fp32`,
`coreml_fp16`, as our Core ML default computes in float16). It records per cell: the `.pte`
size against the float32 program's, the error against the eager quantized model (what
`--check` compares with) and against the float model (`compare_with_eager`), the delegated
share, the compile time of ours against the recipe's, and on XNNPACK and portable the run
time under ExecuTorch's runtime (`LoadedProgram`, median of `--runs` after a warm-up) against
the float32 program's. The recipe's program is checked against its own eager reference (its quantize
stage's model): a recipe that fails, or whose program is wrong against that, is recorded in
the recipe column, a bug we do not inherit. A scheme ExecuTorch has no recipe of says so.

Models: the transformer example; GPT-2 small at its real sizes (124M parameters: 12 layers,
n_embd 768, 12 heads, vocabulary 50257, 1024 positions; its float32 program is 650 MB, the
tied table held twice: gathered and multiplied); the Llama static-cache step. With
`--policies` the seed kit's LeRobot ACT and pi0, and pi0 in bfloat16 (the kit's `pi0_bf16`,
no scheme: its delegated share and check at the default precision); the kit is imported only
then, from `--seed-kit DIR`, and only works in the kit's own venv (`$PY` of its env.sh).
Static schemes calibrate both paths on the example inputs and `CALIBRATION_DRAWS` draws of
the factory (the kit's policies: the example inputs alone).

Cells are merged into the JSON by key (a cell measured again is replaced), so the project's
venv and the kit's can each add theirs; the Markdown and the table between the
`quantization-table` markers of docs/quantization.md are rendered from every cell held.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Callable

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

import torch  # noqa: E402

import compiler  # noqa: E402
from compiler.stages import schemes  # noqa: E402
from compiler.tools import readme  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "quantization.json")
DEFAULT_MARKDOWN = os.path.join(HERE, "results", "quantization.md")
DEFAULT_DOC = os.path.join(os.path.dirname(HERE), "docs", "quantization.md")
SECTION = "quantization-table"
BACKENDS = ("portable", "xnnpack", "coreml", "mlx")
# The backends whose programs run under ExecuTorch's runtime here (Core ML and MLX run in reference executors).
TIMED = ("portable", "xnnpack")
FLOAT = "float32"
BFLOAT16 = "bfloat16"
GROUP_SIZE = 32
CALIBRATION_DRAWS = 3
GPT2_SIZES = {"layers": 12, "embd": 768, "heads": 12, "vocab": 50257, "positions": 1024}
# The recipe each backend's float32 baseline is compared with (MLX: ExecuTorch has no recipes).
FLOAT_RECIPES = {"xnnpack": "xnnpack_fp32", "coreml": "coreml_fp16"}
SUITE_MODELS = ("transformer", "gpt2", "llama_static_cache")
POLICY_MODELS = ("act", "pi0", "pi0_bf16")
# --quick: the cells the test suite measures (no warm-up: the times are not what it checks).
QUICK_MODEL = "transformer"
QUICK_CELLS = {"xnnpack": [(FLOAT, None), ("8da4w", "per_group")], "mlx": [(FLOAT, None), ("4w", "per_group")]}
COLUMNS = (
    "backend", "scheme", "ours", ".pte KB (vs float32)", "error vs quantized (tolerance)", "error vs float",
    "delegated", "compile s ours / recipe", "run ms (vs float32)", "ExecuTorch recipe",
)


def _quiet() -> None:
    """The dependencies log as they work, some on loggers with levels of their own."""
    logging.disable(logging.WARNING)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _suite_factory(name: str) -> Callable:
    """The factory of a project model (it takes `seed`, so its draws give calibration inputs)."""
    from compiler.models import examples, model_suite

    if name == "transformer":
        return examples.transformer
    if name == "gpt2":
        return functools.partial(model_suite.gpt2, **GPT2_SIZES)
    return model_suite.llama_static_cache


def model_and_calibration(name: str, seed_kit: str | None) -> tuple[torch.nn.Module, tuple, Callable[[], list[tuple]]]:
    """The model, its example inputs, and what gives the calibration inputs static schemes take
    (drawn once, when first asked: a draw builds the model again), the example inputs first:
    ExecuTorch's recipes calibrate on every sample they are given."""
    if name in POLICY_MODELS:
        kit = os.path.abspath(seed_kit)
        if kit not in sys.path:
            sys.path.insert(0, kit)
        import policies  # the seed kit's, only here

        module, inputs = policies.build(name)
        return module, tuple(inputs), lambda: [tuple(inputs)]
    factory = _suite_factory(name)
    module, inputs = factory()
    draws = functools.cache(lambda: [tuple(factory(seed=s)[1]) for s in range(1, CALIBRATION_DRAWS + 1)])
    return module, tuple(inputs), lambda: [tuple(inputs), *draws()]


def cells_of(backend: str, scheme_names: list[str] | None, default_only: bool = False) -> list[tuple[str, str | None]]:
    """(scheme, granularity) for the backend: the float32 baseline first, then each scheme x
    granularity it takes (or only each scheme's default granularity); `scheme_names` picks some
    (`float32` the baseline)."""
    cells: list[tuple[str, str | None]] = [(FLOAT, None)] if scheme_names is None or FLOAT in scheme_names else []
    for scheme in schemes.SCHEMES:
        if scheme_names is None or scheme.name in scheme_names:
            grains = scheme.granularities(backend)
            cells += [(scheme.name, granularity) for granularity in (grains[:1] if default_only else grains)]
    return cells


def recipe_name(backend: str, scheme: str, granularity: str | None) -> str | None:
    if scheme == FLOAT:
        return FLOAT_RECIPES.get(backend)
    return schemes.BY_NAME[scheme].recipe(backend, granularity)


def _recipe(backend: str, name: str, scheme: str, granularity: str | None):
    """ExecuTorch's recipe by its `RecipeType` value, with the group size (and a codebook's
    block) ours compiles with."""
    import importlib

    from executorch.export import ExportRecipe, recipe_registry

    from compiler.ir.targets import BY_NAME

    importlib.import_module(BY_NAME[backend].recipes_package)
    (recipe_type,) = (t for t in recipe_registry.get_supported_recipes(backend) if t.value == name)
    kwargs = {"group_size": GROUP_SIZE} if granularity == schemes.PER_GROUP else {}
    if scheme == "codebook":
        kwargs = {"bits": 4, "block_size": [-1, GROUP_SIZE]}
    return ExportRecipe.get_recipe(recipe_type, **kwargs)


def _median_ms(loaded, inputs: tuple, runs: int) -> float:
    for _ in range(2):  # warm-up
        loaded(inputs)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        loaded(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ours(module, inputs: tuple, samples: list[tuple], backend: str, scheme: str, granularity: str | None,
         runs: int) -> dict:
    """Our compile (stage cache off), checked against the eager quantized model (`--check`'s
    reference), which also gives the error against the float model."""
    options = {}
    if scheme not in (FLOAT, BFLOAT16):
        options = {"quantize": scheme, "quantize_granularity": granularity, "quantize_group_size": GROUP_SIZE}
        if schemes.BY_NAME[scheme].needs_calibration:
            options["calibration"] = samples
    start = time.perf_counter()
    try:
        with torch.no_grad():
            result = compiler.compile(module, inputs, backend, cache=False, **options)
    except Exception as exc:  # recorded, and the next cell goes on
        return {"status": "fails", "error": _first_line(exc), "compile_s": time.perf_counter() - start}
    out = {"compile_s": time.perf_counter() - start, "pte_bytes": len(result.pte)}
    plan = result.program.plan
    out["delegated"] = len(plan.delegated_nodes) / max(len(plan.nodes), 1)
    try:
        check = compiler.compare_with_eager(result, module, inputs)
    except Exception as exc:
        return out | {"status": "fails", "error": f"run: {_first_line(exc)}"}
    out |= {
        "status": "ok" if check.passed else "wrong",
        "max_abs_error": check.max_abs_error,  # against the eager quantized model (a float program's: the model)
        "tolerance": check.tolerance.absolute,
        "error_vs_float": check.quantization_error,
        "precision_error": check.precision_error,
    }
    if check.judged_at_float32:  # over its float16 tolerance by float16's rounding across requantizations
        out["judged_at_float32"] = {"max_abs_error": check.at_float32.max_abs_error,
                                    "tolerance": check.at_float32.tolerance.absolute}
    if backend in TIMED:
        out |= {"run_ms": _median_ms(compiler.LoadedProgram(result), inputs, runs), "runs": runs}
    return out


def stock(module, samples: list[tuple], backend: str, scheme: str, granularity: str | None, name: str) -> dict:
    """ExecuTorch's recipe path, checked against its own eager reference (its quantize stage's model)."""
    from executorch.export import StageType, export

    start = time.perf_counter()
    try:
        with torch.no_grad():
            session = export(module, samples, export_recipe=_recipe(backend, name, scheme, granularity))
            pte = session.get_pte_buffer()
    except Exception as exc:
        return {"status": "fails", "error": _first_line(exc), "compile_s": time.perf_counter() - start}
    out = {"compile_s": time.perf_counter() - start, "pte_bytes": len(pte)}
    artifacts = session.get_stage_artifacts()
    reference = artifacts[StageType.QUANTIZE].data["forward"] if StageType.QUANTIZE in artifacts else module
    try:
        check = compiler.compare_with_eager(pte, reference, samples[0])
    except Exception as exc:
        return out | {"status": "fails", "error": f"run: {_first_line(exc)}"}
    return out | {"status": "ok" if check.passed else "wrong", "max_abs_error": check.max_abs_error,
                  "tolerance": check.tolerance.absolute}


def measure(module, inputs, calibration, backend: str, scheme: str, granularity: str | None, runs: int) -> dict:
    """One cell: ours, and the recipe's where ExecuTorch has one; both calibrated on the same samples."""
    name = recipe_name(backend, scheme, granularity) if scheme != BFLOAT16 else None
    static = scheme in schemes.BY_NAME and schemes.BY_NAME[scheme].needs_calibration
    samples = calibration() if static else [inputs]
    cell = {"recipe": name, "ours": ours(module, inputs, samples, backend, scheme, granularity, runs)}
    if name is not None:
        cell["stock"] = stock(module, samples, backend, scheme, granularity, name)
    if granularity == schemes.PER_GROUP:
        cell["group_size"] = GROUP_SIZE
    return cell


def warm_up(backend: str) -> None:
    """Imports, registries and converter tables, each way, before anything is timed."""
    from compiler.models.examples import mlp

    module, inputs = mlp()
    cells = cells_of(backend, None)
    scheme, granularity = next((c for c in cells[1:] if recipe_name(backend, *c)), cells[-1])
    ours(module, inputs, [inputs], backend, scheme, granularity, 1)
    for kind, grain in ((FLOAT, None), (scheme, granularity)):
        name = recipe_name(backend, kind, grain)
        if name:
            stock(module, [inputs], backend, kind, grain, name)


def offered(cell: dict) -> bool:
    """Whether the schemes table still offers the cell's scheme and granularity on its backend."""
    if cell["scheme"] in (FLOAT, BFLOAT16):
        return True
    return cell["granularity"] in schemes.BY_NAME[cell["scheme"]].granularities(cell["backend"])


def key(model: str, backend: str, scheme: str, granularity: str | None) -> str:
    return "/".join((model, backend, scheme, granularity or "-"))


def _kb(size: float) -> str:
    return f"{size / 1024:.0f}"


def _ours_cells(cell: dict, baseline: dict | None) -> list[str]:
    o = cell["ours"]
    if "pte_bytes" not in o:
        return [f"fails: {o['error'][:120]}", "-", "-", "-", "-"]
    base = (baseline or {}).get("ours", {})
    size = _kb(o["pte_bytes"]) + (f" ({o['pte_bytes'] / base['pte_bytes']:.2f}x)" if base.get("pte_bytes") else "")
    if "max_abs_error" not in o:
        return [f"fails: {o['error'][:120]}", size, "-", "-", f"{o['delegated']:.0%}"]
    error = f"{o['max_abs_error']:.1e} ({o['tolerance']:.1e})"
    if o.get("judged_at_float32"):
        again = o["judged_at_float32"]
        error += f"; judged at float32: {again['max_abs_error']:.1e} ({again['tolerance']:.1e})"
    against = "-"
    if o.get("error_vs_float") is not None:
        against = f"{o['error_vs_float']:.1e}"
    elif o.get("precision_error") is not None:  # a program computing wider than the model: against the model as given
        against = f"{o['precision_error']:.1e} (against the model as given)"
    status = o["status"] if o["status"] == "ok" else f"**{o['status']}**"
    return [status, size, error, against, f"{o['delegated']:.0%}"]


def _compile_cell(cell: dict) -> str:
    ours_s = f"{cell['ours']['compile_s']:.1f}"
    s = cell.get("stock")
    if s is None or "pte_bytes" not in s:
        return f"{ours_s} / -"
    return f"{ours_s} / {s['compile_s']:.1f} ({cell['ours']['compile_s'] / s['compile_s']:.2f}x)"


def _run_cell(cell: dict, baseline: dict | None) -> str:
    ms = cell["ours"].get("run_ms")
    if ms is None:
        return "-"
    base = (baseline or {}).get("ours", {}).get("run_ms")
    return f"{ms:.2f}" + (f" ({ms / base:.2f}x)" if base else "")


def _stock_cell(cell: dict) -> str:
    if cell["recipe"] is None:
        return "no recipe" if cell["scheme"] != BFLOAT16 else "-"
    s = cell["stock"]
    name = f"`{cell['recipe']}`"
    if s["status"] == "ok":
        return f"{name}: ok, {_kb(s['pte_bytes'])} KB, {s['max_abs_error']:.1e}"
    if s["status"] == "wrong":
        return f"{name}: **wrong** against its own eager model: {s['max_abs_error']:.1e} > {s['tolerance']:.1e}"
    return f"{name}: **fails**: {s['error'][:120]}"


def _scheme_cell(cell: dict) -> str:
    if cell["granularity"] is None:
        return cell["scheme"] + (" (default precision)" if cell["scheme"] == BFLOAT16 else "")
    group = f" {cell['group_size']}" if cell.get("group_size") else ""
    return f"`{cell['scheme']}` {cell['granularity']}{group}"


def table(results: dict) -> str:
    """The measured tables, one per model, from every cell held."""
    cells = results["cells"]
    lines = []
    for model in dict.fromkeys(c["model"] for c in cells.values()):
        lines += [f"**{results['models'].get(model, model)}**", "",
                  "| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
        for cell in cells.values():
            if cell["model"] != model:
                continue
            baseline = cells.get(key(model, cell["backend"], FLOAT, None))
            row = [cell["backend"], _scheme_cell(cell), *_ours_cells(cell, baseline), _compile_cell(cell),
                   _run_cell(cell, baseline), _stock_cell(cell)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += ["Cells that cannot exist (for every model), each with why:", ""]
    lines += [f"- {backend} {text}: {why}" for backend, text, why in absent_cells()]
    return "\n".join(lines)


def absent_cells() -> list[tuple[str, str, str]]:
    """(backend, scheme and granularity, why) of each scheme x granularity a backend does not take."""
    absent = []
    for backend in BACKENDS:
        for scheme in schemes.SCHEMES:
            if not scheme.granularities(backend):
                absent.append((backend, f"`{scheme.name}`", scheme.why_not(backend)))
                continue
            absent += [(backend, f"`{scheme.name}` {g}", scheme.why_not(backend, g))
                       for g in schemes.GRANULARITIES if g not in scheme.granularities(backend)]
    return absent


def _describe_models(names: list[str]) -> dict:
    words = {
        "transformer": "transformer example (2 pre-norm blocks, dim 64, 4 heads, seq 16)",
        "gpt2": "GPT-2 small ({layers} layers, n_embd {embd}, {heads} heads, vocab {vocab}, {positions} positions; "
        "seq 16)".format(**GPT2_SIZES),
        "llama_static_cache": "Llama static-cache decoder step (2 layers, hidden 64, cache 16, vocab 128)",
        "act": "LeRobot ACT (seed kit)",
        "pi0": "LeRobot pi0 (seed kit)",
        "pi0_bf16": "LeRobot pi0 in bfloat16 (seed kit)",
    }
    return {name: words[name] for name in names}


def _sorted_cells(cells: dict) -> dict:
    """Model, backend, then the float32 baseline and the schemes in the schemes table's order."""
    models = list(SUITE_MODELS + POLICY_MODELS)
    order = [FLOAT, BFLOAT16, *schemes.SCHEME_NAMES]

    def rank(item):
        c = item[1]
        grains = schemes.BY_NAME[c["scheme"]].granularities(c["backend"]) if c["scheme"] in schemes.BY_NAME else ()
        return (models.index(c["model"]), BACKENDS.index(c["backend"]), order.index(c["scheme"]),
                grains.index(c["granularity"]) if c["granularity"] in grains else -1)

    return dict(sorted(cells.items(), key=rank))


def render_markdown(results: dict) -> str:
    return (
        "# Quantization: every scheme per backend, ours against ExecuTorch's recipes\n\n"
        f"This machine: {os.cpu_count()} cores, torch {torch.__version__}. Compile times are cold (stage cache off), "
        "ours then the recipe's in one process; run times on portable and XNNPACK under ExecuTorch's runtime, the "
        "median of 20 runs after a warm-up (GPT-2: 10).\n\nCommands: `python -m benchmarks.quantization`, and in the seed kit's "
        "venv `$PY -m benchmarks.quantization --policies --seed-kit DIR` (merged into the same results).\n\n"
        + table(results) + "\n"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=SUITE_MODELS + POLICY_MODELS)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--schemes", nargs="+", choices=(FLOAT, *schemes.SCHEME_NAMES),
                        help="only these (float32: the baseline, which the size and run-time ratios need)")
    parser.add_argument("--default-granularity", action="store_true",
                        help="each scheme at its default granularity only (the big models, in the time a run has here)")
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each XNNPACK program; the median is reported")
    parser.add_argument("--quick", action="store_true", help="the transformer example: float32 and 8da4w on xnnpack, "
                        "float32 and 4w on mlx, writing only where --json / --markdown say (the test suite runs it)")
    parser.add_argument("--policies", action="store_true", help="the seed kit's ACT, pi0 and pi0_bf16 (kit venv only)")
    parser.add_argument("--seed-kit", default=os.path.join("..", "shared", "seed-systems"), help="the seed kit's folder")
    parser.add_argument("--render-only", action="store_true", help="measure nothing: write the tables from --json")
    parser.add_argument("--json", help=f"results file, merged by cell (default {os.path.relpath(DEFAULT_JSON)})")
    parser.add_argument("--markdown", help=f"tables (default {os.path.relpath(DEFAULT_MARKDOWN)})")
    parser.add_argument("--doc", help=f"the doc holding the {SECTION} markers (default {os.path.relpath(DEFAULT_DOC)})")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.backends, args.runs = [QUICK_MODEL], list(QUICK_CELLS), 3
    else:
        args.json, args.markdown, args.doc = args.json or DEFAULT_JSON, args.markdown or DEFAULT_MARKDOWN, args.doc or DEFAULT_DOC
    models = [] if args.render_only else args.models or (list(POLICY_MODELS) if args.policies else list(SUITE_MODELS))
    _quiet()

    results = {"cells": {}, "models": {}}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
        results["cells"] = {k: c for k, c in results["cells"].items() if offered(c)}
    results |= {"torch": torch.__version__, "group_size": GROUP_SIZE}
    results["models"] = _describe_models(list(dict.fromkeys([*(c["model"] for c in results["cells"].values()), *models])))
    for backend in [] if args.quick or not models else args.backends:
        warm_up(backend)
    for model in models:
        module, inputs, calibration = model_and_calibration(model, args.seed_kit)
        for backend in args.backends:
            cells = [(BFLOAT16, None)] if model == "pi0_bf16" else cells_of(backend, args.schemes, args.default_granularity)
            cells = QUICK_CELLS[backend] if args.quick else cells
            for scheme, granularity in cells:
                start = time.perf_counter()
                cell = {"model": model, "backend": backend, "scheme": scheme, "granularity": granularity}
                cell |= measure(module, inputs, calibration, backend, scheme, granularity, args.runs)
                results["cells"][key(model, backend, scheme, granularity)] = cell
                results["cells"] = _sorted_cells(results["cells"])
                stock_status = cell.get("stock", {}).get("status", "no recipe")
                print(f"{key(model, backend, scheme, granularity):<50} {time.perf_counter() - start:6.1f}s  "
                      f"ours {cell['ours']['status']}, recipe {stock_status}", flush=True)
                if args.json:  # after every cell, so a long run keeps what it has
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
                        f.write("\n")
        del module
    text = table(results)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(results))
    if args.doc:
        readme.write_file(args.doc, SECTION, text)


if __name__ == "__main__":
    main()
