"""Running compiled programs on this machine, and comparing them with eager PyTorch."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from compiler import backends
from compiler.process.dependency_output import DependencyOutput
from compiler.ir.artifacts import ExecutorchProgram
from compiler.ir.errors import UnsupportedByRuntime, UserInputError
from compiler.ir.private_api import deserialize_pte
from compiler.running.tolerance import Tolerance


def _pte_and_delegates(program: Any) -> tuple[bytes, set[str]]:
    if isinstance(program, (str, os.PathLike)):
        path = pathlib.Path(program)
        if not path.is_file():
            raise UserInputError(f"no program file at {str(path)!r}", hint="give the path of a .pte file")
        program = path.read_bytes()
    if isinstance(program, (bytes, bytearray, memoryview)):
        program = bytes(program)
        try:
            plans = deserialize_pte(program).program.execution_plan
        except Exception as exc:  # the flatbuffer reader fails in many ways on a non-program
            raise UserInputError(
                f"these {len(program)} bytes are not an ExecuTorch program ({type(exc).__name__}: {exc})",
                hint="give the bytes of a .pte file, as written by to_executorch() or compiler.compile",
            ) from exc
        return program, {d.id for plan in plans for d in plan.delegates}
    program = getattr(program, "program", program)
    if not isinstance(program, ExecutorchProgram):
        raise UserInputError(
            f"cannot run a {type(program).__name__}: only emitted programs run",
            hint="give a CompileResult that reached emit, the bytes of a .pte or its path",
        )
    return program.pte, set(program.delegates)


class LoadedProgram:
    """A program loaded once and run as often as wanted; its mutable state carries
    from one run to the next, as on a device.

    Delegates this machine's ExecuTorch runtime has run there; a program with any
    other delegate runs whole in the reference executor (`compiler/running/reference.py`),
    which runs CPU kernels with torch and each delegate with its reference runner.
    """

    def __init__(self, program: Any) -> None:
        # ExecuTorch's runtime talks as it loads (cpuinfo, from C): kept in `messages`, off the terminal.
        with DependencyOutput() as output:
            self._load(program)
        self.messages = output.leftover

    def _load(self, program: Any) -> None:
        from executorch.runtime import Runtime

        pte, delegates = _pte_and_delegates(program)
        runtime = Runtime.get()
        missing = sorted(d for d in delegates if not runtime.backend_registry.is_available(d))
        unrunnable = [d for d in missing if backends.delegate_runner(d) is None]
        if unrunnable:
            raise UnsupportedByRuntime(
                "the program holds delegates this machine can run neither with its ExecuTorch "
                f"runtime nor with a reference runner: {', '.join(unrunnable)}",
                hint=f"run it on {'; '.join(backends.runs_on(d) for d in unrunnable)} "
                f"(this runtime has {', '.join(runtime.backend_registry.registered_backend_names)})",
            )
        self._reference = None
        if missing:
            from compiler.running.reference import ReferenceExecutor

            self._reference = ReferenceExecutor(pte)
            self._execute = self._reference.run
        else:
            self._execute = runtime.load_program(pte).load_method("forward").execute

    @property
    def computes_in_float16(self) -> bool:
        """Whether a delegate run so far computes in float16 (known after the first run)."""
        return self._reference is not None and self._reference.computes_in_float16

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        # Cloned: an output may live in the program's planned memory, which the next run reuses.
        outputs = self._execute(list(pytree.tree_leaves(tuple(inputs))))
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in outputs]


def run(artifact: Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run an emitted program (a CompileResult, the bytes of any `.pte`, or its path) once on
    `inputs`; returns its outputs flattened."""
    return LoadedProgram(artifact)(inputs)


@attrs.frozen
class CheckResult:
    max_abs_error: float  # over every output
    max_rel_error: float
    outputs: int
    largest_expected: float  # the largest |eager value| among floating-point outputs
    tolerance: Tolerance
    # The largest error in an integer or bool output: by default these must match exactly
    # (a program that computes an integer through float16 is wrong, whatever its scale).
    integer_error: float = 0.0
    integers_exact: bool = True
    # Per output, in order: its largest absolute and relative error.
    output_errors: tuple[tuple[float, float], ...] = ()

    @property
    def passed(self) -> bool:
        if self.integers_exact and self.integer_error:
            return False
        return self.max_abs_error <= self.tolerance.absolute

    def describe(self) -> str:
        integers = (
            f"; integer outputs differ by up to {self.integer_error:.3g} (they must match exactly)"
            if self.integers_exact and self.integer_error else ""
        )
        return (
            f"check: {self.outputs} output(s), max abs error {self.max_abs_error:.3g}, "
            f"max rel error {self.max_rel_error:.3g} -> {'OK' if self.passed else 'MISMATCH'} "
            f"(tolerance {self.tolerance.absolute:.3g}, {self.tolerance.rule}{integers})"
        )

    def to_json(self) -> dict:
        """The check as JSON types, for the JSON report."""
        return {
            "passed": self.passed,
            "outputs": self.outputs,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "largest_expected": self.largest_expected,
            "tolerance": self.tolerance.absolute,
            "tolerance_kind": "relative" if self.tolerance.rule.startswith("relative") else "absolute",
            "tolerance_rule": self.tolerance.rule,
            "integer_error": self.integer_error,
            "integers_exact": self.integers_exact,
            "per_output": [{"max_abs_error": a, "max_rel_error": r} for a, r in self.output_errors],
        }


def compare_with_eager(
    program: Any, module: torch.nn.Module, inputs: Sequence[Any], tolerance: float | None = None
) -> CheckResult:
    """Run the program (a CompileResult, `.pte` bytes or path) and the eager module on the same
    inputs; report the largest errors against `tolerance` (absolute, for every output), or
    by default against one that fits the precision the program computes in
    (`Tolerance.for_precision`) for floating-point outputs, and exact integer outputs."""
    with torch.no_grad():
        expected = [x for x in pytree.tree_leaves(module(*inputs)) if isinstance(x, torch.Tensor)]
    loaded = LoadedProgram(program)
    actual = loaded(inputs)
    if len(actual) != len(expected):
        raise UserInputError(
            f"the program returned {len(actual)} outputs, eager returned {len(expected)}",
            hint="compare the module the program was compiled from",
        )
    max_abs = max_rel = largest = integer_error = 0.0
    per_output = []
    for got, want in zip(actual, expected, strict=True):
        floating = want.is_floating_point() or want.is_complex()
        got, want = got.to(torch.float64), want.to(torch.float64)
        if got.shape != want.shape:
            raise UserInputError(f"output shape {tuple(got.shape)} differs from eager {tuple(want.shape)}")
        diff = (got - want).abs()
        output_abs = output_rel = 0.0
        if diff.numel():
            output_abs, output_rel = diff.max().item(), (diff / want.abs().clamp_min(1e-6)).max().item()
            max_abs, max_rel = max(max_abs, output_abs), max(max_rel, output_rel)
            if floating:
                largest = max(largest, want.abs().max().item())
            else:
                integer_error = max(integer_error, diff.max().item())
        per_output.append((output_abs, output_rel))
    chosen = (
        Tolerance.given(tolerance) if tolerance is not None
        else Tolerance.for_precision(loaded.computes_in_float16, largest)
    )
    return CheckResult(
        max_abs, max_rel, len(expected), largest, chosen, integer_error, tolerance is None, tuple(per_output)
    )
