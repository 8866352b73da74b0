"""Emit: lowered program -> the `.pte` bytes ExecuTorch's runtime loads."""

from __future__ import annotations

import collections

import attrs
from torch.export import ExportedProgram

from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig

from compiler.ir.artifacts import ExecutorchProgram, LoweredProgram
from compiler.ir.graph import copy_program, state_not_starting_at_zero
from compiler.ir.private_api import delegate_outputs_from_call_sites, deserialize_pte
from compiler.stages.base import Stage, StageContext
from compiler.stages.options import constant_method_values
from compiler.stages.shared import METHOD


def _operator_name(op) -> str:
    return f"{op.name}.{op.overload}" if op.overload else op.name


@attrs.frozen
class PlanCalls:
    """What an execution plan calls, counted the same way for our `.pte` and stock's."""

    delegates: int
    cpu_ops: collections.Counter  # CPU kernel name (e.g. "aten::addmm") -> calls

    @property
    def cpu_calls(self) -> int:
        return sum(self.cpu_ops.values())


def plan_calls(plan) -> PlanCalls:
    delegates, ops = 0, collections.Counter()
    for chain in plan.chains:
        for instruction in chain.instructions:
            kind = type(instruction.instr_args).__name__
            if kind == "DelegateCall":
                delegates += 1
            elif kind == "KernelCall":
                ops[plan.operators[instruction.instr_args.op_index].name] += 1
    return PlanCalls(delegates, ops)


def pte_calls(pte: bytes) -> PlanCalls:
    return plan_calls(deserialize_pte(pte).program.execution_plan[0])


def keep_initial_state(program: ExportedProgram) -> list[str]:
    """Mark CPU-owned mutable buffers whose initial value is not zero to be emitted with it.

    ExecuTorch serializes only the shape and dtype of a buffer the program mutates (the
    runtime hands out zeroed memory) unless its placeholder says `et_init_buffer`; a
    state that starts at anything but zero is then silently wrong on the device.
    """
    marked = state_not_starting_at_zero(program)
    for placeholder, _ in marked:
        placeholder.meta["et_init_buffer"] = True
    return [target for _, target in marked]


class Emit(Stage, takes=LoweredProgram, returns=ExecutorchProgram):
    def apply(self, lowered: LoweredProgram, ctx: StageContext) -> ExecutorchProgram:
        # to_executorch rewrites the graph in place (memory planning, out variants):
        # give it a copy so the lowered artifact stays what the lower stage returned.
        # Verification is ours (verify-each); ExecuTorch's own check would repeat it.
        program = copy_program(lowered.program)
        initialized = keep_initial_state(program)
        if initialized:
            ctx.metrics["initialized_state"] = len(initialized)
        manager = EdgeProgramManager(
            {METHOD: program},
            constant_methods=constant_method_values(ctx.options.constant_methods) or None,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        config = ExecutorchBackendConfig(
            extract_delegate_segments=ctx.options.extract_delegate_segments,
            emit_stacktrace=ctx.options.stacktrace,
        )
        # Its passes retrace the program: each delegate call's outputs come from its call site.
        with delegate_outputs_from_call_sites(program.graph_module):
            emitted = manager.to_executorch(config)
        # The plan as emitted: reading it back from the bytes would copy every payload again.
        plan = emitted.executorch_program.execution_plan[0]
        pte = emitted.buffer
        del emitted, manager  # its pieces of the .pte are joined into `pte` now
        ctx.metrics["pte_bytes"] = len(pte)
        calls = plan_calls(plan)
        return ExecutorchProgram(
            pte=pte,
            operators=tuple(_operator_name(op) for op in plan.operators),
            delegates=tuple(d.id for d in plan.delegates),
            plan=lowered.plan,
            kernel_calls=calls.cpu_calls,
            delegate_calls=calls.delegates,
        )
