"""Image-and-text generation as a job: the built-in tiny LLaVA -> one `.pte` of the three methods
ExecuTorch's `MultimodalRunner` calls (`compiler.models.vlm`) and a `tokenizer.json`, and the
check of its greedy generation against eager.

The prompt is text, an image, text: the runner prefills each input in one `text_decoder` call
(BOS only before the first text; ExecuTorch 1.5.1's runner adds none before an image that comes
first), then decodes token by token. The eager methods composed in that order are the reference;
they must agree with transformers' own `generate` over the prompt's ids with the image's
placeholders. Then, as for text generation (`compiler.tools.generation`):

- tokens: on portable and XNNPACK through `MultimodalRunner` itself, from the prompt's inputs; on
  Core ML and MLX through our reference executor (the program's argmax fed eager's tokens);
- logits: the program called as eager was (each input's embeddings from the program's own
  `vision_encoder` or `token_embedding`, then `text_decoder`), every call's logits within the
  backend's tolerance, and the vision encoder's output too;
- times, under `MultimodalRunner`: its prefill and decode milliseconds per token, over the intervals
  and token counts of the runner's own `Stats` (its stats callback), timed here.
"""

from __future__ import annotations

import logging
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any, Sequence

import attrs
import torch

from compiler import backends
from compiler.ir import targets
from compiler.ir.errors import CompileError, UserInputError
from compiler.models import llm, llm_ops, vlm
from compiler.running.tolerance import Tolerance, max_abs_error
from compiler.tools import generation

logger = logging.getLogger(__name__)

RUNNER = "MultimodalRunner"
IMAGE = None  # a prompt segment standing for the image
# The default prompt: two tokens (after BOS), the image, four tokens.
DEFAULT_PROMPT = (llm.prompt_text([5, 9]), IMAGE, llm.prompt_text([13, 17, 21, 25]))


@attrs.frozen
class EagerCalls:
    tokens: list[int]  # the generated tokens, EOS included when it came
    # Each text_decoder call: its tokens (None: the image) and first position.
    calls: list[tuple[tuple[int, ...] | None, int]]
    logits: list[torch.Tensor]  # each call's logits, [seq, vocab]
    image_embeddings: torch.Tensor


def prompt_ids(model: vlm.VisionLanguageModel, prompt: Sequence[str | None]) -> list[tuple[int, ...] | None]:
    """Each segment's token ids as the runner makes them (BOS before the first text only), None for the image."""
    if IMAGE not in prompt or prompt[0] is IMAGE:
        raise UserInputError(
            "the prompt must be text, then the image, then optionally more text",
            hint="give segments like ('t5 t9', None, 't13 t17'): ExecuTorch 1.5.1's MultimodalRunner puts no BOS "
            "before an image that comes first",
        )
    segments: list[tuple[int, ...] | None] = []
    for index, segment in enumerate(prompt):
        if segment is IMAGE:
            segments.append(None)
            continue
        ids = generation.prompt_tokens(model, segment)  # BOS first
        segments.append(tuple(ids if index == 0 else ids[1:]))
    return segments


def _decode(model: vlm.VisionLanguageModel, embeddings: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + embeddings.shape[1])
    return model.methods.text_decoder(embeddings, positions)[0].clone()


def eager_greedy(model: vlm.VisionLanguageModel, segments: list, steps: int) -> EagerCalls:
    """Greedy decoding through the eager methods, called as the runner calls the program."""
    model.reset()
    methods = model.methods
    calls, logits, tokens, position = [], [], [], 0
    with torch.no_grad():
        image = methods.vision_encoder(model.image)
        for segment in segments:
            embeddings = image if segment is None else methods.token_embedding(torch.tensor([list(segment)]))
            calls.append((segment, position))
            logits.append(_decode(model, embeddings, position))
            position += embeddings.shape[1]
        tokens.append(int(logits[-1][-1].argmax()))
        while len(tokens) < steps and tokens[-1] not in model.eos:
            calls.append(((tokens[-1],), position))
            logits.append(_decode(model, methods.token_embedding(torch.tensor([[tokens[-1]]])), position))
            position += 1
            tokens.append(int(logits[-1][-1].argmax()))
    model.reset()
    return EagerCalls(tokens, calls, logits, image)


def _transformers_generate(model: vlm.VisionLanguageModel, segments: list, steps: int) -> list[int]:
    """transformers' own greedy generate over the prompt's ids, the image's placeholders in its place."""
    ids = [token for s in segments for token in (s if s is not None else (vlm.IMAGE,) * model.image_tokens)]
    with torch.no_grad():
        out = model.hf_model.generate(
            torch.tensor([ids]), pixel_values=model.image, max_new_tokens=steps, do_sample=False
        )
    return out[0, len(ids):].tolist()


@attrs.frozen
class MultimodalCheck(generation.GenerationCheck):
    vision_error: float = 0.0  # the program's vision_encoder output against eager's

    @property
    def passed(self) -> bool:
        return super().passed and self.vision_error <= self.tolerance.absolute

    def describe(self) -> str:
        return f"{super().describe()}; vision encoder error {self.vision_error:.3g}"

    def to_json(self) -> dict:
        return {
            **super().to_json(), "passed": self.passed, "vision_error": self.vision_error,
            "program_methods": list(vlm.METHODS),
        }


def _runner_generation(
    pte_path: str, tokenizer_path: str, model: vlm.VisionLanguageModel, prompt: Sequence[str | None], steps: int,
    repeats: int,
) -> tuple[list[int], float, float]:
    """Greedy tokens from MultimodalRunner's `generate`, and its prefill and decode milliseconds per
    token: medians of `repeats` rounds of `generate` after `reset`. The intervals and counts are those
    of the runner's `Stats`: prefill from the call to the first token (which the runner emits as the
    prompt's inputs are prefilled) over its `num_prompt_tokens` (the image's positions included),
    decode from there to its stats callback over its `num_generated_tokens`. They are timed here, as
    its `Stats` count whole milliseconds and the tiny model's prompt takes about one."""
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_text_input

    from compiler.process.dependency_output import DependencyOutput

    config = GenerationConfig(echo=False, max_new_tokens=steps, temperature=0.0, num_bos=1)
    inputs = [make_image_input(model.image[0]) if s is IMAGE else make_text_input(s) for s in prompt]
    pieces: list[str] = []
    prefill, decode = [], []
    with DependencyOutput():  # the runner prints each token and its stats from C++
        try:
            runner = MultimodalRunner(pte_path, tokenizer_path)
            runner.generate(inputs, config, pieces.append)
            for _ in range(repeats):
                runner.reset()
                tokens_at: list[float] = []
                counts: list[tuple[int, int, float]] = []  # the Stats' prompt and generated tokens, when it came
                start = time.perf_counter()
                runner.generate(
                    inputs, config, lambda _: tokens_at.append(time.perf_counter()),
                    lambda stats: counts.append(
                        (stats.num_prompt_tokens, stats.num_generated_tokens, time.perf_counter())
                    ),
                )
                prompt_tokens, generated, ended = counts[-1]
                prefill.append((tokens_at[0] - start) * 1e3 / prompt_tokens)
                decode.append((ended - tokens_at[0]) * 1e3 / max(generated, 1))
        except RuntimeError as exc:
            raise CompileError(
                f"MultimodalRunner failed to generate from the program: {exc}",
                hint="run it with -v to see what the runner logged",
            ) from exc
    return generation._runner_tokens(pieces, model), statistics.median(prefill), statistics.median(decode)


def check_multimodal(
    program: Any, model: vlm.VisionLanguageModel, backend: str, steps: int = 32,
    prompt: Sequence[str | None] = DEFAULT_PROMPT, tolerance: float | None = None, repeats: int = 3,
) -> MultimodalCheck:
    """Greedy generation of `steps` tokens after the prompt by the program (a `compile_methods`
    result, `.pte` bytes or path) against eager: tokens, every call's logits, the image's embeddings;
    under MultimodalRunner `repeats` timed rounds of it."""
    from compiler.running.runtime import LoadedProgram

    segments = prompt_ids(model, prompt)
    length = sum(len(s) if s is not None else model.image_tokens for s in segments)
    generation.refuse_overflow(length, "positions with the image", steps, model.max_cache_len)
    eager = eager_greedy(model, segments, steps)
    generation.require_agreement(
        eager.tokens, _transformers_generate(model, segments, steps), "the eager methods",
        "check the methods' static cache and the image's placement",
    )
    pte = generation.pte_bytes(program)
    loaded = LoadedProgram(pte)
    (image,) = loaded((model.image,), method="vision_encoder")
    vision_error = max_abs_error(image, eager.image_embeddings)
    errors, argmax, largest = [], [], eager.image_embeddings.abs().max().item()
    for (called, start), want in zip(eager.calls, eager.logits):
        embeddings = image if called is None else loaded((torch.tensor([list(called)]),), method="token_embedding")[0]
        positions = torch.arange(start, start + embeddings.shape[1])
        (got,) = loaded((embeddings, positions), method="text_decoder")
        errors.append(max_abs_error(got[0], want))
        largest = max(largest, want.abs().max().item())
        argmax.append(int(got[0, -1].argmax()))
    prefill_ms = decode_ms = None
    if generation.runs_here(pte):
        runner = RUNNER
        with tempfile.TemporaryDirectory() as scratch:  # the runner reads files
            pte_path = pathlib.Path(scratch, "checked.pte")
            tokenizer_path = pathlib.Path(scratch, generation.TOKENIZER_FILE)
            pte_path.write_bytes(pte)
            llm.tokenizer(model).save(str(tokenizer_path))
            tokens, prefill_ms, decode_ms = _runner_generation(
                str(pte_path), str(tokenizer_path), model, prompt, steps, repeats
            )
    else:
        # Fed eager's tokens, the program's argmax is its own greedy token up to the first difference.
        runner = generation.REFERENCE
        tokens = generation.up_to_first_difference(argmax[len(segments) - 1:], eager.tokens)
    worst = max(range(len(errors)), key=errors.__getitem__)
    flat = tuple(t for s in segments for t in (s if s is not None else (vlm.IMAGE,) * model.image_tokens))
    return MultimodalCheck(
        model.name, backend, steps, flat, tuple(eager.tokens), tuple(tokens), runner, errors[worst], worst,
        Tolerance.given(tolerance) if tolerance is not None else generation.logit_tolerance(loaded, largest),
        generation.pte_methods(pte), prefill_ms, decode_ms, vision_error=vision_error,
    )


@attrs.frozen
class MultimodalJob:
    model: vlm.VisionLanguageModel
    result: Any  # the MethodsResult
    pte_path: pathlib.Path | None
    tokenizer_path: pathlib.Path | None
    check: MultimodalCheck | None


def describe_image(
    backend: str = targets.DEFAULT, tokens: int = 32, output_dir: str | os.PathLike | None = None, check: bool = False,
    prompt: Sequence[str | None] = DEFAULT_PROMPT, max_cache_len: int = 64, tolerance: float | None = None,
    backend_options: dict | None = None, backend_llm_ops: bool = False, **options: Any,
) -> MultimodalJob:
    """Compile the built-in tiny LLaVA into one program of `vision_encoder`, `token_embedding` and
    `text_decoder` (and the metadata methods): `llava.pte` and `tokenizer.json` in `output_dir`;
    with `check`, greedy generation of `tokens` tokens after `prompt` (text segments and None for
    the image) checked against eager. `backend_llm_ops`: the decoder calls the backend's own attention
    and KV-cache ops (`llm_ops`). `options` are compile's."""
    from compiler import api

    generation.refuse_job(tokens, check, options, "image description")
    model = vlm.vision_language_model(max_cache_len=max_cache_len)
    backend_options = generation.with_state_options(backend, backend_options)
    constant = (*model.constant_methods, *options.pop("emit_constant_methods", ()))
    ops, why = llm_ops.choose(backends.load(backend), backend_llm_ops)
    logger.info("LLM ops: %s", why)
    model.reset()
    methods = model.inputs_of(model.rewritten(ops)) if ops is not None else model.method_inputs
    result = api.compile_methods(
        methods, backend, backend_options=backend_options or None, emit_constant_methods=constant, **options
    )
    pte_path = tokenizer_path = None
    if output_dir is not None:
        folder = pathlib.Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        pte_path, tokenizer_path = folder / f"{model.name}.pte", folder / generation.TOKENIZER_FILE
        result.save(pte_path)
        llm.tokenizer(model).save(str(tokenizer_path))
        logger.info("wrote %s and %s", pte_path, tokenizer_path)
    checked = (
        attrs.evolve(check_multimodal(result, model, backend, tokens, prompt, tolerance), llm_ops=ops and ops.name,
                     llm_ops_reason=why)
        if check else None
    )
    return MultimodalJob(model, result, pte_path, tokenizer_path, checked)
