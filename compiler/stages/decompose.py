"""Decompose: the captured program -> the Edge program, everything decomposed to Core ATen but
what the dry run planned to keep whole (the decomposition itself: `compiler.passes.decomposition`).

An op that no table decomposes and the backend does not keep whole is left as it is, and an
Edge program holds core ATen ops only: such an op is refused here, by name, saying that it has
no decomposition and whether the runtime has a kernel for it (else the Edge verifier refused
the program, and its refusal read as a bug of this stage)."""

from __future__ import annotations

from typing import Callable

import torch
from torch._export.verifier import SpecViolationError

from compiler.ir.artifacts import EdgeProgram, PlannedProgram
from compiler.ir.dialect import EDGE, op_dialect, op_name
from compiler.ir.errors import UnsupportedOp
from compiler.ir.graph import call_nodes
from compiler.ir.kernels import missing_kernel
from compiler.ir.private_api import aten_overload
from compiler.passes.decomposition import to_edge_program
from compiler.stages.base import Stage, StageContext
from compiler.reporting.report import Metric

CORE_ATEN = "https://pytorch.org/docs/stable/torch.compiler_ir.html#core-aten-ir"


def _makes_a_tensor(op: torch._ops.OpOverload) -> bool:
    """Ops that make no tensor (`_assert_scalar`, a size's range check) run as the runtime's asserts."""
    return any(isinstance(r.type, torch.TensorType) for r in op._schema.returns)


def _refused_by_the_verifiers(program: torch.export.ExportedProgram) -> Callable[[object], bool]:
    """Whether the program's own Edge verifiers refuse an op: not core ATen, not kept whole for the
    backend, nor on their list of exceptions (`aten.max.default`, `aten.full_like.default`...)."""
    checks = [verifier() for verifier in program.verifiers]

    def refused(target) -> bool:
        try:
            for check in checks:
                check.check_valid_op(target)
        except SpecViolationError:
            return True
        return False

    return refused


def undecomposed_ops(edge: EdgeProgram) -> dict[torch._ops.OpOverload, list[str]]:
    """The ATen ops of `edge` its Edge verifiers refuse (no table decomposed them, and they were
    not kept whole for the backend), each with the nodes calling it."""
    refused = _refused_by_the_verifiers(edge.program)
    left: dict[torch._ops.OpOverload, list[str]] = {}
    for node in call_nodes(edge.program):
        if op_dialect(node.target) != EDGE:
            continue  # the ATen ops an Edge program may hold (run-time asserts of sizes)
        op = aten_overload(node.target)
        if _makes_a_tensor(op) and refused(node.target):
            left.setdefault(op, []).append(node.name)
    return left


def _kernel_note(op: torch._ops.OpOverload) -> str:
    if missing_kernel(op) is None:
        return "a kernel in the portable runtime, which an Edge program cannot call (it holds core ATen ops only)"
    return "no kernel in the portable runtime"


def refuse_undecomposed(edge: EdgeProgram, backend: str) -> None:
    """Refuse, by name, the ops of `edge` that nothing can compile (`undecomposed_ops`)."""
    left = undecomposed_ops(edge)
    if not left:
        return
    ops = "; ".join(
        f"{op_name(op)} ({', '.join(nodes)}) has no decomposition to core ATen and {_kernel_note(op)}"
        for op, nodes in left.items()
    )
    raise UnsupportedOp(
        f"{ops}; the {backend} backend does not take {'it' if len(left) == 1 else 'them'} whole",
        nodes=[name for nodes in left.values() for name in nodes],
        hint=(
            f"compute that step of the model with ops that decompose to core ATen ({CORE_ATEN}), or outside the "
            "compiled program, or compile for a backend that converts the op"
        ),
    )


class Decompose(Stage, takes=PlannedProgram, returns=EdgeProgram):
    metrics = (
        Metric("from_dry_run", "flag", lambda _: "the dry run's decomposition, which kept exactly these ops whole"),
        Metric("retraced", "text", lambda why: f"decomposed by torch's retrace (node by node failed: {why})"),
    )

    """Keeps whole exactly what the dry run planned; never asks the backend again. When the dry
    run already made this very decomposition (it dropped nothing), that is the output."""

    def apply(self, planned: PlannedProgram, ctx: StageContext) -> EdgeProgram:
        if planned.decomposed is not None:
            ctx.metrics["from_dry_run"] = True
            edge = planned.decomposed
        else:
            fallbacks: list[str] = []
            with ctx.program_checks_skipped():
                edge = to_edge_program(planned.program, planned.keep_whole.nodes, fallbacks)
            if fallbacks:
                ctx.metrics["retraced"] = fallbacks[0]
        refuse_undecomposed(edge, ctx.backend.name)
        return edge
