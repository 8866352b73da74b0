"""Emit: lowered program -> the `.pte` bytes ExecuTorch's runtime loads."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
from typing import Any, Mapping

import attrs
from torch.export import ExportedProgram

from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig
from executorch.exir.passes import MemoryPlanningPass

from compiler.ir.artifacts import ExecutorchProgram, LoweredMethods, LoweredProgram
from compiler.ir.placement import PlacementPlan
from compiler.ir.dynamic import fresh_symbols_dropped
from compiler.ir.errors import CompileError
from compiler.ir.graph import copy_program, delegate_calls, state_not_starting_at_zero
from compiler.ir.private_api import (
    blobs_spilled,
    data_dependent_strides_ordered,
    delegate_data_in_file,
    delegate_outputs_from_call_sites,
    deserialize_pte,
)
from compiler.ir.program_data import CONFIG_METHOD, SPILL_BLOB_BYTES, ProgramData, spill_directory
from compiler.reporting.progress import WeightsWritten
from compiler.reporting.report import Metric, counted, kib
from compiler.stages.base import Stage, StageContext
from compiler.stages.options import EmitOptions, constant_method_values
from compiler.ir.artifacts import METHOD


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


def _delegate_buffers(program: ExportedProgram) -> tuple[set[str], set[str]]:
    """(the mutable buffers the program's delegates hold as their own state, every buffer they hold)."""
    owned: set[str] = set()
    held: set[str] = set()
    for call in delegate_calls(program):
        signature = getattr(program.graph_module, call.args[0].target).original_module.graph_signature
        owned |= set(signature.buffers_to_mutate.values())
        held |= set(signature.inputs_to_buffers.values())
    return owned, held


def _buffer_kinds(program: ExportedProgram) -> dict[str, str]:
    """Each buffer's dtype and shape, by its name."""
    buffers = program.graph_signature.inputs_to_buffers
    kinds = {}
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" and node.name in buffers else None
        if value is not None:
            kinds[buffers[node.name]] = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return kinds


def _check_shared_state(lowered: Mapping[str, LoweredProgram]) -> None:
    """A buffer one method writes must be the program's, not a delegate's, wherever another method
    uses it: a delegate holds its state in its own payload, and a buffer its method only reads as
    a constant, so that method would see a copy of its own."""
    owned, held, written, on_cpu = {}, {}, {}, {}
    for name, one in lowered.items():
        owned[name], held[name] = _delegate_buffers(one.program)
        written[name] = owned[name] | set(one.program.graph_signature.buffers_to_mutate.values())
        on_cpu[name] = set(one.program.graph_signature.inputs_to_buffers.values())
    kinds = {name: _buffer_kinds(one.program) for name, one in lowered.items()}
    for name in lowered:
        for other in set(lowered) - {name}:
            unlike = sorted(b for b in written[name] & set(kinds[other]) if kinds[name].get(b, kinds[other][b]) != kinds[other][b])
            if unlike:
                raise CompileError(
                    f"methods {name!r} and {other!r} hold different buffers under one name: "
                    + ", ".join(f"{b} ({kinds[name][b]} and {kinds[other][b]})" for b in unlike),
                    stage="emit",
                    hint="the program plans a written buffer once by its name: give the methods' own state different "
                    "names",
                )
            shared = sorted(written[name] & held[other] | owned[name] & on_cpu[other])
            if shared:
                holder = other if written[name] & held[other] else name
                raise CompileError(
                    f"the state {', '.join(shared)} that method {name!r} writes and method {other!r} uses is held by "
                    f"a delegate of method {holder!r}, which keeps a copy of its own",
                    stage="emit",
                    hint="keep state the methods share on the CPU in every method (the backend's option not to take "
                    "over mutable buffers), or give it to one method only",
                )


# The data file's name inside the program: the runtime is given the file itself, whatever it is called.
WEIGHTS_FILE = "weights"


def _in_weights_file(node) -> str:
    """Every CPU constant goes to the data file (ExecuTorch's `external_constants` asks per node)."""
    return WEIGHTS_FILE


def _weights_file(emitted) -> ProgramData | None:
    """The data file ExecuTorch made beside the program (None: no weights), held like the program."""
    folder = tempfile.mkdtemp(prefix="staged-compiler-", dir=spill_directory())
    try:
        emitted.write_tensor_data_to_file(folder)
        made = os.path.join(folder, f"{WEIGHTS_FILE}.ptd")
        if not os.path.exists(made):
            return None
        handle, path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".ptd", dir=spill_directory())
        os.close(handle)
        os.replace(made, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return ProgramData(path=path).small_in_memory()


def emit_programs(
    lowered: Mapping[str, LoweredProgram], options: EmitOptions, metrics: dict[str, Any], recorded_config: str | None = None
) -> ExecutorchProgram:
    """One `.pte` of the named lowered programs. ExecuTorch's emitter stores a constant once by
    its bytes' hash, so weights the methods share are stored once; with several methods each
    mutable buffer is planned once by its name (memory id 2, one offset) for every method that
    uses it, and the buffers' names are emitted, so the methods share one state (one KV cache).
    `recorded_config`: the configuration the program records, in its method `CONFIG_METHOD`."""
    # to_executorch rewrites the graph in place (memory planning, out variants):
    # give it copies so the lowered artifacts stay what the lower stage returned.
    # Verification is ours (verify-each); ExecuTorch's own check would repeat it.
    shared = len(lowered) > 1
    if shared:
        _check_shared_state(lowered)
    programs = {name: copy_program(one.program) for name, one in lowered.items()}
    initialized = [target for program in programs.values() for target in keep_initial_state(program)]
    if initialized:
        metrics["initialized_state"] = len(initialized)
    with contextlib.ExitStack() as stack:
        if options.external_weights:  # the delegates' named data goes to the data file too
            stack.enter_context(delegate_data_in_file(programs.values(), WEIGHTS_FILE))
        manager = EdgeProgramManager(
            programs,
            constant_methods=_constant_methods(options, recorded_config) or None,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
    config = ExecutorchBackendConfig(
        extract_delegate_segments=options.extract_delegate_segments,
        emit_stacktrace=options.stacktrace,
        external_constants=_in_weights_file if options.external_weights else False,
        **(dict(memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True), emit_mutable_buffer_names=True)
           if shared else {}),
    )
    # Its passes retrace each program: each delegate call's outputs come from its call site.
    with contextlib.ExitStack() as stack:
        for program in programs.values():
            stack.enter_context(delegate_outputs_from_call_sites(program.graph_module))
            stack.enter_context(fresh_symbols_dropped(program))  # the copies share the lowered programs' ShapeEnv
        # The CPU's weights go to files as the emitter stores them, as the delegates' did in lower.
        stack.enter_context(blobs_spilled(spill_directory(), SPILL_BLOB_BYTES, WeightsWritten()))
        stack.enter_context(data_dependent_strides_ordered())
        emitted = manager.to_executorch(config)
    # The plans as emitted: reading them back from the bytes would copy every payload again.
    plans = [plan for plan in emitted.executorch_program.execution_plan if plan.name in programs]
    # Written as it is serialised, piece by piece (joining the pieces would hold every weight again);
    # a small program is then read back into memory.
    pte = ProgramData.written(emitted.write_to_file).small_in_memory()
    weights = _weights_file(emitted) if options.external_weights else None
    del emitted, manager  # its pieces of the .pte are in `pte` now
    metrics["pte_bytes"] = len(pte)
    if weights is not None:
        metrics["ptd_bytes"] = len(weights)
    calls = [plan_calls(plan) for plan in plans]
    operators = dict.fromkeys(_operator_name(op) for plan in plans for op in plan.operators)
    return ExecutorchProgram(
        data=pte,
        operators=tuple(operators),
        delegates=tuple(d.id for plan in plans for d in plan.delegates),
        plan=next(iter(lowered.values())).plan if not shared else PlacementPlan(()),
        kernel_calls=sum(c.cpu_calls for c in calls),
        delegate_calls=sum(c.delegates for c in calls),
        weights=weights,
    )


def _constant_methods(options: EmitOptions, recorded_config: str | None) -> dict[str, Any]:
    """The methods returning a constant: those asked for, and the configuration recorded."""
    constant: dict[str, Any] = constant_method_values(options.constant_methods)
    if recorded_config is not None:
        constant[CONFIG_METHOD] = recorded_config
    return constant


# What emitting reports, for one method or several.
METRICS = (
    Metric("initialized_state", "count", lambda n: f"kept the initial value of {counted(n, 'CPU buffer')}"),
    Metric("pte_bytes", "bytes", lambda n: f".pte of {kib(n)}"),
    Metric("ptd_bytes", "bytes", lambda n: f"weights in a .ptd of {kib(n)}"),
)


class Emit(Stage, takes=LoweredProgram, returns=ExecutorchProgram):
    metrics = METRICS

    def apply(self, lowered: LoweredProgram, ctx: StageContext) -> ExecutorchProgram:
        return emit_programs({METHOD: lowered}, ctx.options, ctx.metrics, ctx.recorded_config)


class EmitMethods(Stage, takes=LoweredMethods, returns=ExecutorchProgram):
    """Emit of a program of several methods (`compiler.compile_methods`): each method ran the
    stages before it on its own."""

    metrics = METRICS

    def apply(self, lowered: LoweredMethods, ctx: StageContext) -> ExecutorchProgram:
        return emit_programs(lowered.methods, ctx.options, ctx.metrics, ctx.recorded_config)
