"""The generation jobs: `generate MODEL` (a causal LM and its tokenizer for ExecuTorch's
TextLLMRunner), `transcribe` (a tiny Whisper's encoder and decoder for its ASR runner) and
`describe-image` (a tiny LLaVA for its MultimodalRunner); with `--check` each generates greedily
with the program and compares with eager. They share one parent parser of flags.

Loads no torch until a command runs (`compiler.cli.main` builds every parser at start).
"""

from __future__ import annotations

import argparse

from compiler.cli import common, flags

CHECK_HELP = (
    "generate greedily with the program (ExecuTorch's runner where the pip runtime has the backend's delegate, "
    "else the reference executor) and compare the tokens and every call's logits with eager"
)


def _job_flags() -> argparse.ArgumentParser:
    """The flags every generation job takes."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--tokens", type=int, default=32, help="greedy tokens --check generates (default: 32)")
    parent.add_argument(
        "--max-cache-len", type=int, default=64, help="the KV cache's positions: prompt and generated tokens (default: 64)"
    )
    parent.add_argument("-o", "--output-dir", metavar="DIR", help="write the program (and its tokenizer) here")
    parent.add_argument("--check", action="store_true", help=CHECK_HELP)
    parent.add_argument("--tolerance", type=float, help="max abs logit error the check accepts (default: the backend's)")
    return parent


def add_parsers(commands, talk: argparse.ArgumentParser) -> None:
    parents = [talk, flags.backend_flags(), _job_flags()]
    generate = commands.add_parser(
        "generate", parents=parents,
        help="a Hugging Face causal LM (llama, qwen3, gemma: tiny, random weights; or a save_pretrained folder) "
        "to a .pte and a tokenizer.json that ExecuTorch's TextLLMRunner loads",
    )
    generate.add_argument("model", help="llama, qwen3 or gemma (built-in tiny configs), or a save_pretrained folder")
    generate.add_argument(
        "--prompt", help="the prompt, in the generated tokenizer's pieces t0 .. t<vocab-1> separated by spaces "
        "(default: eight tokens)",
    )
    generate.add_argument(
        "--dynamic-prefill", action="store_true",
        help="calls take any number of tokens (enable_dynamic_shape): the runner prefills the prompt in one call, "
        "not token by token",
    )
    generate.add_argument(
        "--no-backend-llm-ops", dest="backend_llm_ops", action="store_false", default=None,
        help="keep torch's attention and KV-cache update instead of the backend's own LLM ops (ExecuTorch's "
        "llama:: ops on the CPU, MLX's mlx:: ops), which are chosen where the backend has them",
    )
    commands.add_parser(
        "transcribe", parents=parents,
        help="a tiny Whisper (random weights) to one .pte of two methods, encoder and text_decoder, sharing "
        "the cross-attention cache, as ExecuTorch's ASR runner calls them",
    )
    describe = commands.add_parser(
        "describe-image", parents=parents,
        help="a tiny LLaVA (random weights) to one .pte of vision_encoder, token_embedding and text_decoder, "
        "as ExecuTorch's MultimodalRunner calls them",
    )
    describe.add_argument(
        "--backend-llm-ops", action="store_true",
        help="the decoder calls the backend's own attention and KV-cache ops (ExecuTorch's llama:: ops on the "
        "CPU, MLX's mlx:: ops)",
    )


def run(args: argparse.Namespace, terminal) -> int:
    from compiler.tools import generation, multimodal, transcription

    output = common.folder_to_write("-o", args.output_dir) if args.output_dir else None
    given = dict(
        tokens=args.tokens, output_dir=output, check=args.check, max_cache_len=args.max_cache_len,
        tolerance=args.tolerance, backend_options=common.backend_options(args.backend_option) or None,
        instruments=terminal.instruments(),
    )
    with terminal.captured(args.command):  # the stages keep their own; this keeps the rest (tokenizers, ...)
        if args.command == "generate":
            prompt = {"prompt": args.prompt} if args.prompt else {}
            job = generation.generate(args.model, args.backend, dynamic_prefill=args.dynamic_prefill,
                                      backend_llm_ops=args.backend_llm_ops, **given, **prompt)
        elif args.command == "transcribe":
            job = transcription.transcribe(args.backend, **given)
        else:
            job = multimodal.describe_image(args.backend, backend_llm_ops=args.backend_llm_ops, **given)
    terminal.table(*job.result.report.stage_rows())
    if getattr(job, "llm_ops_reason", None):
        terminal.say(f"\nLLM ops: {job.llm_ops_reason}")
    tokenizer = getattr(job, "tokenizer_path", None)
    if job.pte_path:
        also = f" and {tokenizer}" if tokenizer else ""
        terminal.say(f"\nwrote {job.pte_path} ({job.pte_path.stat().st_size} bytes){also}")
    else:
        terminal.say("\nnothing written: give -o DIR to save the program")
    if terminal.verbosity >= 1:
        from compiler.cli.terminal import print_messages

        print_messages(terminal, [])
    if job.check is not None:
        terminal.check(job.check)
        return 0 if job.check.passed else 1
    return 0


COMMANDS = ("generate", "transcribe", "describe-image")
