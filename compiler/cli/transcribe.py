"""`python -m compiler transcribe`: the built-in tiny Whisper to one program of two methods,
`encoder` and `text_decoder` (ExecuTorch's ASR runner's), sharing the cross-attention cache; with
`--check` its greedy decoding checked against eager.

Loads no torch until the command runs (`compiler.cli.main` builds every parser at start).
"""

from __future__ import annotations

import argparse

from compiler import backends
from compiler.cli import common


def add_parser(commands, talk: argparse.ArgumentParser) -> None:
    command = commands.add_parser(
        "transcribe", parents=[talk],
        help="a tiny Whisper (random weights) to one .pte of two methods, encoder and text_decoder, sharing "
        "the cross-attention cache, as ExecuTorch's ASR runner calls them",
    )
    command.add_argument("--backend", choices=backends.available(), default="portable", help="default: portable")
    command.add_argument("--tokens", type=int, default=32, help="greedy tokens --check decodes (default: 32)")
    command.add_argument(
        "--max-cache-len", type=int, default=64, help="the decoder's self-attention cache positions (default: 64)"
    )
    command.add_argument("-o", "--output-dir", metavar="DIR", help="write whisper.pte here")
    command.add_argument(
        "--check", action="store_true",
        help="decode greedily with the program (ExecuTorch's runtime on portable and XNNPACK, the reference "
        "executor on Core ML and MLX) and compare the tokens, the encoder's output and every step's logits with eager",
    )
    command.add_argument("--tolerance", type=float, help="max abs logit error the check accepts (default: the backend's)")


def run(args: argparse.Namespace, terminal) -> int:
    from compiler.tools import transcription

    output = common.folder_to_write("-o", args.output_dir) if args.output_dir else None
    job = transcription.transcribe(
        args.backend, tokens=args.tokens, output_dir=output, check=args.check, max_cache_len=args.max_cache_len,
        tolerance=args.tolerance,
    )
    terminal.table(*job.result.report.stage_rows())
    if job.pte_path:
        terminal.say(f"\nwrote {job.pte_path} ({job.pte_path.stat().st_size} bytes)")
    else:
        terminal.say("\nnothing written: give -o DIR to save the program")
    if job.check is not None:
        terminal.check(job.check)
        return 0 if job.check.passed else 1
    return 0
