"""The text-generation table: each built-in LM on every backend, generating greedily.

    python -m benchmarks.generation [--models llama qwen3 gemma] [--backends ...] [--tokens 32]

For each built-in tiny LM (`compiler.models.llm.BUILT_IN`: Llama, Qwen3 and Gemma layouts,
random weights) and backend it runs the generation job (`compiler.generate(..., check=True)`):
the `.pte` with TextLLMRunner's metadata methods and its tokenizer, greedy generation of
`--tokens` tokens (through TextLLMRunner on portable and XNNPACK, the reference executor on
Core ML and MLX) compared token by token with eager, the worst logit error over every call,
and on XNNPACK the runner's prefill and decode milliseconds per token (its `prefill` and
`generate` timed here, medians of three rounds; on 2 shared cores, so a guide, not a
measurement of a device), also for a program whose calls take any
number of tokens (`dynamic_prefill`: the runner prefills the prompt in one call). Each backend with
LLM ops of its own (`compiler.models.llm_ops`: ExecuTorch's `llama::` ops on portable and XNNPACK,
MLX's `mlx::` ops) has an LM row with them and one without (torch's attention and cache update).
The tiny Whisper
(`compiler.tools.transcription`) is one program of two methods, `encoder` and `text_decoder`, sharing
the cross-attention cache: greedy decoding run by ExecuTorch's runtime (portable, XNNPACK) or the
reference executor, each call's logits against eager; on XNNPACK its times are ExecuTorch's runtime's
for the ASR runner's calls (the pip wheel has no ASR runner binary): the `encoder` call, which is that
runner's prefill (it prefills no tokens), in the prefill column as a whole call, and the `text_decoder`
calls per token. The tiny LLaVA (`compiler.tools.multimodal`) is one
program of `vision_encoder`, `token_embedding` and `text_decoder`, run by ExecuTorch's MultimodalRunner
(portable, XNNPACK) or the reference executor after a prompt of text, an image and text; its times are over
the runner's own Stats intervals and token counts (the prompt's 23 positions, the image's 16 among them).
Cells merge by key into
benchmarks/results/generation.json; the table between the `generation-table` markers of docs/generation.md
is rendered from every cell held (tests/test_generation.py checks it is the committed results').
Light to import: torch loads only when it measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from compiler.tools import readme

SECTION = "generation-table"
# The encoder-decoder: a program of two methods (compiler.tools.transcription), not a TextLLMRunner one.
SPEECH = "whisper"
# The vision-language model: MultimodalRunner's three methods (compiler.tools.multimodal).
VISION = "llava"
MODELS = ("llama", "qwen3", "gemma", SPEECH, VISION)
# Each column: the backend and the job's options (also programs whose calls take the whole prompt,
# which the runner prefills in one call).
PLAIN = {"backend_llm_ops": False}  # torch's attention and cache update
OWN_OPS = {"backend_llm_ops": True}  # the backend's own LLM ops (compiler.models.llm_ops)
BACKENDS = {
    "portable": ("portable", PLAIN),
    "portable, llama:: ops": ("portable", OWN_OPS),
    "xnnpack": ("xnnpack", PLAIN),
    "xnnpack, llama:: ops": ("xnnpack", OWN_OPS),
    "xnnpack, prompt in one call": ("xnnpack", {"dynamic_prefill": True, **PLAIN}),
    "xnnpack, llama:: ops, prompt in one call": ("xnnpack", {"dynamic_prefill": True, **OWN_OPS}),
    "coreml": ("coreml", {}),
    "coreml, prompt in one call": ("coreml", {"dynamic_prefill": True}),
    "mlx": ("mlx", PLAIN),
    "mlx, prompt in one call": ("mlx", {"dynamic_prefill": True, **PLAIN}),
    "mlx, mlx:: ops": ("mlx", OWN_OPS),
    "mlx, mlx:: ops, prompt in one call": ("mlx", {"dynamic_prefill": True, **OWN_OPS}),
}
RESULTS = os.path.join(os.path.dirname(__file__), "results", "generation.json")


def measure(model: str, column: str, tokens: int) -> dict:
    import compiler

    backend, options = BACKENDS[column]
    start = time.perf_counter()
    try:
        if model == SPEECH:
            from compiler.tools.transcription import transcribe

            options = {key: value for key, value in options.items() if key != "backend_llm_ops"}
            job = transcribe(backend, tokens=tokens, check=True, max_cache_len=64, **options)
        elif model == VISION:
            from compiler.tools.multimodal import describe_image

            job = describe_image(backend, tokens=tokens, check=True, max_cache_len=64, **options)
        else:
            job = compiler.generate(model, backend, tokens=tokens, check=True, max_cache_len=64, **options)
    except compiler.CompileError as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {**job.check.to_json(), "seconds": time.perf_counter() - start}


def _tokens(cell: dict) -> str:
    if cell["first_difference"] is None:
        eos = " (EOS)" if len(cell["eager_tokens"]) < cell["steps"] else ""
        return f"yes, {len(cell['eager_tokens'])} of {cell['steps']}{eos}"
    return f"no: step {cell['first_difference']}"


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _prefill(cell: dict) -> str:
    """The prefill column: per prompt token, or Whisper's encoder call whole (its runner prefills no tokens)."""
    if cell.get("encoder_ms") is not None:
        return f"{cell['encoder_ms']:.2f} (the encoder call)"
    return _milliseconds(cell.get("prefill_ms_per_token"))


def table(results: dict) -> str:
    lines = [
        "| model | backend | methods in the .pte | tokens equal to eager's | by | worst logit error (tolerance) "
        "| XNNPACK prefill ms/token | XNNPACK decode ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in (m for m in MODELS if m in results):
        for backend in (b for b in BACKENDS if b in results[model]):
            cell = results[model][backend]
            if "error" in cell:
                lines.append(f"| {model} | {backend} | fails: {cell['error'][:80]} | | | | | |")
                continue
            methods = cell.get("program_methods", ["forward"])
            metadata = len(cell["methods"]) - len(methods)
            on_xnnpack = BACKENDS[backend][0] == "xnnpack"
            lines.append(
                f"| {model} | {backend} | {' + '.join(methods)} + {metadata} metadata | {_tokens(cell)} | {cell['runner']} "
                f"| {cell['worst_logit_error']:.1e} ({cell['tolerance']:.0e}) "
                f"| {_prefill(cell) if on_xnnpack else '-'} "
                f"| {_milliseconds(cell['decode_ms_per_token'] if on_xnnpack else None)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default=RESULTS, help=f"merge the cells into this file (default: {RESULTS})")
    parser.add_argument("--doc", default="docs/generation.md", help="write the table between its generation-table markers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    results: dict = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)["results"]
    for model in args.models:
        for backend in args.backends:
            options = BACKENDS[backend][1]
            if model == SPEECH and (options.get("dynamic_prefill") or options.get("backend_llm_ops")):
                continue  # its decoder takes one token a call, and its attention is its own
            if model == VISION and options.get("dynamic_prefill"):
                continue  # the runner prefills each input in one call anyway
            cell = measure(model, backend, args.tokens)
            results.setdefault(model, {})[backend] = cell
            print(f"{model} {backend}: {table({model: {backend: cell}}).splitlines()[-1]}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "results": results}, f, indent=2)
    text = table(results)
    print(text)
    readme.write_file(args.doc, SECTION, text)


if __name__ == "__main__":
    main()
