"""Errors between two values and the tolerance they are held to: the check's own rule
(`compiler.running.runtime.default_tolerance`), asked for what the program at hand computes
in, so a stage that computes in float32 is held to float32's tolerance even when the lowered
program computes in float16; and, for a quantized program, plus the check's allowance for its
activation quantizers rounding one step otherwise (`activation_allowance`)."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from compiler.running.activation_steps import ActivationSteps, activation_steps, quantizes_activations
from compiler.running.runtime import default_tolerance
from compiler.running.tolerance import Tolerance, max_abs_error
from compiler.tools.locate.programs import ProgramRun, least_precise


@attrs.frozen
class _Computes:
    """What `default_tolerance` reads of a loaded program, for a program run here."""

    computes_in: torch.dtype | None
    computes_in_float16: bool


def error(got: Any, want: Any) -> float | None:
    """The largest absolute difference of two tensors of one shape (None: not comparable), as the
    check measures it (`max_abs_error`: a NaN on one side only is an infinite error)."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or got.shape != want.shape:
        return None
    return max_abs_error(got, want)


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "floating" if dtype.is_floating_point or dtype.is_complex else "integer"


def _shape(shape: Any) -> str:
    return str(tuple(int(d) for d in shape))


def unlike(got: Any, want: Any, tolerance: float) -> str | None:
    """How a node's value differs from torch's other than in its numbers, or None. Another kind
    of dtype (bool or integer where torch gives floating point, ...) is a divergence; another
    precision of the same kind is not (a float16 payload computes float32 nodes: the tolerance is
    for that). Another shape is, unless the value broadcasts to torch's and the broadcast agrees
    within `tolerance` (the same numbers as a view: what a consumer reading it sees)."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return None
    if _kind(got.dtype) != _kind(want.dtype):
        return f"dtype {str(got.dtype).removeprefix('torch.')} where torch gives {str(want.dtype).removeprefix('torch.')}"
    if got.shape == want.shape:
        return None
    try:
        spread = got.broadcast_to(want.shape)
    except RuntimeError:
        spread = None
    if spread is not None:
        e = error(spread, want)
        if e is not None and e <= tolerance:
            return None
    return f"shape {_shape(got.shape)} where torch gives {_shape(want.shape)}"


def error_as_consumed(got: Any, want: Any) -> float | None:
    """`error`, of a value that broadcasts to torch's shape as broadcast (see `unlike`)."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape != want.shape:
        try:
            got = got.broadcast_to(want.shape)
        except RuntimeError:
            return None
    return error(got, want)


def largest(values: Sequence[Any]) -> float:
    floating = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    return max((v.detach().abs().max().item() for v in floating), default=0.0)


def tolerance(run: ProgramRun, model_dtype: torch.dtype, actual: Sequence[Any], expected: Sequence[Any]) -> Tolerance:
    """The check's tolerance for `actual` against `expected`, for a program computing as `run` did."""
    return default_tolerance(_Computes(run.computes_in, run.computes_in_float16), model_dtype, actual, largest(expected))


def model_dtype(module: torch.nn.Module, inputs: Sequence[Any]) -> torch.dtype:
    """The floating dtype an eager model computes in: its weights' least precise, else its inputs'."""
    held = [*module.parameters(), *module.buffers()]
    given = [t for t in inputs if isinstance(t, torch.Tensor)]
    return least_precise(t.dtype for t in held) or least_precise(t.dtype for t in given) or torch.float32


@attrs.frozen
class Compared:
    """Outputs against reference outputs: the largest error, per output, and the tolerance."""

    errors: tuple[float | None, ...]
    tolerance: Tolerance

    @property
    def max_error(self) -> float:
        return max((e for e in self.errors if e is not None), default=0.0)

    @property
    def passed(self) -> bool:
        return all(e is not None for e in self.errors) and self.max_error <= self.tolerance.absolute


def activation_allowance(reference: torch.nn.Module, inputs: Sequence[Any], expected: Sequence[Any]) -> ActivationSteps | None:
    """For an eager quantized `reference` that quantizes activations: what moving each of its
    activation quantizers' results one step does to its outputs (`expected`, on `inputs`), the
    allowance the check (`compare_at`) adds to its tolerance; None for any other model."""
    if not quantizes_activations(reference):
        return None
    buffers = list(reference.buffers())
    before = [b.clone() for b in buffers]

    def rewind() -> None:
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                buffer.copy_(value)

    try:
        return activation_steps(reference, inputs, [t for t in expected if isinstance(t, torch.Tensor)], rewind)
    finally:
        rewind()


def outputs(
    run: ProgramRun, expected: Sequence[Any], dtype: torch.dtype, steps: ActivationSteps | None = None,
    given: float | None = None,
) -> Compared:
    """A stage's outputs against eager's, at the tolerance for what the stage computes in (plus
    the activation quantizers' `steps`, when given), or at the `given` one, as the check takes it;
    an integer output must match exactly, as in the check."""
    got = list(run.outputs)
    chosen = Tolerance.given(given) if given is not None else tolerance(run, dtype, got, expected)
    if steps is not None and given is None:
        chosen = chosen.with_activation_steps(steps.deviation, steps.quantizers, (steps.smallest, steps.largest),
                                              steps.draws)
    if len(got) != len(expected):
        return Compared(tuple(None for _ in expected), chosen)
    errors = []
    for g, w in zip(got, expected):
        e = error(g, w)
        if e is not None and isinstance(w, torch.Tensor) and not (w.is_floating_point() or w.is_complex()) and e:
            e = float("inf")  # an integer off by anything fails
        errors.append(e)
    return Compared(tuple(errors), chosen)
