"""`python -m compiler describe-image`: the built-in tiny LLaVA to one program of the three methods
ExecuTorch's MultimodalRunner calls, `vision_encoder`, `token_embedding` and `text_decoder`; with
`--check` its greedy generation after text, an image and text checked against eager.

Loads no torch until the command runs (`compiler.cli.main` builds every parser at start).
"""

from __future__ import annotations

import argparse

from compiler import backends
from compiler.cli import common


def add_parser(commands, talk: argparse.ArgumentParser) -> None:
    command = commands.add_parser(
        "describe-image", parents=[talk],
        help="a tiny LLaVA (random weights) to one .pte of vision_encoder, token_embedding and text_decoder, "
        "as ExecuTorch's MultimodalRunner calls them",
    )
    command.add_argument("--backend", choices=backends.available(), default="portable", help="default: portable")
    command.add_argument("--tokens", type=int, default=32, help="greedy tokens --check generates (default: 32)")
    command.add_argument("--max-cache-len", type=int, default=64, help="the decoder's KV cache positions (default: 64)")
    command.add_argument("-o", "--output-dir", metavar="DIR", help="write llava.pte and tokenizer.json here")
    command.add_argument(
        "--backend-llm-ops", action="store_true",
        help="the decoder calls the backend's own attention and KV-cache ops (llama:: on portable and XNNPACK, "
        "mlx:: on MLX)",
    )
    command.add_argument(
        "--check", action="store_true",
        help="generate greedily with the program (MultimodalRunner on portable and XNNPACK, the reference executor "
        "on Core ML and MLX) and compare the tokens, every call's logits and the image's embeddings with eager",
    )
    command.add_argument("--tolerance", type=float, help="max abs logit error the check accepts (default: the backend's)")


def run(args: argparse.Namespace, terminal) -> int:
    from compiler.tools import multimodal

    output = common.folder_to_write("-o", args.output_dir) if args.output_dir else None
    job = multimodal.describe_image(
        args.backend, tokens=args.tokens, output_dir=output, check=args.check, max_cache_len=args.max_cache_len,
        tolerance=args.tolerance, backend_llm_ops=args.backend_llm_ops,
    )
    terminal.table(*job.result.report.stage_rows())
    if job.pte_path:
        terminal.say(f"\nwrote {job.pte_path} ({job.pte_path.stat().st_size} bytes) and {job.tokenizer_path}")
    else:
        terminal.say("\nnothing written: give -o DIR to save the program and its tokenizer")
    if job.check is not None:
        terminal.check(job.check)
        return 0 if job.check.passed else 1
    return 0
