"""Speech to text as a job: a Whisper-style encoder-decoder -> one `.pte` of two methods,
`encoder` and `text_decoder` (ExecuTorch's ASR runner's), sharing the cross-attention cache the
encoder fills, and the check of its greedy decoding against eager.

The check decodes greedily through the eager methods (the reference; each step's logits must
agree with transformers' forward over the whole sequence without a cache), then runs the program
as the runner does: `encoder` once, then `text_decoder` on its own greedy tokens, one loaded
program keeping its state between calls and methods (ExecuTorch's runtime on portable and
XNNPACK, the reference executor on Core ML and MLX). Each call's logits are compared with eager's
stepped on the same tokens, and the tokens with eager's greedy ones. Under ExecuTorch's runtime the
calls are also timed as the ASR runner makes them (the pip wheel has no ASR runner): the `encoder` call,
the runner's prefill (it prefills no tokens), and the `text_decoder` calls per generated token.
"""

from __future__ import annotations

import logging
import os
import pathlib
import statistics
import time
from typing import Any

import attrs
import torch

from compiler.ir import targets
from compiler.ir.errors import CompileError, UserInputError
from compiler.models import asr
from compiler.running.tolerance import Tolerance, max_abs_error
from compiler.tools import generation

logger = logging.getLogger(__name__)

RUNTIME = "ExecuTorch runtime"
REFERENCE = "reference executor"


def _step(model: asr.SpeechModel, token: int, encoded: torch.Tensor, position: int) -> torch.Tensor:
    with torch.no_grad():
        return model.methods.text_decoder(torch.tensor([[token]]), encoded, torch.tensor([position]))[0, -1]


def eager_greedy(model: asr.SpeechModel, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens through the eager methods (EOS included when it comes), and the encoder's output;
    refused when a step's logits disagree with transformers' uncached forward."""
    model.reset()
    with torch.no_grad():
        encoded = model.methods.encoder(model.features)
    fed, tokens, logits = [model.start], [], []
    while len(tokens) < steps and (not tokens or tokens[-1] not in model.eos):
        logits.append(_step(model, fed[-1], encoded, len(fed) - 1))
        tokens.append(int(logits[-1].argmax()))
        fed.append(tokens[-1])
    model.reset()
    with torch.no_grad():
        whole = model.hf_model(input_features=model.features, decoder_input_ids=torch.tensor([fed[:-1]]), use_cache=False)
    drift = (whole.logits[0] - torch.stack(logits)).abs().max().item()
    if drift > 1e-4:
        raise CompileError(
            f"the eager decoder step's logits differ from transformers' uncached forward by {drift:.3g}: "
            "the eager reference itself is in doubt",
            hint="check the model's caches: the step and the forward must compute the same logits",
        )
    return tokens, encoded


@attrs.frozen
class TranscriptionCheck:
    model: str
    backend: str
    steps: int
    eager_tokens: tuple[int, ...]
    program_tokens: tuple[int, ...]
    runner: str  # what ran the program: ExecuTorch's runtime or the reference executor
    encoder_error: float  # the encoder's output against eager's
    worst_logit_error: float  # over every text_decoder call
    worst_call: int
    tolerance: Tolerance
    methods: tuple[str, ...]  # the .pte's methods
    encoder_ms: float | None = None  # the encoder call, under ExecuTorch's runtime (the ASR runner's prefill)
    decode_ms_per_token: float | None = None  # the text_decoder calls per generated token, likewise

    @property
    def first_difference(self) -> int | None:
        return generation.first_difference(self.program_tokens, self.eager_tokens)

    @property
    def passed(self) -> bool:
        worst = max(self.worst_logit_error, self.encoder_error)
        return self.first_difference is None and worst <= self.tolerance.absolute

    def describe(self) -> str:
        step = self.first_difference
        tokens = (
            f"{len(self.eager_tokens)} greedy tokens equal to eager's" if step is None
            else f"tokens differ from eager's at step {step} ({step} equal before it)"
        )
        timing = (
            f"; encoder call {self.encoder_ms:.3g} ms, decode {self.decode_ms_per_token:.3g} ms/token"
            if self.encoder_ms is not None else ""
        )
        return (
            f"transcription check ({self.model} on {self.backend}, by the {self.runner}; methods "
            f"{', '.join(self.methods)}): {tokens}; encoder error {self.encoder_error:.3g}, worst logit error "
            f"{self.worst_logit_error:.3g} at call {self.worst_call} -> {'OK' if self.passed else 'MISMATCH'} "
            f"(tolerance {self.tolerance.absolute:.3g}, {self.tolerance.rule}){timing}"
        )

    def to_json(self) -> dict:
        return {
            "model": self.model, "backend": self.backend, "steps": self.steps,
            "eager_tokens": list(self.eager_tokens), "program_tokens": list(self.program_tokens),
            "runner": self.runner, "first_difference": self.first_difference, "passed": self.passed,
            "encoder_error": self.encoder_error, "worst_logit_error": self.worst_logit_error,
            "worst_call": self.worst_call, "tolerance": self.tolerance.absolute,
            "tolerance_rule": self.tolerance.rule, "methods": list(self.methods),
            "program_methods": list(asr.METHODS), "encoder_ms": self.encoder_ms,
            "decode_ms_per_token": self.decode_ms_per_token,
        }


def _runtime_timing(loaded: Any, model: asr.SpeechModel, steps: int, repeats: int) -> tuple[float, float]:
    """The encoder call's milliseconds and the text_decoder calls' per token, the calls made as the ASR
    runner makes them (`encoder` on the features, then `text_decoder` on the start token and each greedy
    token, `steps` calls): medians of `repeats` rounds timed here, after the check's round."""
    encoder, decode = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        (encoded,) = loaded((model.features,), method="encoder")
        encoded_at = time.perf_counter()
        fed = model.start
        for position in range(steps):
            (logits,) = loaded((torch.tensor([[fed]]), encoded, torch.tensor([position])), method="text_decoder")
            fed = int(logits[0, -1].argmax())
        encoder.append((encoded_at - start) * 1e3)
        decode.append((time.perf_counter() - encoded_at) * 1e3 / steps)
    return statistics.median(encoder), statistics.median(decode)


def check_transcription(
    program: Any, model: asr.SpeechModel, backend: str, steps: int = 32, tolerance: float | None = None,
    repeats: int = 3,
) -> TranscriptionCheck:
    """Greedy decoding of `steps` tokens by the program (a `compile_methods` result, `.pte` bytes
    or path) against eager: the tokens, the encoder's output and every step's logits; under
    ExecuTorch's runtime `repeats` timed rounds of the ASR runner's calls."""
    from compiler.running.runtime import LoadedProgram, default_tolerance

    if steps > model.max_cache_len:
        raise UserInputError(
            f"{steps} tokens do not fit the cache of {model.max_cache_len} positions",
            hint=f"ask for at most {model.max_cache_len} tokens",
        )
    eager_tokens, encoded = eager_greedy(model, steps)
    pte = generation.pte_bytes(program)
    loaded = LoadedProgram(pte)
    (program_encoded,) = loaded((model.features,), method="encoder")
    encoder_error = max_abs_error(program_encoded, encoded)
    model.reset()
    with torch.no_grad():
        model.methods.encoder(model.features)  # eager steps alongside, fed the program's tokens
    tokens: list[int] = []
    errors, largest, fed = [], 0.0, model.start
    try:
        while len(tokens) < steps and (not tokens or tokens[-1] not in model.eos):
            position = len(tokens)
            (got,) = loaded((torch.tensor([[fed]]), program_encoded, torch.tensor([position])), method="text_decoder")
            want = _step(model, fed, encoded, position)
            errors.append(max_abs_error(got[0, -1], want))
            largest = max(largest, want.abs().max().item())
            fed = int(got[0, -1].argmax())
            tokens.append(fed)
    finally:
        model.reset()
    worst = max(range(len(errors)), key=errors.__getitem__)
    chosen = Tolerance.given(tolerance) if tolerance is not None else default_tolerance(
        loaded, torch.float32, [program_encoded], max(largest, encoded.abs().max().item())
    )
    runner, encoder_ms, decode_ms = REFERENCE, None, None
    if generation.runs_here(pte):
        runner = RUNTIME
        encoder_ms, decode_ms = _runtime_timing(loaded, model, len(tokens), repeats)
    return TranscriptionCheck(
        model.name, backend, steps, tuple(eager_tokens), tuple(tokens), runner, encoder_error, errors[worst], worst,
        chosen, generation.pte_methods(pte), encoder_ms, decode_ms,
    )


@attrs.frozen
class TranscriptionJob:
    model: asr.SpeechModel
    result: Any  # the MethodsResult
    pte_path: pathlib.Path | None
    check: TranscriptionCheck | None


def transcribe(
    backend: str = targets.DEFAULT, tokens: int = 32, output_dir: str | os.PathLike | None = None, check: bool = False,
    max_cache_len: int = 64, tolerance: float | None = None, backend_options: dict | None = None, **options: Any,
) -> TranscriptionJob:
    """Compile the built-in tiny Whisper into one program of `encoder` and `text_decoder` (and the
    metadata methods): `whisper.pte` in `output_dir`; with `check`, greedy decoding of `tokens`
    tokens checked against eager. `options` are compile's."""
    from compiler import api

    generation.refuse_job(tokens, check, options, "transcription")
    model = asr.speech_model(max_cache_len=max_cache_len)
    backend_options = generation.with_state_options(backend, backend_options, shared_state=True)
    constant = (*model.constant_methods, *options.pop("emit_constant_methods", ()))
    model.reset()
    result = api.compile_methods(
        model.method_inputs, backend, backend_options=backend_options or None, emit_constant_methods=constant, **options
    )
    pte_path = None
    if output_dir is not None:
        pte_path = pathlib.Path(output_dir) / f"{model.name}.pte"
        pte_path.parent.mkdir(parents=True, exist_ok=True)
        result.save(pte_path)
        logger.info("wrote %s", pte_path)
    checked = check_transcription(result, model, backend, tokens, tolerance) if check else None
    return TranscriptionJob(model, result, pte_path, checked)
