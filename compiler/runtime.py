"""Running compiled programs on this machine, and comparing them with eager PyTorch."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from compiler import backends
from compiler.ir.artifacts import ExecutorchProgram
from compiler.ir.errors import UnsupportedByRuntime, UserInputError
from compiler.private_api import deserialize_pte


def _pte_and_delegates(program: Any) -> tuple[bytes, set[str]]:
    if isinstance(program, (bytes, bytearray)):
        plans = deserialize_pte(bytes(program)).program.execution_plan
        return bytes(program), {d.id for plan in plans for d in plan.delegates}
    program = getattr(program, "program", program)
    if not isinstance(program, ExecutorchProgram):
        raise UserInputError(
            f"cannot run a {type(program).__name__}: only emitted programs run",
            hint="compile without stop_after to get an Artifact",
        )
    return program.pte, set(program.delegates)


class LoadedProgram:
    """A program loaded once and run as often as wanted; its mutable state carries
    from one run to the next, as on a device."""

    def __init__(self, program: Any) -> None:
        from executorch.runtime import Runtime

        pte, delegates = _pte_and_delegates(program)
        runtime = Runtime.get()
        missing = sorted(d for d in delegates if not runtime.backend_registry.is_available(d))
        if missing:
            executor = backends.reference_executor(set(missing))
            if executor is None:
                raise UnsupportedByRuntime(
                    "the program holds delegates this machine's ExecuTorch runtime cannot run: "
                    f"{', '.join(missing)}",
                    hint=f"run it on {'; '.join(backends.runs_on(d) for d in missing)} "
                    f"(this runtime has {', '.join(runtime.backend_registry.registered_backend_names)})",
                )
            self._execute = executor(pte).run
        else:
            self._execute = runtime.load_program(pte).load_method("forward").execute

    def __call__(self, inputs: Sequence[Any]) -> list[torch.Tensor]:
        # Cloned: an output may live in the program's planned memory, which the next run reuses.
        outputs = self._execute(list(pytree.tree_leaves(tuple(inputs))))
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in outputs]


def run(artifact: Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run an emitted program (an Artifact or `.pte` bytes) once; returns its outputs flattened."""
    return LoadedProgram(artifact)(inputs)


@attrs.frozen
class CheckResult:
    max_abs_error: float
    max_rel_error: float
    outputs: int

    def within(self, tolerance: float) -> bool:
        return self.max_abs_error <= tolerance


def compare_with_eager(artifact: Any, module: torch.nn.Module, inputs: Sequence[Any]) -> CheckResult:
    """Run the program and the eager module on the same inputs; report the largest errors."""
    with torch.no_grad():
        expected = [x for x in pytree.tree_leaves(module(*inputs)) if isinstance(x, torch.Tensor)]
    actual = run(artifact, inputs)
    if len(actual) != len(expected):
        raise UserInputError(
            f"the program returned {len(actual)} outputs, eager returned {len(expected)}",
            hint="compare the module the program was compiled from",
        )
    max_abs = max_rel = 0.0
    for got, want in zip(actual, expected):
        got, want = got.to(torch.float64), want.to(torch.float64)
        if got.shape != want.shape:
            raise UserInputError(f"output shape {tuple(got.shape)} differs from eager {tuple(want.shape)}")
        diff = (got - want).abs()
        if diff.numel():
            max_abs = max(max_abs, diff.max().item())
            max_rel = max(max_rel, (diff / want.abs().clamp_min(1e-6)).max().item())
    return CheckResult(max_abs, max_rel, len(expected))
