"""Real-size compiles: Llama-shaped checkpoints compiled from their folders, ours and stock in one run.

    python -m benchmarks.scale [--sizes 0.5b 1b 3b 8b] [--cells xnnpack:float xnnpack:8da4w coreml:4w mlx:4w]
                               [--ways ours stock] [--check] [--external-weights] [--quantize-embedding 4w]
                               [--folders DIR] [--merge]
                               [--json benchmarks/results/scale.json] [--markdown benchmarks/results/scale.md]

Each size is written once as a `save_pretrained` folder (random weights, bfloat16, as checkpoints
ship) under `--folders`. Each cell (size x backend x scheme x way) runs in a process of its own,
one at a time, which loads the folder and compiles the text-generation step (its static KV cache of
`CACHE` positions): ours with `compiler.compile` (stage cache off) from the checkpoint mapped,
stock the way its documentation does it, read with `from_pretrained` and cast to float32 (`torch.export` +
`to_edge_transform_and_lower(ep, [<backend's partitioner>])` + `to_executorch()`, written with
`write_to_file`) or, for a quantized cell, ExecuTorch's recipe for the scheme
(`executorch.export.export`). The parent reads the child's peak resident set from the kernel
(`wait4`'s `ru_maxrss`: loading included) and its wall time; the child reports what it held
after loading, the program's sizes and, with `--check`, the check against eager. A child the
kernel kills says so, with the peak it reached. "bound" is 1.5 GB plus half the bytes of the
weights the program holds (its files' sizes): what ours keeps to at every size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "scale.json")
DEFAULT_MARKDOWN = os.path.join(HERE, "results", "scale.md")
DEFAULT_FOLDERS = os.path.join(os.path.expanduser("~"), ".cache", "staged-compiler", "scale")

# Llama-shaped sizes: the 0.5B is Qwen2.5-0.5B's shape, 1B and 3B Llama 3.2's (tied embeddings).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=256, layers=4, intermediate=704, heads=4, kv_heads=2, vocab=4096),
    "0.1b": dict(hidden=768, layers=8, intermediate=2048, heads=12, kv_heads=4, vocab=32000),
    "0.25b": dict(hidden=1024, layers=20, intermediate=2816, heads=16, kv_heads=4, vocab=32000),
    "0.5b": dict(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, vocab=151936),
    "1b": dict(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, vocab=128256),
    "3b": dict(hidden=3072, layers=28, intermediate=8192, heads=24, kv_heads=8, vocab=128256),
    # Llama 3.1 8B's shape: its lm_head is a weight of its own.
    "8b": dict(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256, tied=0),
}
CELLS = ("xnnpack:float", "xnnpack:8da4w", "coreml:float", "coreml:4w", "mlx:float", "mlx:4w")
CACHE = 128
GROUP_SIZE = 32
GB = 1e9
# The bound a compile from a checkpoint keeps to: its peak at most this much plus this many times the
# bytes of the weights the program holds.
BOUND_FIXED = int(1.5e9)
BOUND_PER_WEIGHT = 0.5


def _config(size: str):
    from transformers import LlamaConfig

    shape = SIZES[size]
    return LlamaConfig(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
        max_position_embeddings=4096, tie_word_embeddings=bool(shape.get("tied", 1)), bos_token_id=1, eos_token_id=2,
        dtype="bfloat16",
    )


def parameters(size: str) -> int:
    """Parameters of a size's model (tied embeddings counted once)."""
    s = SIZES[size]
    head = s["hidden"] // s["heads"]
    attention = 2 * s["hidden"] * s["hidden"] + 2 * s["hidden"] * s["kv_heads"] * head
    block = attention + 3 * s["hidden"] * s["intermediate"] + 2 * s["hidden"]
    return s["layers"] * block + (1 + (not s.get("tied", 1))) * s["vocab"] * s["hidden"] + s["hidden"]


def write_folder(size: str, folders: str) -> str:
    """The size's checkpoint folder, written once (random weights, bfloat16), as `save_pretrained`
    writes a large model: shards of at most `SHARD_BYTES` and their index. The model is built on
    the meta device and each weight drawn as it is written (N(0, 0.02), norms at 1), so an 8B
    folder is written with one shard in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    folder = os.path.join(folders, f"llama-{size}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(folder + ".tmp", exist_ok=True)
    config = _config(size)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied weight once
    shards: list[list[str]] = [[]]
    size_now = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size_now + nbytes > SHARD_BYTES:
            shards.append([])
            size_now = 0
        shards[-1].append(name)
        size_now += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            name: (torch.ones(shapes[name]) if name.endswith("norm.weight") else
                   torch.randn(shapes[name], generator=generator).mul_(0.02)).to(torch.bfloat16)
            for name in names
        }
        save_file(tensors, os.path.join(folder + ".tmp", file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    total = sum(2 * math.prod(shape) for shape in shapes.values())
    with open(os.path.join(folder + ".tmp", "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(folder + ".tmp")
    os.replace(folder + ".tmp", folder)
    return folder


# A shard of a written folder holds at most this many bytes (save_pretrained's default is 5 GB).
SHARD_BYTES = 2 << 30


# --- one cell, in a process of its own ---------------------------------------------------


def _resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _peak() -> int:
    """The process's resident high-water mark so far (loading and compiling; the check comes after)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _ours(cell: dict, step, inputs, shapes) -> dict:
    import compiler

    options: dict[str, Any] = {"cache": False}
    if cell["scheme"] != "float":
        options |= {"quantize": cell["scheme"], "quantize_group_size": GROUP_SIZE}
    if cell.get("embedding"):
        options["quantize_embedding"] = cell["embedding"]
    if cell["external"]:
        options["external_weights"] = True
    start = time.perf_counter()
    result = compiler.compile(step, inputs, cell["backend"], dynamic_shapes=shapes, **options)
    written = result.save(cell["output"])
    out = {
        "compile_s": time.perf_counter() - start,  # the check after it is not the compile's
        "compile_alone": True,
        "compile_peak_rss": _peak(),
        "pte_bytes": os.path.getsize(written[0]),
        "ptd_bytes": os.path.getsize(written[1]) if len(written) > 1 else None,
        "stage_peaks": {r.stage: r.peak_rss_bytes for r in result.report.stages},
        "compile_peak_anonymous": max((r.peak_anonymous_bytes or 0 for r in result.report.stages), default=0) or None,
        "stage_seconds": {r.stage: r.seconds + r.verify_seconds for r in result.report.stages},
    }
    if cell["check"]:
        check = compiler.compare_with_eager(result, step, inputs)
        out["check"] = {"passed": check.passed, "max_abs_error": check.max_abs_error,
                        "tolerance": check.tolerance.absolute}
        if check.at_float32 is not None:
            out["check"]["float32"] = {"passed": check.at_float32.passed, "max_abs_error": check.at_float32.max_abs_error,
                                       "tolerance": check.at_float32.tolerance.absolute}
        elif check.float32_skipped:
            out["check"]["float32_skipped"] = check.float32_skipped
    return out


# ExecuTorch's recipe for a float program on each backend (MLX has none).
FLOAT_RECIPES = {"xnnpack": "xnnpack_fp32", "coreml": "coreml_fp16"}


def _stock_recipe(backend: str, scheme: str) -> str | None:
    """ExecuTorch's recipe (`RecipeType` value) for the cell, None where it has none."""
    if scheme == "float":
        return FLOAT_RECIPES.get(backend)
    from compiler.stages import schemes

    chosen = schemes.BY_NAME[scheme]
    return chosen.recipe(backend, chosen.default_granularity(backend))


def _stock(cell: dict, step, inputs, shapes) -> dict:
    """ExecuTorch's recipe for the cell (`executorch.export.export`), or for a backend without
    recipes, `to_edge_transform_and_lower` with its partitioner. The model is compiled in float32,
    as ExecuTorch's LLM export does for these backends (its bfloat16 paths fail: Core ML's
    `KeyError: torch.bfloat16`, XNNPACK's recipe leaves TorchAO's bfloat16 quantize ops without kernels);
    it is cast in place: the static cache's layers hold its key and value tensors too."""
    import importlib

    import torch

    for tensor in [*step.parameters(), *step.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.float()
    name = _stock_recipe(cell["backend"], cell["scheme"])
    if name is not None:
        from executorch.export import ExportRecipe, export, recipe_registry

        package = "apple.coreml" if cell["backend"] == "coreml" else cell["backend"]
        importlib.import_module(f"executorch.backends.{package}.recipes")
        (kind,) = (t for t in recipe_registry.get_supported_recipes(cell["backend"]) if t.value == name)
        options = {"group_size": GROUP_SIZE} if cell["scheme"] != "float" else {}
        session = export(step, [inputs], export_recipe=ExportRecipe.get_recipe(kind, **options))
        manager = session.get_executorch_program_manager()
    elif cell["scheme"] == "float":
        from executorch.exir import to_edge_transform_and_lower

        from benchmarks.compile_time import stock_partitioner

        program = torch.export.export(step, inputs, dynamic_shapes=shapes, strict=False)
        manager = to_edge_transform_and_lower(program, partitioner=[stock_partitioner(cell["backend"])]).to_executorch()
    else:
        return {"status": "no recipe", "error": f"ExecuTorch has no {cell['scheme']} recipe for {cell['backend']}"}
    with open(cell["output"], "wb") as f:
        manager.write_to_file(f)
    return {"compile_peak_rss": _peak(), "recipe": name, "pte_bytes": os.path.getsize(cell["output"]), "ptd_bytes": None}


def run_cell(cell: dict) -> dict:
    """Load the folder and compile one way; what the parent cannot see from outside."""
    _quiet()
    import torch

    import executorch.exir  # noqa: F401 - the libraries' fixed cost, before any weight
    import transformers  # noqa: F401

    import compiler.stages  # noqa: F401
    from compiler.models.checkpoint import load_checkpoint

    if cell["way"] == "stock":  # stock reads the folder as its users do: every weight into memory
        from compiler.models import mapped_checkpoint

        mapped_checkpoint.mapped_model = lambda *args, **kwargs: None
    fixed = _resident()
    start = time.perf_counter()
    step, inputs, shapes = load_checkpoint(cell["folder"], "text-generation", max_cache_len=CACHE)
    loaded = {"load_s": time.perf_counter() - start, "rss_libraries": fixed, "rss_after_load": _resident()}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            done = (_ours if cell["way"] == "ours" else _stock)(cell, step, inputs, shapes)
    except Exception as exc:
        done = {"status": "fails", "error": _first_line(exc)}
    return loaded | {"status": "ok", "compile_s": time.perf_counter() - start} | done  # ours times its own


# --- the parent ---------------------------------------------------------------------------


def child_result(module: str, flag: str, payload: dict, timeout: float, address_space: int | None = None
                 ) -> tuple[dict | None, int, int, bool]:
    """Run `python -m module flag JSON` in a process of its own: its last JSON line (None without
    one), its peak resident bytes from the kernel (`wait4`), its wait status, and whether it ran
    out of time (then it was killed). `address_space`: the child's limit (`RLIMIT_AS`), so a
    compile that cannot fit fails on an allocation instead of the kernel killing it."""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", module, flag, json.dumps(payload)],
            stdout=out, stderr=subprocess.DEVNULL, cwd=os.path.dirname(HERE),
            preexec_fn=limited if address_space else None,
        )
        deadline = time.perf_counter() + timeout
        timed_out = False
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                pid, status, usage = os.wait4(child.pid, 0)
                timed_out = True
                break
            time.sleep(0.5)
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), usage.ru_maxrss * 1024, status, timed_out


# Stock's cells run with their address space limited to this (its float copies of an 8B model do
# not fit; ours maps its weights, so its address space is far above what it holds, and is not limited).
STOCK_ADDRESS_SPACE = 22 << 30


def measure(cell: dict, timeout: float) -> dict:
    """Run one cell in a child process; its peak resident set and wall time from the kernel."""
    start = time.perf_counter()
    limit = STOCK_ADDRESS_SPACE if cell["way"] == "stock" else None
    result, peak, status, timed_out = child_result("benchmarks.scale", "--run-cell", cell, timeout, limit)
    row = (result or {}) | {"peak_rss": peak, "wall_s": time.perf_counter() - start}
    if os.WIFSIGNALED(status):
        reason = "timed out" if timed_out else "killed"
        row |= {"status": reason, "error": f"{reason} at {peak / GB:.1f} GB (signal {os.WTERMSIG(status)})"}
    elif result is None:
        row |= {"status": "fails", "error": f"exited {os.WEXITSTATUS(status)} without a result"}
    return row


def held_weights(size: str, scheme: str) -> int:
    """Bytes of the weights a program holds: float32 for a float program (what XNNPACK, Core ML's
    default and MLX compute in from a bfloat16 checkpoint here), about 4.5 bits a weight for a
    4-bit scheme's linears plus the float32 embedding."""
    s = SIZES[size]
    embedding = s["vocab"] * s["hidden"]
    rest = parameters(size) - embedding
    if scheme == "float":
        return 4 * parameters(size)
    return int(rest * (0.5 + 4 / GROUP_SIZE)) + 4 * embedding


def render(results: dict) -> str:
    header = ["size", "backend", "scheme", "way", "status", "peak GB", "own GB", "bound GB", "peak with check GB", "load s",
              "compile s",
              "quantize stage s (vs float compile)", "ours/stock compile", ".pte MB", ".ptd MB", "check"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = results["rows"]
    for row in rows:
        # The program's own bytes where it was written (its weights are nearly all of it), else the estimate.
        weights = (row.get("pte_bytes") or 0) + (row.get("ptd_bytes") or 0) or held_weights(row["size"], row["scheme"])
        peak = row.get("compile_peak_rss") or row.get("peak_rss")
        bound = BOUND_FIXED + BOUND_PER_WEIGHT * weights
        anonymous = row.get("compile_peak_anonymous")
        stock = next((r for r in rows if r["way"] == "stock" and all(r[k] == row[k] for k in ("size", "backend", "scheme"))), None)
        ratio = (row["compile_s"] / stock["compile_s"] if row["way"] == "ours" and row["status"] == "ok" and stock
                 and stock["status"] == "ok" and (row.get("compile_alone") or not row.get("check")) else None)
        check = row.get("check")
        scheme = row["scheme"] + (f" ({row['embedding']} embedding)" if row.get("embedding") else "")
        cells = [
            row["size"], row["backend"], scheme, row["way"],
            row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}",
            f"{peak / GB:.2f}" if peak else "-", f"{anonymous / GB:.2f}" if anonymous else "-",
            _bound_text(row, peak, bound),
            f"{row['peak_rss'] / GB:.2f}" if row.get("check") else "-",
            f"{row['load_s']:.0f}" if "load_s" in row else "-",
            (f"{row['compile_s']:.0f}" + ("*" if row.get("check") and not row.get("compile_alone") else ""))
            if "compile_s" in row else "-",
            _quantize_stage_text(row, rows),
            f"{ratio:.2f}" if ratio is not None else "-",
            f"{row['pte_bytes'] / 1e6:.0f}" if row.get("pte_bytes") else "-",
            f"{row['ptd_bytes'] / 1e6:.0f}" if row.get("ptd_bytes") else "-",
            ("passed" if check["passed"] else "FAILED") + f" {check['max_abs_error']:.1e} ({check['tolerance']:.0e})"
            + _float32_text(check)
            if check else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "Peak: the process's resident high-water mark through loading the folder and compiling (`VmHWM` after the "
        "program is written; with the check after it, `ru_maxrss`: the eager reference is a copy of the model in "
        "the precision the program computes in). Compile: from the "
        "model in memory to the program written (ours: `compiler.compile` and `save`; stock: the recipe's export or "
        "`to_edge_transform_and_lower` and `write_to_file`), the folder's loading apart. Own: the highest of the "
        "stages' sampled peaks of the process's own (anonymous) memory, the resident set less mapped files' pages. "
        f"Bound: {BOUND_FIXED / GB:g} GB + {BOUND_PER_WEIGHT:g}x the bytes of the weights the program holds (the "
        "written .pte and .ptd; an estimate for a program not written), what ours must stay within. Stock reads the "
        "folder with `from_pretrained`, ours maps it; stock's cells run with their address space limited to "
        f"{STOCK_ADDRESS_SPACE / 2**30:.0f} GiB, so one that cannot fit fails on an allocation. A row whose bound reads "
        "'before streaming' was measured with the code of issue 54, which held every weight. Cells ran one at a time on "
        f"{os.cpu_count()} cores. A compile time marked * includes the check after it (measured before the "
        "benchmark timed the compile alone); it has no ratio.",
    ]
    return "\n".join(lines + notes) + "\n"


def _bound_text(row: dict, peak: int | None, bound: int) -> str:
    """Whether our row kept to the bound; a row measured before the weights streamed (it has no
    own peak) says so instead."""
    if row["way"] != "ours" or not peak or row["status"] != "ok":
        return "-"
    if "compile_peak_anonymous" not in row:
        return "before streaming"
    return f"{bound / GB:.2f}" + (": met" if peak <= bound else ": over")


def _quantize_stage_text(row: dict, rows: list[dict]) -> str:
    """Our quantize stage's own seconds, against our float compile of the same size and backend
    (issue 42's bound: at most 1x)."""
    seconds = row.get("stage_seconds", {}).get("quantize")
    if row["scheme"] == "float" or seconds is None:
        return "-"
    base = next((r for r in rows if r["way"] == "ours" and r["scheme"] == "float" and r["status"] == "ok"
                 and r["size"] == row["size"] and r["backend"] == row["backend"]), None)
    return f"{seconds:.1f}" + (f" ({seconds / base['compile_s']:.2f}x)" if base else "")


def _float32_text(check: dict) -> str:
    """The Core ML check's float32 re-check: its figures, or that it did not fit."""
    if "float32" in check:
        again = check["float32"]
        return f"; float32: {'passed' if again['passed'] else 'FAILED'} {again['max_abs_error']:.1e} ({again['tolerance']:.0e})"
    return "; float32: not run (memory)" if check.get("float32_skipped") else ""


def _cell_key(row: dict) -> tuple:
    return row["size"], row["backend"], row["scheme"], row.get("embedding"), row["way"]


def _order(row: dict) -> tuple:
    cell = f"{row['backend']}:{row['scheme']}"
    return (CELLS.index(cell) if cell in CELLS else len(CELLS), row["way"] != "ours")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5b", "1b", "3b"], choices=list(SIZES))
    parser.add_argument("--cells", nargs="+", default=list(CELLS), metavar="BACKEND:SCHEME")
    parser.add_argument("--ways", nargs="+", default=["ours", "stock"], choices=["ours", "stock"])
    parser.add_argument("--check", action="store_true", help="check each of our programs against eager")
    parser.add_argument("--external-weights", action="store_true", help="ours writes its weights to a .ptd")
    parser.add_argument("--quantize-embedding", help="ours quantizes embedding tables by this scheme in quantized cells")
    parser.add_argument("--folders", default=DEFAULT_FOLDERS)
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN)
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of --json that this run does not measure again (a cell re-run alone)")
    parser.add_argument("--run-cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_cell:
        print(json.dumps(run_cell(json.loads(args.run_cell))), flush=True)
        return
    rows = []
    outputs = tempfile.mkdtemp(prefix="scale-")
    for size in args.sizes:
        folder = write_folder(size, args.folders)
        for spec in args.cells:
            backend, scheme = spec.split(":")
            for way in args.ways:
                cell = {"size": size, "backend": backend, "scheme": scheme, "way": way, "folder": folder,
                        "output": os.path.join(outputs, f"{size}-{backend}-{scheme}-{way}.pte"),
                        "check": args.check and way == "ours", "external": args.external_weights and way == "ours",
                        "embedding": args.quantize_embedding if way == "ours" and scheme != "float" else None}
                row = {k: cell[k] for k in ("size", "backend", "scheme", "way", "embedding", "external")}
                row |= measure(cell, args.timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
                for name in os.listdir(outputs):
                    os.remove(os.path.join(outputs, name))
    if args.merge and os.path.exists(args.json):
        with open(args.json) as f:
            kept = json.load(f)["rows"]
        measured = {_cell_key(row) for row in rows}
        rows = [row for row in kept if _cell_key(row) not in measured] + rows
        rows.sort(key=lambda row: (list(SIZES).index(row["size"]), _order(row)))
    sizes = sorted({row["size"] for row in rows}, key=list(SIZES).index)
    results = {"rows": rows, "parameters": {size: parameters(size) for size in sizes}}
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
