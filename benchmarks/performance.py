"""docs/performance.md's performance section, rendered from the committed benchmark results.

    python -m benchmarks.performance [--doc docs/performance.md]     # print it, or rewrite it in --doc

Nothing is measured here: each table comes from a JSON file of `benchmarks/results/` written by
the benchmark named above it (compile time: `python -m benchmarks`; run time:
`python -m benchmarks.runtime`; warm re-runs: `python -m benchmarks.sweep` and
`python -m benchmarks.stage_cache`), so the section says what those runs measured and a test
keeps the two equal. Targets are issue 32's.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SECTION = "performance-table"

# Backend -> the most ours/stock may be at depth 48; the scaling and GPT-2 targets.
DEPTH_48_TARGET = {"xnnpack": 0.45, "coreml": 0.45, "mlx": 0.25}
SCALING_TARGET = 4.2  # t(48) / t(12) on XNNPACK
GPT2_TARGET = 0.5
WARM_TARGET = 0.1


def _load(name: str) -> dict | None:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _met(value: float, target: float) -> str:
    return "met" if value <= target else "**not met**"


def compile_time_lines(results: dict, alone: dict[str, tuple[float, str]] | None = None) -> list[str]:
    """The compile-time table; `alone`: backend -> (its depth-48 ratio, the file) of a run on that
    backend alone, with more runs each way, which the target cell gives beside this run's."""
    alone = alone or {}
    lines = [
        "Compile time, ours against stock ExecuTorch's `to_edge_transform_and_lower` on the same model, "
        f"in one process (`python -m benchmarks`, {results['runs']} run(s) each way, alternating; "
        "`benchmarks/results/compile_time.json`). Heap: peak growth of the heap in use during one "
        "compile in a fresh process.",
        "",
        "| backend | model | stock s | ours s | ours/stock | target | heap ours/stock |",
        "|---|---|---|---|---|---|---|",
    ]
    scaling = []
    for backend, per_backend in results["backends"].items():
        rows = [(f"stack, depth {d}", r) for d, r in per_backend.get("depths", {}).items()]
        if "gpt2" in per_backend:
            rows.append((f"GPT-2, {per_backend['gpt2']['layers']} layers", per_backend["gpt2"]))
        for model, r in rows:
            if "stock" not in r:
                lines.append(f"| {backend} | {model} | failed | {r['ours']['total']:.1f} | - | - | - |")
                continue
            target = ""
            if model == "stack, depth 48":
                target = f"<= {DEPTH_48_TARGET[backend]}: {_met(r['ratio_total'], DEPTH_48_TARGET[backend])}"
                if backend in alone:
                    ratio, source = alone[backend]
                    target += f" here; {_met(ratio, DEPTH_48_TARGET[backend])} at {ratio:.3f} in `{source}` (its own run)"
            elif model.startswith("GPT-2"):
                target = f"<= {GPT2_TARGET}: {_met(r['ratio_total'], GPT2_TARGET)}"
            lines.append(
                f"| {backend} | {model} | {r['stock']['total']:.1f} | {r['ours']['total']:.1f} | "
                f"{r['ratio_total']:.2f} | {target} | {r['ratio_heap']:.2f} |"
            )
        if "scaling_ours" in per_backend:
            text = f"{backend}: t({per_backend['last']})/t({per_backend['first']}) ours {per_backend['scaling_ours']:.2f}"
            if "scaling_stock" in per_backend:
                text += f", stock {per_backend['scaling_stock']:.2f}"
            scaling.append(text)
    if scaling:
        lines += ["", "Scaling in this run, one compile per depth (linear is 4.0): " + "; ".join(scaling) + "."]
    return lines


def scaling_lines(results: dict) -> list[str]:
    """The XNNPACK scaling measured on its own, several runs per depth."""
    per_backend = results["backends"]["xnnpack"]
    ours, stock = per_backend["scaling_ours"], per_backend["scaling_stock"]
    return [
        "",
        f"XNNPACK alone, medians of {results['runs']} runs at depths {per_backend['first']} and "
        f"{per_backend['last']} (`benchmarks/results/compile_time_xnnpack_scaling.json`): t({per_backend['last']})/"
        f"t({per_backend['first']}) ours {ours:.2f}, stock {stock:.2f} (target <= {SCALING_TARGET}: "
        f"{_met(ours, SCALING_TARGET)}); ours/stock at depth {per_backend['last']} "
        f"{per_backend['depths'][str(per_backend['last'])]['ratio_total']:.2f}.",
    ]


def mlx_decompose_lines(results: dict) -> list[str]:
    """MLX after the node-by-node decomposition, measured on its own, several runs per depth."""
    per_backend = results["backends"]["mlx"]
    depths = per_backend["depths"]
    rows = ", ".join(
        f"depth {depth} {d['ours']['total']:.2f} s / {d['stock']['total']:.2f} s = {d['ratio_total']:.3f}"
        for depth, d in sorted(depths.items(), key=lambda item: int(item[0]))
    )
    last, target = depths[str(per_backend["last"])]["ratio_total"], DEPTH_48_TARGET["mlx"]
    return [
        "",
        f"MLX after the node-by-node decomposition, medians of {results['runs']} runs, ours / stock, each of ours "
        "timed as a process's first compile (no node decompositions remembered) "
        f"(`benchmarks/results/compile_time_mlx_decompose.json`): {rows} (target <= {target}: {_met(last, target)}; "
        "the results' Markdown says what is left); t(48)/t(12) ours "
        f"{per_backend['scaling_ours']:.2f}, stock {per_backend['scaling_stock']:.2f}.",
    ]


def runtime_lines(results: dict, title: str) -> list[str]:
    lines = [
        "",
        f"Run time, {title}: each `.pte` under ExecuTorch's runtime here with its event tracing "
        "(ETDump read by `executorch.devtools.Inspector`), ours and stock's alternately.",
        "",
        "| model | backend | ms ours / stock | ratio | delegate calls ours / stock | CPU share ours / stock |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for row in results["rows"]:
        ours, stock = row["ours"], row["stock"]
        mark = ""
        if row.get("note"):
            notes.append(f"- \\*{row['model']}: {row['note']}")
            mark = "\\*"
        lines.append(
            f"| `{row['model']}`{mark} | {row['backend']} | {ours['median_ms']:.3g} / {stock['median_ms']:.3g} | "
            f"{row['ratio']:.2f}x | {ours['delegate_calls']} / {stock['delegate_calls']} | "
            f"{ours['cpu_share']:.0%} / {stock['cpu_share']:.0%} |"
        )
    if notes:
        lines += ["", *notes]
    return lines


def warm_lines(sweep: dict | None, stage_cache: dict | None) -> list[str]:
    rows = []
    for what, results in (("`python -m compiler sweep` (8 jobs)", sweep), ("`python -m compiler compile`", stage_cache)):
        fresh = (results or {}).get("fresh_cli")
        if not fresh:
            continue
        cold, warm = fresh["cold"]["wall_seconds"], fresh["warm"]["wall_seconds"]
        rows.append(
            f"| {what} | {cold:.1f} | {warm:.2f} | {fresh['warm_over_cold']:.3f} | "
            f"<= {WARM_TARGET}: {_met(fresh['warm_over_cold'], WARM_TARGET)} |"
        )
    if not rows:
        return []
    return [
        "",
        "A warm re-run from a fresh process, against the cold run of the same command "
        "(`benchmarks/results/sweep.json`, `stage_cache.json`):",
        "",
        "| command | cold s | warm s | warm/cold | target |",
        "|---|---|---|---|---|",
        *rows,
    ]


def scale_lines(results: dict) -> list[str]:
    """The real-size table: Llama-shaped checkpoints compiled from their folders, ours and stock."""
    from benchmarks import scale

    return [
        "",
        "Real size: Llama-shaped checkpoints (random weights, bfloat16 `save_pretrained` folders) compiled from the "
        "folder, each cell a process of its own, ours and stock's one after the other (`python -m benchmarks.scale`; "
        "`benchmarks/results/scale.json`).",
        "",
        scale.render(results).strip(),
    ]


def decode_lines(results: dict) -> list[str]:
    """One decode step at real size under ExecuTorch's runtime, against the memory-bandwidth bound."""
    from benchmarks import decode_speed

    return [
        "",
        "Decode speed at real size (`python -m benchmarks.decode_speed`; `benchmarks/results/decode_speed.json`):",
        "",
        decode_speed.render(results["rows"]).strip(),
    ]


def render() -> str:
    lines: list[str] = []
    compile_time = _load("compile_time.json")
    mlx = _load("compile_time_mlx_decompose.json")
    if compile_time:
        alone = {}
        if mlx:
            last = mlx["backends"]["mlx"]["depths"].get("48")
            if last and "ratio_total" in last:
                alone["mlx"] = (last["ratio_total"], "compile_time_mlx_decompose.json")
        lines += compile_time_lines(compile_time, alone)
    scaling = _load("compile_time_xnnpack_scaling.json")
    if scaling:
        lines += scaling_lines(scaling)
    if mlx:
        lines += mlx_decompose_lines(mlx)
    runtime = _load("runtime.json")
    if runtime:
        lines += runtime_lines(runtime, "benchmark models (`benchmarks/results/runtime.json`)")
    policies = _load("runtime_policies.json")
    if policies:
        lines += runtime_lines(policies, "the LeRobot policies, tiny with random weights (`benchmarks/results/runtime_policies.json`)")
    lines += warm_lines(_load("sweep.json"), _load("stage_cache.json"))
    scale = _load("scale.json")
    if scale:
        lines += scale_lines(scale)
    decode = _load("decode_speed.json")
    if decode:
        lines += decode_lines(decode)
    return "\n".join(lines).strip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", help="rewrite the performance-table section of this file (docs/performance.md)")
    args = parser.parse_args()
    text = render()
    if args.doc:
        from compiler.tools.readme import write_file

        write_file(args.doc, SECTION, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
