"""optimum-executorch against this compiler: the same Llama, two exports, one runner.

    python -m benchmarks.optimum_comparison [--optimum-python /tmp/optimum-venv/bin/python] [--tokens 32]

The tiny built-in Llama (`compiler.models.llm`: two layers of width 64, vocabulary 256, random
weights drawn with seed 0) is saved with `save_pretrained`, so both exporters load the same config
and weights from one folder. optimum-executorch pins another transformers than ours, so it runs in a
venv of its own, called here by subprocess (its `optimum-cli export executorch --recipe xnnpack`,
with and without its custom SDPA and KV cache; `--max_seq_len` the same cache length):

    python3 -m venv /tmp/optimum-venv
    /tmp/optimum-venv/bin/pip install optimum-executorch==1.1.0 torch==2.13.0 executorch==1.5.1

(optimum-executorch 1.1.0 takes torch 2.13.0 and executorch 1.5.1 as ours, with transformers
5.0.0rc1.) Ours is the generation job on the same folder (`compiler.generate(folder, "xnnpack")`),
with the backend's llama:: ops and without, token by token and with the prompt in one call.

Every program is checked the same way (`compiler.tools.generation.check_generation`): greedy
generation through ExecuTorch's TextLLMRunner in this process with one generated tokenizer,
token by token against eager (transformers 5.5 here), every call's logits within tolerance, and the
runner's prefill and decode milliseconds per token (medians of `--repeats` rounds, on 2 shared
cores: compare the rows with each other, not with a device). Results: benchmarks/results/
optimum_comparison.json, and the table in docs/benchmarks.md between its `optimum-comparison-table`
markers (also benchmarks/results/optimum_comparison.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import subprocess
import tempfile
import time

from compiler.tools import readme

SECTION = "optimum-comparison-table"
RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT_PYTHON = "/tmp/optimum-venv/bin/python"
MAX_CACHE_LEN = 64
# Exports of each side: row name -> optimum-cli's flags, or the generation job's options.
OPTIMUM = {
    "optimum-executorch, custom SDPA and KV cache": ["--use_custom_sdpa", "--use_custom_kv_cache"],
    "optimum-executorch, plain": [],
}
OURS = {
    "ours, llama:: ops": {"backend_llm_ops": True},
    "ours, llama:: ops, prompt in one call": {"backend_llm_ops": True, "dynamic_prefill": True},
    "ours, plain": {"backend_llm_ops": False},
}

logger = logging.getLogger(__name__)


def optimum_versions(python: str) -> dict:
    code = (
        "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
        "('optimum-executorch', 'transformers', 'torch', 'executorch')}))"
    )
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def optimum_export(
    python: str, folder: str, flags: list[str], output: str, max_seq_len: int = MAX_CACHE_LEN
) -> tuple[str, float]:
    """The `.pte` optimum-cli writes for the folder's model, and the seconds it took."""
    cli = os.path.join(os.path.dirname(python), "optimum-cli")
    command = [
        cli, "export", "executorch", "--model", folder, "--task", "text-generation", "--recipe", "xnnpack",
        "--max_seq_len", str(max_seq_len), "--output_dir", output, *flags,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"optimum-cli failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return os.path.join(output, "model.pte"), time.perf_counter() - start


def measure(python: str, tokens: int, repeats: int) -> dict:
    import compiler
    from compiler.models import llm
    from compiler.tools import generation

    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(scratch, "tiny-llama")
        llm.text_model("llama", max_cache_len=MAX_CACHE_LEN).hf_model.save_pretrained(folder)
        model = llm.text_model(folder, max_cache_len=MAX_CACHE_LEN)
        for name, flags in OPTIMUM.items():
            try:
                pte, seconds = optimum_export(python, folder, flags, os.path.join(scratch, name.replace(" ", "_")))
                check = generation.check_generation(pte, model, "xnnpack", tokens, repeats=repeats)
                rows[name] = {**check.to_json(), "export_seconds": seconds, "pte_bytes": os.path.getsize(pte)}
            except (RuntimeError, compiler.CompileError) as error:
                rows[name] = {"error": str(error).splitlines()[0]}
            logger.warning("%s: %s", name, rows[name].get("error") or "checked")
        for name, options in OURS.items():
            start = time.perf_counter()
            job = compiler.generate(folder, "xnnpack", max_cache_len=MAX_CACHE_LEN, **options)
            seconds = time.perf_counter() - start
            check = generation.check_generation(job.result, job.model, "xnnpack", tokens, repeats=repeats)
            rows[name] = {
                **check.to_json(), "llm_ops": job.llm_ops, "llm_ops_reason": job.llm_ops_reason,
                "export_seconds": seconds, "pte_bytes": len(job.result.pte),
            }
            logger.warning("%s: checked", name)
    return rows


def table(rows: dict) -> str:
    lines = [
        "| program | tokens equal to eager's (TextLLMRunner) | worst logit error (tolerance) | prefill ms/token "
        "| decode ms/token | .pte KiB | export s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | fails: {row['error'][:100]} | | | | | |")
            continue
        first = row["first_difference"]
        tokens = f"yes, {len(row['eager_tokens'])} of {row['steps']}" if first is None else f"no: step {first}"
        lines.append(
            f"| {name} | {tokens} | {row['worst_logit_error']:.1e} ({row['tolerance']:.0e}) "
            f"| {row['prefill_ms_per_token']:.3f} | {row['decode_ms_per_token']:.3f} | {row['pte_bytes'] / 1024:.0f} "
            f"| {row['export_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimum-python", default=DEFAULT_PYTHON, help=f"the optimum venv's python ({DEFAULT_PYTHON})")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9, help="timed runner rounds per program (medians)")
    parser.add_argument("--doc", default=os.path.join("docs", "benchmarks.md"), help="write the table between its markers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not os.path.exists(args.optimum_python):
        raise SystemExit(f"no {args.optimum_python}: make the optimum venv first (see this module's docstring)")

    import torch
    import transformers

    versions = {
        "optimum venv": optimum_versions(args.optimum_python),
        "ours": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    rows = measure(args.optimum_python, args.tokens, args.repeats)
    text = table(rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "optimum_comparison.json").write_text(json.dumps({"versions": versions, "repeats": args.repeats, "results": rows}, indent=2))
    (RESULTS / "optimum_comparison.md").write_text(text + "\n")
    readme.write_file(args.doc, SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
