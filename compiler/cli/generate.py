"""`python -m compiler generate MODEL`: a causal LM to a program and a tokenizer ExecuTorch's
`TextLLMRunner` loads, and with `--check` its greedy generation checked against eager.

Loads no torch until the command runs (`compiler.cli.main` builds every parser at start).
"""

from __future__ import annotations

import argparse

from compiler import backends
from compiler.cli import common


def add_parser(commands, talk: argparse.ArgumentParser) -> None:
    command = commands.add_parser(
        "generate", parents=[talk],
        help="a Hugging Face causal LM (llama, qwen3, gemma: tiny, random weights; or a save_pretrained folder) "
        "to a .pte and a tokenizer.json that ExecuTorch's TextLLMRunner loads",
    )
    command.add_argument("model", help="llama, qwen3 or gemma (built-in tiny configs), or a save_pretrained folder")
    command.add_argument("--backend", choices=backends.available(), default="portable", help="default: portable")
    command.add_argument("--tokens", type=int, default=32, help="greedy tokens --check generates (default: 32)")
    command.add_argument(
        "--max-cache-len", type=int, default=64, help="the KV cache's positions: prompt and generated tokens (default: 64)"
    )
    command.add_argument(
        "--prompt", help="the prompt, in the generated tokenizer's pieces t0 .. t<vocab-1> separated by spaces "
        "(default: eight tokens)",
    )
    command.add_argument(
        "--dynamic-prefill", action="store_true",
        help="calls take any number of tokens (enable_dynamic_shape): the runner prefills the prompt in one call, "
        "not token by token",
    )
    command.add_argument(
        "--no-backend-llm-ops", dest="backend_llm_ops", action="store_false", default=None,
        help="keep torch's attention and KV-cache update instead of the backend's own LLM ops (XNNPACK and "
        "portable: ExecuTorch's llama::update_cache and llama::custom_sdpa; MLX: mlx::kv_cache_update and "
        "mlx::custom_sdpa), which are chosen where the backend has them",
    )
    command.add_argument("-o", "--output-dir", metavar="DIR", help="write <model>.pte and tokenizer.json here")
    command.add_argument(
        "--check", action="store_true",
        help="generate greedily with the program (TextLLMRunner on portable and XNNPACK, the reference executor on "
        "Core ML and MLX) and compare token by token and every step's logits with eager",
    )
    command.add_argument("--tolerance", type=float, help="max abs logit error the check accepts (default: the backend's)")


def run(args: argparse.Namespace, terminal) -> int:
    from compiler.cli.live_progress import LiveProgress
    from compiler.tools import generation

    output = common.folder_to_write("-o", args.output_dir) if args.output_dir else None
    instruments = [LiveProgress(terminal.err, terminal.live)] if terminal.verbosity >= 0 else []
    prompt = {"prompt": args.prompt} if args.prompt else {}
    job = generation.generate(
        args.model, args.backend, tokens=args.tokens, output_dir=output, check=args.check,
        max_cache_len=args.max_cache_len, tolerance=args.tolerance, dynamic_prefill=args.dynamic_prefill,
        backend_llm_ops=args.backend_llm_ops, instruments=instruments, **prompt,
    )
    terminal.table(*job.result.report.stage_rows())
    terminal.say(f"\nLLM ops: {job.llm_ops_reason}")
    if job.pte_path:
        terminal.say(f"\nwrote {job.pte_path} ({job.pte_path.stat().st_size} bytes) and {job.tokenizer_path}")
    else:
        terminal.say("\nnothing written: give -o DIR to save the program and its tokenizer")
    if job.check is not None:
        terminal.check(job.check)
        return 0 if job.check.passed else 1
    return 0
