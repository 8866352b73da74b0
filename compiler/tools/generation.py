"""Text generation as a job: a causal LM -> a `.pte` and a `tokenizer.json` that ExecuTorch's
`TextLLMRunner` loads, and the check of its greedy generation against eager.

The check decodes greedily through the eager decoder step (the reference; it must agree with
transformers' own `generate`), then:

- tokens: on a backend this machine's ExecuTorch runtime runs (portable, XNNPACK) through
  `TextLLMRunner` itself, from the prompt's text, compared token by token with eager's; on Core
  ML and MLX, whose runtimes are Apple-only, through our reference executor, which keeps the
  program's state from call to call as a device does: each step's token is the program's own
  argmax, which, fed eager's tokens, is the token it would generate until the first difference;
- logits: the program stepped through the same calls as eager (each prompt token, then each
  generated one), every call's logits compared with eager's within the backend's tolerance.
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
from compiler.models import llm, llm_ops
from compiler.running.tolerance import Tolerance, max_abs_error

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
DEFAULT_PROMPT = llm.prompt_text([5, 9, 13, 17, 21, 25, 29, 33])
RUNNER = "TextLLMRunner"
REFERENCE = "reference executor"


def prompt_tokens(model: llm.TextModel, prompt: str) -> list[int]:
    """The prompt's token ids as the runner makes them (BOS first, num_bos=1)."""
    known = llm.tokenizer(model).get_vocab()
    unknown = [word for word in prompt.split() if word not in known]
    if unknown or not prompt.split():
        raise UserInputError(
            f"the prompt {prompt!r} has {'no tokens' if not unknown else 'pieces not in the vocabulary: ' + ', '.join(unknown[:5])}",
            hint=f"write it in the generated tokenizer's pieces, e.g. {DEFAULT_PROMPT!r} ({llm.piece(0)} .. "
            f"{llm.piece(model.vocab - 1)}, separated by spaces)",
        )
    return llm.tokenizer(model).encode(prompt).ids


@attrs.frozen
class EagerGeneration:
    tokens: list[int]  # the generated tokens, EOS included when it came
    calls: list[tuple[tuple[int, ...], int]]  # each decoder call's tokens and first position, as the runner makes them
    logits: list[torch.Tensor]  # each call's logits, [seq, vocab]


def _call(step: torch.nn.Module, tokens: Sequence[int], start: int) -> torch.Tensor:
    return step(torch.tensor([list(tokens)]), torch.arange(start, start + len(tokens)))


def eager_greedy(model: llm.TextModel, prompt: Sequence[int], steps: int) -> EagerGeneration:
    """Greedy decoding through the eager decoder step, called as the runner calls the program: the
    prompt in one call with dynamic prefill, else token by token; then each generated token."""
    model.reset()
    if model.dynamic_prefill:
        calls = [(tuple(prompt), 0)]
    else:
        calls = [((token,), position) for position, token in enumerate(prompt)]
    tokens: list[int] = []
    logits = []
    with torch.no_grad():
        index = 0
        while index < len(calls):
            logits.append(_call(model.step, *calls[index])[0].clone())
            index += 1
            if index < len(calls) and not tokens:
                continue  # still in the prompt
            tokens.append(int(logits[-1][-1].argmax()))
            if len(tokens) < steps and tokens[-1] not in model.eos:
                calls.append(((tokens[-1],), len(prompt) + len(tokens) - 1))
    model.reset()
    return EagerGeneration(tokens, calls, logits)


def _transformers_generate(model: llm.TextModel, prompt: Sequence[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.hf_model.generate(torch.tensor([list(prompt)]), max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def first_difference(program_tokens: Sequence[int], eager_tokens: Sequence[int]) -> int | None:
    """The first generated step whose token differs from eager's (a missing token counts), or None."""
    for step, (got, want) in enumerate(zip(program_tokens, eager_tokens)):
        if got != want:
            return step
    if len(program_tokens) != len(eager_tokens):
        return min(len(program_tokens), len(eager_tokens))
    return None


def up_to_first_difference(argmax: Sequence[int], eager_tokens: Sequence[int]) -> list[int]:
    """The tokens a program fed eager's tokens generates itself: its argmax up to and including
    the first one that differs from eager's (past it, it was fed a token it did not choose)."""
    step = first_difference(argmax, eager_tokens)
    return list(argmax) if step is None else list(argmax[: step + 1])


def refuse_overflow(prompt: int, counted: str, steps: int, cache: int) -> None:
    """A prompt of `prompt` positions and `steps` generated tokens that the KV cache cannot hold."""
    if prompt + steps > cache:
        raise UserInputError(
            f"the prompt ({prompt} {counted}) and {steps} generated tokens do not fit the cache of {cache} positions",
            hint=f"ask for at most {cache - prompt} tokens, or a longer cache",
        )


def require_agreement(eager: Sequence[int], reference: Sequence[int], through: str, hint: str) -> None:
    """The eager reference must be transformers' own generate, or it is no reference."""
    if list(reference) != list(eager):
        raise CompileError(
            f"greedy decoding through {through} ({list(eager)}) disagrees with transformers' generate "
            f"({list(reference)}): the eager reference itself is in doubt",
            hint=hint,
        )


def with_state_options(backend: str, given: dict | None, shared_state: bool = False) -> dict:
    """The backend options a program keeping state between calls (a KV cache) needs, under those
    given (`Target.stateful_options`, and `shared_state_options` when its methods share the state)."""
    target = backends.target(backend)
    needed = {**target.stateful_options, **(target.shared_state_options if shared_state else {})}
    return {**needed, **(given or {})}


def refuse_job(tokens: int, check: bool, options: dict, job: str) -> None:
    """A job's arguments it cannot honour, before any compile: no tokens, or a check of a
    quantized program (the jobs' checks compare with the float eager model)."""
    if tokens < 1:
        raise UserInputError(f"{tokens} tokens: the {job} needs at least one", hint="e.g. tokens=32")
    if check and options.get("quantize"):
        raise UserInputError(
            f"the {job} check compares with the float eager model, not one quantized by {options['quantize']!r}",
            stage="quantize", hint="check the float program, or compile the quantized one without the check",
        )


@attrs.frozen
class GenerationCheck:
    model: str
    backend: str
    steps: int  # greedy tokens asked for
    prompt: tuple[int, ...]
    eager_tokens: tuple[int, ...]
    program_tokens: tuple[int, ...]
    runner: str  # what generated the program's tokens: TextLLMRunner or the reference executor
    worst_logit_error: float  # over every call's logits
    worst_call: int
    tolerance: Tolerance
    methods: tuple[str, ...]  # the .pte's methods
    prefill_ms_per_token: float | None = None  # under TextLLMRunner
    decode_ms_per_token: float | None = None
    llm_ops: str | None = None  # the backend's own LLM ops the program calls (llm_ops.BackendOps.name), if any
    llm_ops_reason: str = ""  # why those, or why none

    @property
    def first_difference(self) -> int | None:
        return first_difference(self.program_tokens, self.eager_tokens)

    @property
    def passed(self) -> bool:
        return self.first_difference is None and self.worst_logit_error <= self.tolerance.absolute

    def describe(self) -> str:
        step = self.first_difference
        stopped = " (eager stopped at EOS)" if len(self.eager_tokens) < self.steps else ""
        if step is None:
            tokens = f"{len(self.eager_tokens)} greedy tokens equal to eager's{stopped}"
        else:
            def at(tokens):
                return llm.piece(tokens[step]) if step < len(tokens) else "nothing"

            tokens = (
                f"tokens differ from eager's at step {step} (program {at(self.program_tokens)}, "
                f"eager {at(self.eager_tokens)}; {step} equal before it)"
            )
        timing = (
            f"; prefill {self.prefill_ms_per_token:.3g} ms/token, decode {self.decode_ms_per_token:.3g} ms/token"
            if self.prefill_ms_per_token is not None else ""
        )
        return (
            f"generation check ({self.model} on {self.backend}{f' with {self.llm_ops}:: ops' if self.llm_ops else ''}, "
            f"tokens by {self.runner}): {tokens}; worst logit "
            f"error {self.worst_logit_error:.3g} at call {self.worst_call} -> {'OK' if self.passed else 'MISMATCH'} "
            f"(tolerance {self.tolerance.absolute:.3g}, {self.tolerance.rule}){timing}"
        )

    def to_json(self) -> dict:
        return {
            "model": self.model, "backend": self.backend, "steps": self.steps, "prompt": list(self.prompt),
            "eager_tokens": list(self.eager_tokens), "program_tokens": list(self.program_tokens),
            "runner": self.runner, "first_difference": self.first_difference, "passed": self.passed,
            "worst_logit_error": self.worst_logit_error, "worst_call": self.worst_call,
            "tolerance": self.tolerance.absolute, "tolerance_rule": self.tolerance.rule, "methods": list(self.methods),
            "prefill_ms_per_token": self.prefill_ms_per_token, "decode_ms_per_token": self.decode_ms_per_token,
            "llm_ops": self.llm_ops, "llm_ops_reason": self.llm_ops_reason,
        }


def pte_bytes(program: Any) -> bytes:
    """A job's program as bytes: a result, an ExecutorchProgram, `.pte` bytes or a path."""
    if isinstance(program, (str, os.PathLike)):
        return pathlib.Path(program).read_bytes()
    if isinstance(program, (bytes, bytearray)):
        return bytes(program)
    return getattr(program, "program", program).pte


def pte_methods(pte: bytes) -> tuple[str, ...]:
    from compiler.ir.private_api import deserialize_pte

    return tuple(plan.name for plan in deserialize_pte(pte).program.execution_plan)


def runs_here(pte: bytes) -> bool:
    """Whether ExecuTorch's runtime here has every delegate of the program (else: the reference executor)."""
    from executorch.runtime import Runtime

    from compiler.ir.private_api import deserialize_pte

    registry = Runtime.get().backend_registry
    plans = deserialize_pte(pte).program.execution_plan
    return all(registry.is_available(d.id) for plan in plans for d in plan.delegates)


def logit_tolerance(loaded, largest: float, returned: torch.dtype = torch.float32) -> Tolerance:
    """The backend's tolerance for the program's precision, plus the rounding of logits it returns in
    a narrower dtype (a bfloat16 model computed in float32 returns bfloat16, as the model does)."""
    if loaded.computes_in_float16:
        chosen = Tolerance.for_precision("float16", largest, by_delegate=True)
    else:
        dtype = loaded.computes_in
        chosen = Tolerance.for_precision(str(dtype).removeprefix("torch.") if dtype is not None else "float32", largest)
    return chosen.with_output_rounding(str(returned).removeprefix("torch."), largest)


def _runner_tokens(pieces: list[str], model: llm.TextModel) -> list[int]:
    """The runner's token callback strings back to ids (each is one piece of the generated tokenizer)."""
    ids = {name: token for token, name in llm.special_names(model).items()}
    tokens = []
    for text in pieces:
        if text in ids:
            tokens.append(ids[text])
        elif text.startswith("t") and text[1:].isdigit():
            tokens.append(int(text[1:]))
        else:
            raise CompileError(f"TextLLMRunner returned {text!r}, which is no piece of the generated tokenizer")
    return tokens


def _runner_generation(pte_path: str, tokenizer_path: str, model: llm.TextModel, prompt: str, steps: int, repeats: int):
    """Greedy tokens from TextLLMRunner's `generate`, and its prefill and decode milliseconds per token:
    medians of `repeats` rounds of `prefill` then `generate` from there, timed here (its own stats
    count whole milliseconds, and a tiny model's prompt takes less than one)."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from compiler.process.dependency_output import DependencyOutput

    config = GenerationConfig(echo=False, max_new_tokens=steps, temperature=0.0, num_bos=1)
    prompt_length = len(prompt_tokens(model, prompt))
    prefill, decode = [], []
    with DependencyOutput():  # the runner prints each token and its stats from C++
        try:
            runner = TextLLMRunner(pte_path, tokenizer_path)
            pieces: list[str] = []
            runner.generate(prompt, config, pieces.append)
            for _ in range(repeats):
                runner.reset()
                stats: list[Any] = []
                start = time.perf_counter()
                runner.prefill(prompt, config)
                prefilled = time.perf_counter()
                runner.generate("", config, None, stats.append)
                prefill.append((prefilled - start) * 1e3 / prompt_length)
                decode.append((time.perf_counter() - prefilled) * 1e3 / max(stats[-1].num_generated_tokens, 1))
        except RuntimeError as exc:
            raise CompileError(
                f"TextLLMRunner failed to generate from the program: {exc}",
                hint="run it with -v to see what the runner logged",
            ) from exc
    return _runner_tokens(pieces, model), statistics.median(prefill), statistics.median(decode)


def in_precision(model: llm.TextModel, dtype: torch.dtype | None) -> llm.TextModel:
    """The eager model computing in the program's floating dtype where the program computes wider
    than the model's weights (a bfloat16 checkpoint compiled for a backend that computes in float32):
    a copy cast to it. Else the model itself (a program computing narrower is checked against the
    model as given, with the tolerance of its precision)."""
    held = {p.dtype for p in model.hf_model.parameters() if p.is_floating_point()}
    if dtype is None or not dtype.is_floating_point or all(torch.finfo(h).bits >= torch.finfo(dtype).bits for h in held):
        return model
    from compiler.running.runtime import cast_copy

    hf_model, _ = cast_copy(model.hf_model, (), dtype)
    logger.info("generation check: eager computes in %s, as the program does", dtype)
    cast = llm.text_model(hf_model, max_cache_len=model.max_cache_len, dynamic_prefill=model.dynamic_prefill)
    return attrs.evolve(cast, name=model.name)


def check_generation(
    program: Any, model: llm.TextModel, backend: str, steps: int = 32, prompt: str = DEFAULT_PROMPT,
    tolerance: float | None = None, repeats: int = 3,
) -> GenerationCheck:
    """Greedy generation of `steps` tokens by the program (a CompileResult, `.pte` bytes or path)
    against eager: tokens token by token, every call's logits within the tolerance (`tolerance`,
    absolute, or the backend's); on XNNPACK and portable `repeats` timed rounds of the runner."""
    from compiler.ir.kernels import load_llm_kernels
    from compiler.running.runtime import LoadedProgram

    prompt_ids = prompt_tokens(model, prompt)
    refuse_overflow(len(prompt_ids), "tokens with BOS", steps, model.max_cache_len)
    pte = pte_bytes(program)
    load_llm_kernels()  # a program made elsewhere (optimum-executorch's) may call ExecuTorch's LLM ops
    loaded = LoadedProgram(pte)
    model = in_precision(model, loaded.computes_in)
    eager = eager_greedy(model, prompt_ids, steps)
    require_agreement(
        eager.tokens, _transformers_generate(model, prompt_ids, steps), "the decoder step",
        "check the model's static cache: the step and generate must compute the same logits",
    )
    errors, program_argmax = [], []
    largest = 0.0
    for (called, start), want in zip(eager.calls, eager.logits):
        (got,) = loaded([torch.tensor([list(called)]), torch.arange(start, start + len(called))])
        returned = got.dtype
        got = got[0].to(torch.float64)
        errors.append(max_abs_error(got, want))
        largest = max(largest, want.abs().max().item())
        program_argmax.append(int(got[-1].argmax()))
    first_generating = len(eager.calls) - len(eager.tokens)
    prefill_ms = decode_ms = None
    if runs_here(pte):
        runner = RUNNER
        with tempfile.TemporaryDirectory() as scratch:  # the runner reads files
            pte_path, tokenizer_path = pathlib.Path(scratch, "checked.pte"), pathlib.Path(scratch, TOKENIZER_FILE)
            pte_path.write_bytes(pte)
            llm.tokenizer(model).save(str(tokenizer_path))
            tokens, prefill_ms, decode_ms = _runner_generation(
                str(pte_path), str(tokenizer_path), model, prompt, steps, repeats
            )
    else:
        # Fed eager's tokens, the program's argmax at each step is its own greedy token up to the first
        # difference; one token past it says what it generated there.
        runner = REFERENCE
        tokens = up_to_first_difference(program_argmax[first_generating:], eager.tokens)
    worst = max(range(len(errors)), key=errors.__getitem__)
    return GenerationCheck(
        model.name, backend, steps, tuple(prompt_ids), tuple(eager.tokens), tuple(tokens), runner,
        errors[worst], worst, Tolerance.given(tolerance) if tolerance is not None else logit_tolerance(loaded, largest, returned),
        pte_methods(pte), prefill_ms, decode_ms,
    )


@attrs.frozen
class GenerationJob:
    """What `generate` made: the model as prepared, the compile, the files written, the check."""

    model: llm.TextModel
    result: Any  # the CompileResult
    pte_path: pathlib.Path | None
    tokenizer_path: pathlib.Path | None
    check: GenerationCheck | None
    llm_ops: str | None = None  # the backend's LLM ops the program calls, if any
    llm_ops_reason: str = ""  # why those, or why none


def generate(
    model: Any, backend: str = targets.DEFAULT, tokens: int = 32, output_dir: str | os.PathLike | None = None,
    check: bool = False, prompt: str = DEFAULT_PROMPT, max_cache_len: int = 64, tolerance: float | None = None,
    dynamic_prefill: bool = False, backend_options: dict | None = None, backend_llm_ops: bool | None = None,
    **options: Any,
) -> GenerationJob:
    """Compile a causal LM (a built-in name, a `save_pretrained` folder, a transformers model, or a
    `TextModel`) into a program TextLLMRunner runs: `<name>.pte` and `tokenizer.json` in
    `output_dir`; with `check`, greedy generation of `tokens` tokens checked against eager.
    `dynamic_prefill`: calls take any number of tokens, so the runner prefills the prompt in one.
    `backend_llm_ops`: the step calls the backend's own attention and KV-cache ops (`llm_ops`), by
    default where the backend has them; False keeps torch's. `options` are compile's."""
    from compiler import api

    refuse_job(tokens, check, options, "generation")
    text = (
        model if isinstance(model, llm.TextModel)
        else llm.text_model(model, max_cache_len=max_cache_len, dynamic_prefill=dynamic_prefill)
    )
    backend_options = with_state_options(backend, backend_options)
    constant = (*text.constant_methods, *options.pop("emit_constant_methods", ()))
    ops, why = llm_ops.choose(backends.load(backend), backend_llm_ops, text)
    logger.info("LLM ops: %s", why)
    text.reset()
    step = llm_ops.rewritten_step(text, ops) if ops is not None else text.step
    result = api.compile(
        step, text.example_inputs, backend, backend_options=backend_options or None,
        dynamic_shapes=text.dynamic_shapes, emit_constant_methods=constant, **options,
    )
    pte_path = tokenizer_path = None
    if output_dir is not None:
        folder = pathlib.Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        pte_path, tokenizer_path = folder / f"{text.name}.pte", folder / TOKENIZER_FILE
        result.save(pte_path)
        llm.tokenizer(text).save(str(tokenizer_path))
        logger.info("wrote %s and %s", pte_path, tokenizer_path)
    checked = (
        attrs.evolve(
            check_generation(result, text, backend, tokens, prompt, tolerance=tolerance),
            llm_ops=ops and ops.name, llm_ops_reason=why,
        )
        if check else None
    )
    return GenerationJob(text, result, pte_path, tokenizer_path, checked, ops and ops.name, why)
