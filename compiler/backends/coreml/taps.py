"""The values of the Edge nodes inside a Core ML payload, as its MIL program computes them
(the Core ML entry of `compiler.backends.INTERMEDIATE_VALUES`, read by `compiler.locate`).

The payload's MIL program runs in the reference interpreter (`interpreter.py`) bound as the
delegate binds it (`reference.CoreMLDelegate`), every var kept. coremltools' torch frontend
names the var that holds a node's value after the node (`context.add(res, torch_name=node.name)`),
and its float16 pass renames an op it recasts `<op name>_cast_fp16`; so a node's value is, in
order: the var named like the node (`aten_gelu_default`), the var `<node>_cast_fp16`, the payload
output in the node's place among the delegate's outputs (`metadata.json` `outputNames`), or the
last op whose EXIR debug handle is the node's (the payload's `debug_info.json` maps each op's
output var to the debug handles of the nodes it came from: what a var renamed by a pass, such
as fp16's `linear_0_cast_fp16`, still carries). The last three need the delegate's original
program (its nodes' names, outputs and debug handles); without it, every var the payload
computes is given under its own name (a `_cast_fp16` suffix dropped, the float32 var preferred),
which is the node's name wherever coremltools kept it.
"""

from __future__ import annotations

import json
import operator
import pathlib
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from compiler.backends.taps import PayloadValues, describe_op, node_value

_FP16_SUFFIX = "_cast_fp16"


def intermediate_values(
    processed: bytes, inputs: Sequence[Any], named_data: Mapping[str, bytes] | None = None,
    program: Any = None,
) -> PayloadValues:
    """Node name -> its value as the payload computes it (in the node's dtype and shape when
    `program`, the delegate's original ExportedProgram, is given); `.ops`: node name -> the MIL
    op(s) that compute it."""
    from compiler.backends.coreml.reference import CoreMLDelegate

    delegate = CoreMLDelegate(processed)
    env = _run_keeping_every_var(delegate, inputs)
    every = delegate.interpreter.function.operations
    ops = [op for op in every if op.op_type != "const"]
    producer = {var.name: op for op in ops for var in op.outputs}
    if program is None:
        return _by_var_name(env, producer)
    named = {var.name: op for op in every for var in op.outputs}  # a node coremltools folded is a const
    handles = _debug_handles(processed)
    return _by_node(program, env, ops, named, handles, delegate.output_names)


def _run_keeping_every_var(delegate: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    """Run the payload once and return every var's value (MIL is SSA: none is overwritten)."""
    interpreter = delegate.interpreter
    kept: dict[str, Any] = {}
    run_op = interpreter._run_op

    def recording(op: Any, env: dict[str, Any]) -> None:
        run_op(op, env)
        kept.update((var.name, env[var.name]) for var in op.outputs)

    interpreter._run_op = recording  # this delegate's interpreter only
    try:
        delegate.execute(list(inputs))
    finally:
        del interpreter._run_op
    return kept


def _debug_handles(processed: bytes) -> dict[str, tuple[int, ...]]:
    """MIL output var name -> the EXIR debug handles of the nodes its op came from, from the
    payload's `debug_info.json` (`debugSymbolToHandles`, keyed `<var>:<op type>`); empty if none."""
    from executorch.backends.apple.coreml import executorchcoreml

    with tempfile.TemporaryDirectory() as folder:
        executorchcoreml.unflatten_directory_contents(processed, folder)
        found = next(pathlib.Path(folder).rglob("debug_info.json"), None)
        info = json.loads(found.read_text()) if found is not None else {}
    symbols = info.get("debugSymbolToHandles") or {}
    return {symbol.rsplit(":", 1)[0]: tuple(h for h in handles if h is not None) for symbol, handles in symbols.items()}


def _is_precision_cast(op: Any) -> bool:
    """A cast between float16 and float32 (the fp16 pass's), not one the model asked for."""
    if op.op_type != "cast":
        return False
    from coremltools.converters.mil.mil import types

    floats = {types.fp16, types.fp32}
    return op.inputs["x"].dtype in floats and op.outputs[0].dtype in floats


def describe(op: Any) -> str:
    """A MIL op and its constant attributes (`gelu (mode EXACT)`), weights left out."""
    attributes = {}
    for name, var in op.inputs.items():
        if isinstance(var, (list, tuple)) or var.val is None:
            continue
        value = var.val
        if isinstance(value, str):
            attributes[name] = value
        elif np.ndim(value) == 0:
            attributes[name] = np.asarray(value).item()
        elif np.asarray(value).dtype.kind in "iub" and np.size(value) <= 8:
            attributes[name] = np.asarray(value).tolist()
    if op.op_type == "const":
        return "const (folded at conversion)"
    if op.op_type == "cast":
        attributes.pop("dtype", None)
        attributes["dtype"] = _mil_dtype_name(op.outputs[0])
    return describe_op(op.op_type, attributes)


def _mil_dtype_name(var: Any) -> str:
    from coremltools.converters.mil.mil import types

    return types.builtin_to_string(var.dtype)


def _computing_op(op: Any, producer: Mapping[str, Any]) -> Any:
    """The op that computed a var: through the fp16 pass's casts back to float32."""
    while _is_precision_cast(op) and op.inputs["x"].name in producer:
        op = producer[op.inputs["x"].name]
    return op


def _tensor(value: Any) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(value))


def _by_var_name(env: Mapping[str, Any], producer: Mapping[str, Any]) -> PayloadValues:
    values, ops = {}, {}
    for name, op in producer.items():
        key = name[: -len(_FP16_SUFFIX)] if name.endswith(_FP16_SUFFIX) else name
        if key in values and key != name:
            continue  # the float32 var of the same name came first or comes later: it wins
        values[key] = _tensor(env[name])
        ops[key] = describe(_computing_op(op, producer))
    return PayloadValues(values, ops)


def _var_names(node: torch.fx.Node) -> tuple[str, ...]:
    """The names coremltools gives the var of a node's value: the node's (its float16 recast's);
    for an item of a multi-output op, the op's output of that index (`<op>_<i>`, `<op>_cast_fp16_<i>`),
    as the items' getitem nodes share their op's debug handle (the handle would give the first)."""
    names = (node.name, node.name + _FP16_SUFFIX)
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        source, index = node.args[0].name, node.args[1]
        names += (f"{source}_{index}", f"{source}{_FP16_SUFFIX}_{index}")
    return names


def _by_node(
    program: Any, env: Mapping[str, Any], ops: Sequence[Any], named: Mapping[str, Any],
    handles: Mapping[str, tuple[int, ...]], output_names: Sequence[str],
) -> PayloadValues:
    nodes = [
        n for n in program.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    var_of: dict[str, str] = {}  # node name -> the var holding its value
    for node in nodes:
        for name in _var_names(node):
            if name in named:
                var_of[node.name] = name
                break
    outputs = program.graph.output_node().args[0]
    if len(outputs) == len(output_names):
        for source, name in zip(outputs, output_names):
            if isinstance(source, torch.fx.Node) and source.name not in var_of and name in named:
                var_of[source.name] = name
    claimed = {id(named[v]): n for n, v in var_of.items()}
    by_handle: dict[int, list[Any]] = {}
    for op in ops:
        for handle in handles.get(op.outputs[0].name, ()):
            by_handle.setdefault(handle, []).append(op)
    # A node no var is named after: the last op of its debug handle's that no other node's var
    # is, of its size (of several nodes of one handle, the last one's).
    last_of_handle = {n.meta.get("debug_handle"): n for n in nodes if n.name not in var_of}
    for handle, node in last_of_handle.items():
        size = node.meta["val"].numel() if all(isinstance(d, int) for d in node.meta["val"].shape) else None
        for op in reversed(by_handle.get(handle, [])):
            if id(op) in claimed:
                continue
            value = env.get(op.outputs[0].name)
            if value is not None and (size is None or np.size(value) == size):
                var_of[node.name] = op.outputs[0].name
                claimed[id(op)] = node.name
                break
    values, described = {}, {}
    for node in nodes:
        var = var_of.get(node.name)
        if var is None or var not in env:
            continue
        values[node.name] = node_value(_tensor(env[var]), node.meta["val"])
        own = [
            op for op in by_handle.get(node.meta.get("debug_handle"), [])
            if claimed.get(id(op), node.name) == node.name and not _is_precision_cast(op)
        ]
        computing = _computing_op(named[var], named)
        if computing not in own:
            own = [computing]
        described[node.name] = ", ".join(describe(op) for op in own)
    return PayloadValues(values, described)


def refused_node(
    processed: bytes, refusal: Any, named_data: Mapping[str, bytes] | None = None, program: Any = None,
) -> tuple[str, str] | None:
    """The Edge node of the delegate's original `program` whose payload op the reference runner
    refused (`refusal`, a `MilInterpreterError`: its `nodes` name the MIL op or var, an
    `AliasedPayloadOutput` its `output` position), and that op described; None if unknown."""
    from compiler.backends.coreml.interpreter import load_payload
    from compiler.backends.coreml.payload import read_reference

    if program is None:
        return None
    outputs = program.graph.output_node().args[0]
    position = getattr(refusal, "output", None)
    if isinstance(position, int) and position < len(outputs) and isinstance(outputs[position], torch.fx.Node):
        name = refusal.nodes[0] if refusal.nodes else "?"
        return outputs[position].name, f"output {name!r}, bound to another tensor of the delegate"
    link = read_reference(processed)
    payload = processed if link is None else bytes((named_data or {})[link["key"]])
    mil, _ = load_payload(payload)
    function = mil.functions["main" if link is None else link["functionName"]]
    producer = {var.name: op for op in function.operations for var in op.outputs}
    by_name = {op.name: op for op in function.operations}
    nodes = {n.name: n for n in program.graph.nodes if n.op == "call_function"}
    handles = _debug_handles(processed)
    for name in refusal.nodes:
        op = producer.get(name) or by_name.get(name)
        key = name[: -len(_FP16_SUFFIX)] if name.endswith(_FP16_SUFFIX) else name
        described = describe(op) if op is not None else name
        if key in nodes:
            return key, described
        if op is not None:  # a var renamed by a pass: the last node of its op's debug handles
            wanted = set(handles.get(op.outputs[0].name, ()))
            hits = [n for n in nodes.values() if n.meta.get("debug_handle") in wanted]
            if hits:
                return hits[-1].name, described
    return None
