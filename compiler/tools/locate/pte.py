"""`locate_program`: where a `.pte` we did not compile (stock ExecuTorch's, anyone's) leaves
eager's numbers, given the eager model and inputs.

    location = compiler.locate_program("model.pte", model, (x,))

There are no kept stages to bisect: the `.pte` runs whole (`LoadedProgram`: ExecuTorch's runtime
where it has every delegate, else the reference executor) against eager, held to the check's
tolerance for what the program computes in. When its outputs leave it, node values are compared:

- torch's side: the model exported (`torch.export`) and lowered as stock ExecuTorch lowers it
  for the delegates the `.pte` holds (`to_edge_transform_and_lower` with the stock partitioner,
  so its Edge nodes are decomposed, and named, as the payloads' are), every Edge node run in an
  fx interpreter, inside the delegates' original programs too;
- the program's side: the reference executor runs the `.pte` with a tap that keeps each
  instruction's outputs. A delegate with an `intermediate_values` hook (Core ML, MLX) gives the
  values inside its payload by Edge node name (Core ML's are named by its vars, so no program is
  passed; MLX payloads keep no names and are read through the rebuilt delegate's program when its
  inputs and outputs match the payload's); the i-th delegate call's outputs are the rebuilt
  program's i-th call's; a CPU kernel's output is matched to a rebuilt node by the order of ops
  (a `.pte` holds no debug handles: they are in ETRecord), among all the rebuilt nodes, those inside its
  delegates too (a `.pte` partitioned otherwise leaves on the CPU what the rebuild delegates).

The first matched node whose value leaves its tolerance while its measured inputs are within
theirs is named, with its payload op; values that could not be matched are said, not guessed.
"""

from __future__ import annotations

import difflib
import logging
import operator
import os
import time
from typing import Any, Sequence

import attrs
import torch
from torch.export.graph_signature import InputKind, OutputKind

from compiler import backends
from compiler.ir.errors import CompileError
from compiler.ir.targets import BY_DELEGATE_ID, NO_DELEGATE
from compiler.tools.locate import compare, nodes
from compiler.tools.locate.programs import ProgramRun, _Interpreter, placeholder_values, run_eager, user_leaves
from compiler.tools.locate.report import Divergence, Location, StageError, Step

logger = logging.getLogger(__name__)

STAGE = "the .pte"

def locate_program(pte: bytes | str | os.PathLike, model: torch.nn.Module, inputs: Any) -> Location:
    """Where the `.pte`'s outputs (bytes or a path) on `inputs` leave `model`'s, down to the node."""
    from compiler.process.dependency_output import DependencyOutput

    start = time.perf_counter()
    if not isinstance(pte, (bytes, bytearray)):
        with open(pte, "rb") as f:
            pte = f.read()
    pte = bytes(pte)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with DependencyOutput() as output:
        location = _locate(pte, model, inputs, start)
    logger.debug("while locating, dependencies printed: %s", output.leftover)
    return location


def _delegate_ids(pte: bytes) -> list[str]:
    from compiler.ir.private_api import deserialize_pte

    program = deserialize_pte(pte).program
    return [d.id for plan in program.execution_plan if plan.name == "forward" for d in plan.delegates]


def _backend_label(ids: Sequence[str]) -> str:
    names = [getattr(BY_DELEGATE_ID.get(i), "name", None) or i for i in dict.fromkeys(ids)]
    return "+".join(names) or NO_DELEGATE


def _locate(pte: bytes, model: torch.nn.Module, inputs: tuple, start: float) -> Location:
    from compiler.running.runtime import LoadedProgram

    ids = _delegate_ids(pte)
    label = _backend_label(ids)
    dtype = compare.model_dtype(model, user_leaves(inputs))
    expected = run_eager(model, inputs)
    loaded = LoadedProgram(pte)
    run = ProgramRun(tuple(loaded(inputs)), loaded.computes_in, loaded.computes_in_float16)
    by_reference = getattr(loaded, "_reference", None) is not None
    ran = "the reference executor (LoadedProgram)" if by_reference else "ExecuTorch's runtime (LoadedProgram)"
    compared = compare.outputs(run, expected, dtype)
    rows = [
        StageError("eager", "the model in torch (the reference)"),
        StageError(STAGE, ran, compared.max_error if compared.errors else None, compared.tolerance.absolute,
                   compared.tolerance.rule, compared.passed),
    ]
    if compared.passed:
        note = None
        if run.computes_in_float16:
            note = ("the outputs agree at float16's tolerance (the program's delegate computes in float16): a "
                    "conversion fault smaller than float16's noise cannot show in them, and a .pte built elsewhere "
                    "cannot be converted again computing in float32 here; compiler.locate(model, inputs, "
                    "backend=...) compiles the model and locates its float32 conversion too")
        return Location(label, tuple(rows), note=note, seconds=time.perf_counter() - start)

    rebuilt, rebuild_note = _rebuild(model, inputs, ids)
    if rebuilt is None:
        return Location(label, tuple(rows), STAGE, note=rebuild_note, seconds=time.perf_counter() - start)
    graph = _Flat.of(rebuilt)
    reference, rebuilt_outputs = graph.run(inputs)
    edge = compare.outputs(ProgramRun(rebuilt_outputs, torch.float32), expected, dtype)
    rows.insert(1, StageError(
        "edge", f"the model exported and decomposed as {'stock' if ids else 'to_edge'} does"
        f"{' for ' + label if ids else ''} (fx interpreter)",
        edge.max_error, edge.tolerance.absolute, edge.tolerance.rule, edge.passed,
    ))
    if not all(backends.delegate_runner(d) is not None for d in ids):
        note = (f"the program runs on ExecuTorch's runtime, which shows no values between its instructions nor "
                f"inside its {', '.join(dict.fromkeys(ids))} payloads, and the reference executor cannot run them: "
                "no node can be named from the .pte alone; compiler.locate(model, inputs, backend=...) compiles "
                "the model and cuts its stages")
        return Location(label, tuple(rows), STAGE, note=_join(rebuild_note, note), seconds=time.perf_counter() - start)
    measured, found_by, payload_ops, inside, unmatched = _program_values(pte, inputs, graph)
    for entry in graph.entries:  # the program was given the same inputs
        if entry.node.op == "placeholder" and not entry.weight and entry.delegate is None:
            measured.setdefault(entry.name, reference.get(entry.name))
            found_by.setdefault(entry.name, "the inputs given")
    errors = nodes.NodeErrors({}, {})
    for entry in graph.entries:
        if entry.name in measured and entry.name in reference:
            got, want = measured[entry.name], reference[entry.name]
            e = compare.error(got, want)
            if e is None or not isinstance(want, torch.Tensor):
                continue
            if not (want.is_floating_point() or want.is_complex()):
                e = float("inf") if e else 0.0
            errors.errors[entry.name] = e
            errors.tolerances[entry.name] = compare.tolerance(run, dtype, [got], [want]).absolute
    first = graph.first_diverging(errors)
    notes = [rebuild_note]
    if not by_reference:
        notes.append("node values are the reference executor's (torch's kernels for the program's CPU kernel "
                     "calls), the outputs ExecuTorch's runtime's")
    if unmatched:
        notes.append("not matched to a node of the model (no name or op to match them by), so not compared: "
                     + "; ".join(unmatched))
    if first is None:
        notes.append(f"no matched value leaves its tolerance ({len(errors.errors)} compared): the divergence is "
                     "in values that could not be matched"
                     + ("" if by_reference else ", or in a kernel of ExecuTorch's runtime computing otherwise than "
                        "torch's operator of the same name (which the reference executor runs)"))
        return Location(label, tuple(rows), STAGE, note=_join(*notes), seconds=time.perf_counter() - start)
    route = graph.path_to(first, errors)
    inputs_of = tuple((n, errors.errors.get(n)) for n in first.inputs)
    source, module = nodes.origin(first.node, graph.programs)
    divergence = Divergence(
        node=first.name, op=nodes.op_name(first.node), output_error=errors.errors[first.name],
        tolerance=errors.tolerances[first.name], input_errors=inputs_of, source=source, module=module,
        delegate=inside.get(first.name), found_by=found_by.get(first.name, "node values"),
        reference=f"against torch's value of the Edge node {first.name} (the model exported and decomposed again here)",
        payload_op=payload_ops.get(first.name),
    )
    path = tuple(Step(e.name, "input" if e.node.op == "placeholder" else nodes.op_name(e.node),
                      errors.errors.get(e.name), errors.tolerances.get(e.name)) for e in route)
    return Location(label, tuple(rows), STAGE, divergence, path, _join(*notes), time.perf_counter() - start)


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def _rebuild(model: torch.nn.Module, inputs: tuple, ids: Sequence[str]) -> tuple[Any, str | None]:
    """The model exported and lowered as stock lowers it for `ids` (their stock partitioners, default
    options), as an ExportedProgram whose delegates keep their original programs; with a note."""
    from executorch.exir import to_edge, to_edge_transform_and_lower

    try:
        with torch.no_grad():
            exported = torch.export.export(model, inputs, strict=False)
    except Exception as exc:  # noqa: BLE001 - whatever export raises is what we say
        return None, f"the model does not export ({type(exc).__name__}: {exc}): no node values to compare with"
    partitioners, unknown = [], []
    for delegate_id in dict.fromkeys(ids):
        target = BY_DELEGATE_ID.get(delegate_id)
        if target is None or target.stock_partitioner is None:
            unknown.append(delegate_id)
            continue
        # Stock's partitioner, as the rebuilt Edge nodes must carry the names the payloads were made from.
        partitioners.extend(backends.load(target.name).stock_partitioners())
    note = (f"no stock partitioner known here for {', '.join(unknown)}: its nodes are decomposed as to_edge does"
            if unknown else None)
    if partitioners:
        try:
            return to_edge_transform_and_lower(exported, partitioner=partitioners).exported_program(), note
        except Exception as exc:  # noqa: BLE001 - stock's own failure: fall back to plain to_edge
            note = _join(note, f"stock's lowering of the model failed ({type(exc).__name__}); its nodes are "
                         "decomposed as to_edge does")
    return to_edge(exported).exported_program(), note


@attrs.frozen
class _Entry:
    """A node of the rebuilt program, delegates' nodes inlined: its name, fx node, computed inputs."""

    name: str
    node: torch.fx.Node
    inputs: tuple[str, ...]
    weight: bool = False
    delegate: str | None = None  # "delegate call k (<id>)" for a node inside a delegate


class _Flat:
    """The rebuilt program with each delegate call replaced by its original program's nodes, in
    topological order; names resolve through `alias` (a delegate's inputs and outputs)."""

    def __init__(self, program: Any) -> None:
        self.program = program
        self.entries: list[_Entry] = []
        self.alias: dict[str, str] = {}
        self.calls: list[tuple[str, Any, list[str | None]]] = []  # (call node, lowered module, output names)
        self.programs = [program]

    @classmethod
    def of(cls, program: Any) -> "_Flat":
        flat = cls(program)
        flat._add(program, None)
        return flat

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def _add(self, program: Any, delegate: str | None) -> None:
        is_weight = nodes.weights(program)
        outputs_of: dict[str, list[str | None]] = {}
        for node in program.graph.nodes:
            if node.op == "placeholder":
                if delegate is None or is_weight(node):
                    self.entries.append(_Entry(node.name, node, (), is_weight(node), delegate))
            elif node.op != "call_function":
                continue
            elif getattr(node.target, "__name__", None) == nodes.DELEGATE_CALL:
                lowered = getattr(program.graph_module, node.args[0].target)
                inner = lowered.original_module
                self.programs.append(inner)
                given = [a for a in node.args[1:] if isinstance(a, torch.fx.Node)]
                users = [s.arg.name for s in inner.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
                for name, arg in zip(users, given):
                    if self.resolve(arg.name) != name:
                        self.alias[name] = self.resolve(arg.name)
                self._add(inner, f"{node.name} ({lowered.backend_id})")
                outs = [o.name if isinstance(o, torch.fx.Node) else None for o in inner.graph.output_node().args[0]]
                outputs_of[node.name] = outs
                self.calls.append((node.name, lowered, outs))
            elif node.target is operator.getitem and node.args[0].name in outputs_of:
                source = outputs_of[node.args[0].name][node.args[1]]
                if source is not None and self.resolve(source) != node.name:
                    self.alias[node.name] = self.resolve(source)
            else:
                inputs = tuple(self.resolve(n.name) for n in node.all_input_nodes)
                self.entries.append(_Entry(node.name, node, inputs, False, delegate))
        self.by_name = {e.name: e for e in self.entries}

    def run(self, inputs: tuple) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Every node's value (torch's), by name, and the program's user outputs."""
        values: dict[str, Any] = {}

        def delegate(lowered: Any, args: Sequence[Any]) -> tuple[Any, ...]:
            inner = lowered.original_module
            interpreter = _Interpreter(inner.graph_module, None, keep=True)
            out = interpreter.run(*placeholder_values(inner, [a for a in args if a is not None]),
                                  enable_io_processing=False)
            values.update(interpreter.values)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        interpreter = _Interpreter(self.program.graph_module, delegate, keep=True)
        with torch.no_grad():
            flat = interpreter.run(*placeholder_values(self.program, inputs), enable_io_processing=False)
        values.update(interpreter.values)
        flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        specs = self.program.graph_signature.output_specs
        return values, tuple(v for v, s in zip(flat, specs) if s.kind == OutputKind.USER_OUTPUT)

    def op_nodes(self) -> list[_Entry]:
        """The rebuilt program's op nodes, inside its delegates too, in order."""
        return [e for e in self.entries if e.node.op == "call_function"]

    def first_diverging(self, errors: nodes.NodeErrors) -> _Entry | None:
        for entry in self.entries:
            if errors.over(entry.name) and not any(errors.over(n) for n in entry.inputs):
                return entry
        return None

    def path_to(self, entry: _Entry, errors: nodes.NodeErrors) -> list[_Entry]:
        path, seen = [entry], {entry.name}
        while True:
            given = [self.by_name[n] for n in path[-1].inputs
                     if n in self.by_name and not self.by_name[n].weight and n not in seen]
            if not given:
                break
            measured = [e for e in given if e.name in errors.errors]
            if measured:
                chosen = max(measured, key=lambda e: errors.errors[e.name] / max(errors.tolerances[e.name], 1e-30))
            else:
                chosen = next((e for e in given if isinstance(e.node.meta.get("val"), torch.Tensor)), given[0])
            path.append(chosen)
            seen.add(chosen.name)
        return list(reversed(path))


def _kernel_name(op: Any) -> str:
    """`aten::add` for the operator of a kernel call (its overload, `out` and the like, left out)."""
    return op.name


def _node_kernel(entry: _Entry) -> str:
    """`aten::add` for an Edge node, as its out-variant kernel call names its operator."""
    name = nodes.op_name(entry.node)
    parts = name.split(".")
    return "::".join(parts[:2]) if len(parts) >= 2 else name


def _program_values(pte: bytes, inputs: tuple, graph: _Flat) -> tuple[dict, dict, dict, dict, list[str]]:
    """The program's values by rebuilt node name (from the reference executor's tap and the payloads'
    hooks), how each was read, the payload ops by node name, the program's delegate call holding a
    node, and what could not be matched."""
    from compiler.running.reference import ReferenceExecutor

    recorded: list[tuple[int, list[Any], list[Any]]] = []
    executor = ReferenceExecutor(pte, tap=lambda i, given, made: recorded.append((i, given, made)))
    executor.run(list(user_leaves(inputs)))
    plan = executor.plan("forward")
    instructions = plan.chains[0].instructions
    measured: dict[str, Any] = {}
    found_by: dict[str, str] = {}
    payload_ops: dict[str, str] = {}
    inside: dict[str, str] = {}
    unmatched: list[str] = []
    known = graph.by_name

    calls = [(i, given, made) for i, given, made in recorded if hasattr(instructions[i].instr_args, "delegate_index")]
    kernels = [(i, given, made) for i, given, made in recorded if hasattr(instructions[i].instr_args, "op_index")]
    aligned_calls = len(calls) == len(graph.calls)
    if not aligned_calls:
        unmatched.append(f"the outputs of the program's {len(calls)} delegate call(s) (the rebuilt program has "
                         f"{len(graph.calls)})")
    for k, (i, given, made) in enumerate(calls):
        call = instructions[i].instr_args
        delegate = plan.delegates[call.delegate_index]
        rebuilt = graph.calls[k] if aligned_calls else None
        if rebuilt is not None:
            for name, value in zip(rebuilt[2], made):
                if name is not None and isinstance(value, torch.Tensor):
                    measured[graph.resolve(name)] = value
                    found_by[graph.resolve(name)] = f"the delegate call's outputs (instruction {i})"
        hook = backends.intermediate_values(delegate.id)
        if hook is None:
            continue
        payload = bytes(executor.program.backend_delegate_data[delegate.processed.index].data)
        program = None
        keeps_names = getattr(BY_DELEGATE_ID.get(delegate.id), "payload_keeps_node_names", False)
        if not keeps_names and rebuilt is not None:  # MLX keeps no names: the rebuilt program's
            program = rebuilt[1].original_module
        try:
            values = hook(payload, given, executor.named_data, program=program)
        except CompileError as exc:
            unmatched.append(f"the values inside delegate call {k} ({delegate.id}): {exc.reason}")
            continue
        how = f"the {delegate.id} payload's intermediate values (reference executor, instruction {i})"
        if program is not None:
            how += ", matched through the rebuilt delegate's program"
        strays = []
        for name, value in values.items():
            if name in known:
                measured[name] = value
                found_by[name] = how
                inside[name] = f"{call.delegate_index} of the program ({delegate.id}, instruction {i})"
                if name in values.ops:
                    payload_ops[name] = values.ops[name]
            else:
                strays.append(f"{name} ({values.ops.get(name, '?')})")
        if strays:
            unmatched.append(f"payload values of delegate call {k} ({delegate.id}) named after no Edge node: "
                             + ", ".join(strays))

    # CPU kernels: aligned with the rebuilt program's nodes by the order of their ops (those inside its
    # delegates too: the .pte may have been partitioned otherwise, leaving on the CPU what stock delegates).
    ours = graph.op_nodes()
    theirs = [_kernel_name(plan.operators[instructions[i].instr_args.op_index]) for i, _, _ in kernels]
    matcher = difflib.SequenceMatcher(None, theirs, [_node_kernel(e) for e in ours], autojunk=False)
    paired: set[int] = set()
    for block in matcher.get_matching_blocks():
        for j in range(block.size):
            (i, _, made), entry = kernels[block.a + j], ours[block.b + j]
            want = entry.node.meta.get("val")
            tensors = [m for m in made if isinstance(m, torch.Tensor)]
            if isinstance(want, torch.Tensor) and len(tensors) == 1 and tuple(tensors[0].shape) == tuple(want.shape):
                measured[entry.name] = tensors[0]
                found_by[entry.name] = (f"the reference executor's value of instruction {i} ({theirs[block.a + j]}), "
                                        "matched by the order of ops")
                paired.add(block.a + j)
    stray_kernels = [f"instruction {kernels[n][0]} ({theirs[n]})" for n in range(len(kernels)) if n not in paired]
    if stray_kernels:
        unmatched.append("CPU kernel calls " + ", ".join(stray_kernels))
    return measured, found_by, payload_ops, inside, unmatched
