"""The values of the Edge nodes inside an MLX payload, as its instructions compute them (the
MLX entry of `compiler.backends.INTERMEDIATE_VALUES`, read by `compiler.locate`).

An MLX payload keeps no node names: its instructions read and write numbered tensor slots, and
the builder reuses a slot once every reader of its value has run. Which node each instruction
and slot stands for is known only while ExecuTorch's `MLXProgramBuilder` builds the graph, so
it is built again here from the delegate's original program (the `preprocess` call's input),
with the same named-data prefix and under the same handlers as our lowering, recording each
node's slot and how many instructions the builder had emitted when it marked the node handled
(its handler's instructions are those since the previous node's mark). The rebuilt graph must
serialize to the payload's bytes, else the mapping would not be the payload's and nothing is
given. The payload itself is not touched: the runtime gets the bytes it always got.

The payload then runs in the reference interpreter (`interpreter.py`), one main-chain
instruction at a time, every tensor-slot write kept; a node's value is the last write to its
slot by its own instructions, or, for a node with none (a view that aliases its input, the item
of a multi-output op), the last write to its slot before its mark by an instruction of one of
its inputs.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Mapping, Sequence

import torch

from compiler.backends.taps import PayloadValues, describe_op, node_value
from compiler.ir.errors import CompileError
from compiler.ir.private_api import mlx_build_recording_nodes


class PayloadNotRebuilt(CompileError):
    """The delegate's original program does not build to this payload: no node mapping."""


def intermediate_values(
    processed: bytes, inputs: Sequence[Any], named_data: Mapping[str, bytes] | None = None,
    program: Any = None,
) -> PayloadValues:
    """Node name -> its value as the payload computes it, in the node's dtype and shape;
    `.ops`: node name -> the MLX instructions its handler emitted. `program` (the delegate's
    original ExportedProgram, `LoweredBackendModule.original_module`) is required: the payload
    has no node names."""
    if program is None:
        raise PayloadNotRebuilt(
            "an MLX payload keeps no node names: its node values need the delegate's original program",
            hint="pass program=lowered_module.original_module",
        )
    mapping = _rebuild(program, processed)
    writes, main = _run(processed, inputs, named_data or {})
    return _values(program, mapping, writes, main)


class _Mapping:
    def __init__(self, marks: dict[str, tuple[int, int]], tids: dict[str, int]) -> None:
        self.marks = marks  # node name -> [first, end) of its instructions in the main chain
        self.tids = tids  # node name -> its tensor slot


def _rebuild(program: Any, processed: bytes) -> _Mapping:
    """Build the payload again from `program` as `MLXBackend.preprocess` does, recording nodes."""
    from compiler.backends.mlx import handlers
    from compiler.backends.mlx.generated import ensure_generated

    ensure_generated()
    handlers.register_item_of_a_tensor()
    handlers.register_index_put()
    from executorch.backends.mlx.serialization.mlx_graph_serialize import serialize_mlx_graph

    prefix = hashlib.sha256(str(program).encode()).hexdigest()[:4]  # as preprocess names its data
    # The builder may drop weights it repacked from the program's dicts: give it its own dicts.
    own = copy.copy(program)
    own._state_dict = dict(program._state_dict)
    own._constants = dict(program._constants)
    with handlers.dynamic_sizes_inferred():
        graph, marked, tids = mlx_build_recording_nodes(own, prefix)
    if serialize_mlx_graph(graph) != bytes(processed):
        raise PayloadNotRebuilt(
            "the delegate's original program does not build to this MLX payload here (another "
            "ExecuTorch, other handlers, or a payload not from this program): its nodes cannot be "
            "matched to the payload's slots",
            hint="read values inside this delegate by cutting it instead",
        )
    marks, start = {}, 0
    for name, end in marked.items():
        marks[name] = (start, end)
        start = end
    return _Mapping(marks, tids)


def _run(processed: bytes, inputs: Sequence[Any], named_data: Mapping[str, bytes]) -> tuple[list, list]:
    """Run the payload once: each tensor-slot write as (main-chain position, slot, value), and
    the main chain's decoded instructions."""
    from compiler.backends.mlx.generated import ensure_generated
    from compiler.backends.mlx.interpreter import Interpreter, MLXGraph, Tid

    ensure_generated()
    graph = MLXGraph(processed)
    main = graph.chains[graph.main_chain]
    single = len(graph.chains)
    graph.chains = graph.chains + [[instruction] for instruction in main]  # one chain per instruction
    interpreter = Interpreter(graph, named_data)
    writes: list[tuple[int, int, Any]] = []
    position = [-1]

    def recording_set(ref: Any, value: Any) -> None:
        Interpreter.set(interpreter, ref, value)
        if isinstance(ref, Tid):
            writes.append((position[0], ref.idx, value))

    def stepping_chain(index: int) -> None:
        if index != graph.main_chain:
            return Interpreter.run_chain(interpreter, index)  # a sub-chain: part of the current step
        for i in range(len(main)):
            position[0] = i
            Interpreter.run_chain(interpreter, single + i)

    interpreter.set = recording_set
    interpreter.run_chain = stepping_chain
    interpreter.execute(list(inputs))
    return writes, main


def _describe(instruction: Any) -> str:
    from compiler.backends.mlx.interpreter import Tid, Vid

    attributes = {}
    for name, value in instruction.fields.items():
        if isinstance(value, (Tid, Vid)) or value is None:
            continue
        if isinstance(value, (str, bool, int, float)):
            attributes[name] = value
        elif isinstance(value, list) and len(value) <= 8 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            attributes[name] = value
    return describe_op(instruction.kind, attributes)


def _values(program: Any, mapping: _Mapping, writes: list[tuple[int, int, Any]], main: list) -> PayloadValues:
    from compiler.backends.mlx.interpreter import to_torch

    by_position: dict[int, list[tuple[int, Any]]] = {}
    for position, tid, value in writes:
        by_position.setdefault(position, []).append((tid, value))
    owner = {}  # main-chain position -> the node whose handler emitted it
    for name, (first, end) in mapping.marks.items():
        for position in range(first, end):
            owner[position] = name
    values, ops = {}, {}
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        tid, span = mapping.tids.get(node.name), mapping.marks.get(node.name)
        if tid is None or span is None:
            continue
        first, end = span
        found = None
        for position in range(first, end):
            for written, value in by_position.get(position, ()):
                if written == tid:
                    found = value
        if first < end:
            described = [_describe(main[p]) for p in range(first, end)]
        else:
            inputs = {n.name for n in node.all_input_nodes}
            for position in range(first - 1, -1, -1):
                hits = [value for written, value in by_position.get(position, ()) if written == tid]
                if hits:
                    found = hits[-1] if owner.get(position) in inputs else None
                    break
            described = ["no instruction of its own (its input's slot)"]
        if found is None:
            continue
        values[node.name] = node_value(to_torch(found), node.meta["val"])
        ops[node.name] = ", ".join(described)
    return PayloadValues(values, ops)



def refused_node(
    processed: bytes, refusal: Any, named_data: Mapping[str, bytes] | None = None, program: Any = None,
) -> tuple[str, str] | None:
    """The Edge node of the delegate's original `program` whose payload instructions the reference
    runner refused (`refusal`, a `CompileError` of `interpreter.py`), and what it refused; None if
    unknown. A read of a slot no instruction wrote (`refusal.slot`) is the fault of the node that
    slot holds (whose handler should have written it), not of its reader; otherwise the node
    whose handler emitted the failing main-chain instruction (`refusal.instruction`)."""
    from compiler.backends.mlx.generated import ensure_generated
    from compiler.backends.mlx.interpreter import MLXGraph

    if program is None:
        return None
    mapping = _rebuild(program, processed)
    ensure_generated()
    graph = MLXGraph(processed)
    chain, position, kind = getattr(refusal, "instruction", None) or (None, None, None)
    at = position if chain == graph.main_chain else None
    main = graph.chains[graph.main_chain]
    slot = getattr(refusal, "slot", None)
    if slot is not None:
        # Of the nodes held in that slot, the last one marked before the reading instruction.
        holders = [
            name for name, tid in mapping.tids.items()
            if tid == slot and name in mapping.marks and (at is None or mapping.marks[name][0] <= at)
        ]
        if holders:
            holder = max(holders, key=lambda n: mapping.marks[n])
            reader = f", read by {_describe(main[at])}" if at is not None else ""
            return holder, f"tensor slot {slot}, never written{reader}"
    if at is not None:
        unwritten = f", reading tensor slot {slot}, which no instruction wrote" if slot is not None else ""
        for name, (first, end) in mapping.marks.items():
            if first <= at < end:
                return name, _describe(main[at]) + unwritten
    return None
