"""The check of a program of several methods: a sequence of calls (prefill, then decode, ...) run
by the program and by the eager methods, each call's outputs compared, a row per method.

The program's state carries from call to call and from method to method (one KV cache), as on a
device: the calls run in order on one loaded program, and eager runs them in the same order from
the state its modules hold, which the check puts back when it is done.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.running.runtime import LoadedProgram, default_tolerance, _eager, _max_error, _model_dtype
from compiler.running.tolerance import Tolerance, largest_finite


@attrs.frozen
class MethodCheck:
    method: str
    calls: int  # how many calls of the sequence were to this method
    worst_error: float  # largest absolute error over its calls
    worst_call: int  # that call's place in the whole sequence
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        return self.worst_error <= self.tolerance.absolute

    def to_json(self) -> dict:
        return {
            "method": self.method, "calls": self.calls, "worst_error": self.worst_error, "worst_call": self.worst_call,
            "tolerance": self.tolerance.absolute, "tolerance_rule": self.tolerance.rule, "passed": self.passed,
        }


@attrs.frozen
class MethodsCheck:
    methods: tuple[MethodCheck, ...]  # in the order of their first call
    calls: tuple[str, ...]  # the method of each call, in order

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.methods)

    def describe(self) -> str:
        rows = "; ".join(
            f"{row.method}: {row.calls} call{'s' if row.calls != 1 else ''}, worst error {row.worst_error:.3g} at call "
            f"{row.worst_call} ({'OK' if row.passed else 'MISMATCH'}, tolerance {row.tolerance.absolute:.3g}, "
            f"{row.tolerance.rule})"
            for row in self.methods
        )
        return f"check of {len(self.calls)} calls ({' -> '.join(self.calls)}) against eager: {rows}"

    def to_json(self) -> dict:
        return {"calls": list(self.calls), "passed": self.passed, "methods": [row.to_json() for row in self.methods]}


def _state_of(eager: Mapping[str, Callable]) -> list[torch.Tensor]:
    """Every buffer of the modules the eager methods belong to, each once."""
    buffers: dict[int, torch.Tensor] = {}
    for method in eager.values():
        module = getattr(method, "__self__", method)
        if isinstance(module, torch.nn.Module):
            for buffer in module.buffers():
                buffers.setdefault(id(buffer), buffer)
    return list(buffers.values())


def check_methods(
    program: Any, calls: Sequence[tuple[str, Sequence[Any]]], eager: Mapping[str, Callable],
    tolerance: float | None = None,
) -> MethodsCheck:
    """Run `calls` (method name, inputs), in order, through the program (a result of
    `compile_methods`, `.pte` bytes or path) and through `eager` (method name -> callable);
    compare each call's outputs within `tolerance` (absolute) or the program's precision's."""
    if not calls:
        raise UserInputError("no calls to check", hint="give (method, inputs) pairs, e.g. [('prefill', (x, pos))]")
    missing = sorted({name for name, _ in calls} - set(eager))
    if missing:
        raise UserInputError(
            f"no eager method to compare {', '.join(map(repr, missing))} with",
            hint="give eager={name: callable} for every method called (a resumed method has no eager model)",
        )
    loaded = LoadedProgram(program)
    state = _state_of(eager)
    saved = [buffer.clone() for buffer in state]
    errors: dict[str, list[tuple[float, int]]] = {}
    largest: dict[str, float] = {}
    results: dict[str, list[Any]] = {}
    try:
        for index, (name, inputs) in enumerate(calls):
            want = _eager(eager[name], tuple(inputs))
            got = loaded(tuple(inputs), method=name)
            errors.setdefault(name, []).append((_max_error(got, want), index))
            largest[name] = max([largest.get(name, 0.0)] + [largest_finite(t) for t in want])
            results.setdefault(name, []).extend(got)
    finally:
        with torch.no_grad():
            for buffer, value in zip(state, saved):
                buffer.copy_(value)
    rows = []
    for name, found in errors.items():
        worst, at = max(found)
        owner = getattr(eager[name], "__self__", eager[name])
        inputs = next(inputs for called, inputs in calls if called == name)
        chosen = Tolerance.given(tolerance) if tolerance is not None else default_tolerance(
            loaded, _model_dtype(owner, inputs), results[name], largest[name]
        )
        rows.append(MethodCheck(name, len(found), worst, at, chosen))
    return MethodsCheck(tuple(rows), tuple(name for name, _ in calls))
