"""Bisection by node inside the first diverging stage.

The stage's program and the last good stage's program both run node by node; each node of the
diverging program is matched to the node of the good one that computes the same value, through
its provenance: the same name (stages that keep nodes keep names), the same debug handle (Edge
programs), or the nearest node its `meta["from_node"]` chain names (a decomposition's ops name
the op they came from; of several of one shape, the last computes its value). The first node in
topological order whose value leaves the tolerance is named, with its inputs' errors and the
source line it came from. In a lowered program a delegate call is one node whose outputs are
matched through the delegate's original program; inside it, values come from the backend's
`intermediate_values` hook, or from cutting the delegate (`cut.py`).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import torch
from torch.export import ExportedProgram

from compiler.ir import dialect
from compiler.tools.locate import compare
from compiler.tools.locate.programs import ProgramRun
from compiler.tools.locate.report import Divergence, Step

logger = logging.getLogger(__name__)

DELEGATE_CALL = "executorch_call_delegate"


def op_name(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    return dialect.op_name(node.target)


def provenance(node: torch.fx.Node) -> list[str]:
    """The names of the nodes `node` came from, nearest first (`meta["from_node"]`)."""
    names: list[str] = []
    frontier = list(node.meta.get("from_node") or [])
    while frontier:
        source = frontier.pop(0)
        if source.name not in names:
            names.append(source.name)
        frontier += list(getattr(source, "from_node", None) or [])
    return names


def same_kind(one: torch.fx.Node, other: torch.fx.Node) -> bool:
    """The same dtype and shape; a data-dependent size is the same only as the same symbol
    (comparing two symbols' values would guard on data the program does not have here)."""
    a, b = one.meta.get("val"), other.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else str(x) == str(y) for x, y in zip(a.shape, b.shape)
    )


def _same_item(one: torch.fx.Node, other: torch.fx.Node) -> bool:
    """Two nodes of one name are one value unless they pick items of different ops' results, or
    different items (getitem nodes are named by count, whatever op they read)."""
    if one.target is not operator.getitem and other.target is not operator.getitem:
        return True
    return one.target is other.target and one.args[1:] == other.args[1:] and one.args[0].name == other.args[0].name


def match(good: ExportedProgram, bad: ExportedProgram) -> dict[str, str]:
    """Node of `bad` -> the node of `good` computing the same value (those without one left out)."""
    known = {n.name: n for n in good.graph.nodes if n.op != "output"}
    handles = {n.meta["debug_handle"]: n for n in known.values() if isinstance(n.meta.get("debug_handle"), int)}
    exact: dict[str, str] = {}
    derived: dict[str, list[str]] = {}  # good name -> bad nodes that came from it, in order
    for node in bad.graph.nodes:
        if node.op == "output":
            continue
        same = known.get(node.name)
        if same is not None and (same_kind(node, same) and _same_item(node, same) or node.op == "placeholder"):
            exact[node.name] = same.name
            continue
        handle = node.meta.get("debug_handle")
        if isinstance(handle, int) and handle in handles and same_kind(node, handles[handle]):
            derived.setdefault(handles[handle].name, []).append(node.name)
            continue
        for name in provenance(node):
            if name in known and same_kind(node, known[name]):
                derived.setdefault(name, []).append(node.name)
                break
    matched = dict(exact)
    taken = set(exact.values())
    for good_name, nodes in derived.items():
        if good_name not in taken:
            matched[nodes[-1]] = good_name  # of a decomposition's ops, the last makes the value
    return matched


def _frames(trace: str) -> list[tuple[str, str, str]]:
    """(file, line, code) of each frame of a `stack_trace`, outermost first."""
    frames, lines = [], trace.splitlines()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith('File "'):
            file, _, rest = text[len('File "'):].partition('", line ')
            number = rest.split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File") else ""
            frames.append((file, number, code))
    return frames


def source_line(trace: str | None) -> str | None:
    """The last frame outside torch itself (the user's or a library's code), as file:line: code."""
    if not trace:
        return None
    frames = _frames(trace)
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
    own = [f for f in frames if not f[0].startswith(torch_dir)] or frames
    if not own:
        return None
    file, number, code = own[-1]
    return f"{file}:{number}: {code}" if code else f"{file}:{number}"


def module_path(stack: Mapping[str, Any] | None) -> str | None:
    """The innermost module of `meta["nn_module_stack"]`: its path and class."""
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    cls = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1]
    return f"{path or '(the model)'} ({cls})"


def origin(node: torch.fx.Node, programs: Sequence[ExportedProgram]) -> tuple[str | None, str | None]:
    """The node's source line and module, from its own meta or the earliest kept program's node
    its provenance names; a node a pass made without either (a rewrite's op) takes those of the
    first node downstream that has them (the value the rewrite replaced), said so."""
    found = _own_origin(node, programs)
    if found != (None, None):
        return found
    found = _replaced_origin(node, programs)
    if found != (None, None):
        return found
    seen, frontier = {node.name}, list(node.users)
    while frontier:
        user = frontier.pop(0)
        if user.name in seen or user.op == "output":
            continue
        seen.add(user.name)
        source, module = _own_origin(user, programs)
        if source or module:
            return (f"{source} (via {user.name}, which it feeds)" if source else None), module
        frontier += list(user.users)
    return None, None


def _nearest(node: torch.fx.Node, step: Callable[[torch.fx.Node], Iterable[torch.fx.Node]], known: set[str]) -> set[str]:
    """The first nodes named in `known` going from `node` by `step` (inputs or users)."""
    found, seen, frontier = set(), {node.name}, list(step(node))
    while frontier:
        other = frontier.pop(0)
        if other.name in seen:
            continue
        seen.add(other.name)
        if other.name in known:
            found.add(other.name)
        else:
            frontier += list(step(other))
    return found


def _replaced_origin(node: torch.fx.Node, programs: Sequence[ExportedProgram]) -> tuple[str | None, str | None]:
    """For a node a rewrite made: the origin of the node of an earlier program it replaced, one
    between the same surviving neighbours there that this program no longer has."""
    here = {n.name for n in node.graph.nodes if n.op == "call_function"}
    for program in reversed(programs):  # the latest shares the most names
        by_name = {n.name: n for n in program.graph.nodes if n.op == "call_function"}
        known = here & set(by_name)
        before = _nearest(node, lambda n: n.all_input_nodes, known)
        after = _nearest(node, lambda n: n.users, known)
        if not before or not after:
            continue
        below = set().union(*(_descendants(by_name[n]) for n in before))
        for other in program.graph.nodes:
            if other.name in below and other.name not in here and _descendants(other) & after:
                found = _own_origin(other, programs)
                if found != (None, None):
                    return found
    return None, None


def _descendants(node: torch.fx.Node) -> set[str]:
    seen, frontier = set(), list(node.users)
    while frontier:
        other = frontier.pop()
        if other.name not in seen:
            seen.add(other.name)
            frontier += list(other.users)
    return seen


def _own_origin(node: torch.fx.Node, programs: Sequence[ExportedProgram]) -> tuple[str | None, str | None]:
    trace, stack = node.meta.get("stack_trace"), node.meta.get("nn_module_stack")
    if trace and stack:
        return source_line(trace), module_path(stack)
    names = [node.name, *provenance(node)]
    for program in programs:
        by_name = {n.name: n for n in program.graph.nodes}
        for name in names:
            other = by_name.get(name)
            if other is not None and (other.meta.get("stack_trace") or other.meta.get("nn_module_stack")):
                return (source_line(trace or other.meta.get("stack_trace")),
                        module_path(stack or other.meta.get("nn_module_stack")))
    return source_line(trace), module_path(stack)


@attrs.frozen
class NodeErrors:
    """Each compared node's error and tolerance, by the diverging program's node name."""

    errors: Mapping[str, float]
    tolerances: Mapping[str, float]
    # A node whose value differs other than in its numbers (dtype, shape; error inf): how.
    reasons: Mapping[str, str] = attrs.field(factory=dict)

    def over(self, name: str) -> bool:
        return name in self.errors and self.errors[name] > self.tolerances[name]


def node_errors(
    nodes: Iterable[torch.fx.Node], matched: Mapping[str, str], values: Mapping[str, Any],
    reference: Mapping[str, Any], run: ProgramRun, dtype: torch.dtype,
) -> NodeErrors:
    errors, tolerances, reasons = {}, {}, {}
    for node in nodes:
        other = matched.get(node.name)
        if other is None or node.name not in values or other not in reference:
            continue
        got, want = values[node.name], reference[other]
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
            continue
        tolerance = compare.tolerance(run, dtype, [got], [want]).absolute
        reason = compare.unlike(got, want, tolerance)
        e = float("inf") if reason else compare.error_as_consumed(got, want)
        if e is None:
            continue
        if not (want.is_floating_point() or want.is_complex()):
            e = float("inf") if e else 0.0
        errors[node.name] = e
        tolerances[node.name] = tolerance
        if reason:
            reasons[node.name] = reason
    return NodeErrors(errors, tolerances, reasons)


def path_to(node: torch.fx.Node, errors: NodeErrors, is_weight: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """The nodes from an input to `node`: back through the input furthest over its tolerance (or
    the first computed input where none was measured), weights left aside."""
    path = [node]
    seen = {node.name}
    while True:
        inputs = [n for n in path[-1].all_input_nodes if not is_weight(n) and n.name not in seen]
        if not inputs:
            break
        measured = [n for n in inputs if n.name in errors.errors]
        if measured:
            chosen = max(measured, key=lambda n: errors.errors[n.name] / max(errors.tolerances[n.name], 1e-30))
        else:
            chosen = next((n for n in inputs if isinstance(n.meta.get("val"), torch.Tensor)), inputs[0])
        path.append(chosen)
        seen.add(chosen.name)
    return list(reversed(path))


def steps(path: Sequence[torch.fx.Node], errors: NodeErrors) -> tuple[Step, ...]:
    return tuple(
        Step(n.name, op_name(n), errors.errors.get(n.name), errors.tolerances.get(n.name)) for n in path
    )


def weights(program: ExportedProgram) -> Callable[[torch.fx.Node], bool]:
    signature = program.graph_signature
    held = set(signature.inputs_to_parameters) | set(signature.inputs_to_buffers) | set(
        signature.inputs_to_lifted_tensor_constants
    )
    return lambda n: n.op == "placeholder" and n.name in held


def producer(node: torch.fx.Node) -> torch.fx.Node:
    """The node that computes `node`'s value: for an item of a multi-output op (a getitem, which
    only selects), that op; a delegate call's item is its own (the call is located inside)."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if (isinstance(source, torch.fx.Node) and source.op == "call_function"
                and getattr(source.target, "__name__", None) != DELEGATE_CALL):
            return source
    return node


def first_diverging(program: ExportedProgram, errors: NodeErrors) -> torch.fx.Node | None:
    """The first node (topological order) over its tolerance whose measured inputs are within theirs."""
    for node in program.graph.nodes:
        if node.op == "output" or not errors.over(node.name):
            continue
        if not any(errors.over(n.name) for n in node.all_input_nodes):
            return node
    return None


@attrs.frozen
class NodeFinding:
    divergence: Divergence | None
    path: tuple[Step, ...] = ()
    note: str | None = None
    # For a lowered program: the delegate call whose outputs diverge first (node name), if any.
    delegate_call: str | None = None


def divergence_at(
    node: torch.fx.Node, errors: NodeErrors, programs: Sequence[ExportedProgram], reference: str,
    found_by: str = "node values", delegate: str | None = None, op: str | None = None,
) -> Divergence:
    """The divergence at `node`; an item of a multi-output op is named as that op (the getitem only
    selects), with the item's error as the op's output error."""
    named = producer(node)
    source, module = origin(named, programs)
    inputs = tuple((n.name, errors.errors.get(n.name)) for n in named.all_input_nodes)
    return Divergence(
        named.name, op or op_name(named), errors.errors[node.name], errors.tolerances[node.name], inputs,
        source, module, delegate, found_by, reference, reason=errors.reasons.get(node.name),
    )


def by_node(
    good_name: str, good: ExportedProgram, good_run: ProgramRun, bad: ExportedProgram, bad_run: ProgramRun,
    dtype: torch.dtype, sources: Sequence[ExportedProgram],
) -> NodeFinding:
    """The first node of `bad` whose value leaves the tolerance against the node of `good` it
    matches (both runs kept their values); a lowered `bad`'s delegate outputs are matched through
    each delegate's original program."""
    matched = match_lowered(good, bad)
    errors = node_errors(bad.graph.nodes, matched, bad_run.values, good_run.values, bad_run, dtype)
    logger.info("locate: %d of %d nodes matched the %s program", len(errors.errors), len(bad.graph.nodes), good_name)
    node = first_diverging(bad, errors)
    if node is None:
        return NodeFinding(None, note=f"no node matched to the {good_name} program leaves its tolerance "
                           f"({len(errors.errors)} compared): the divergence is in nodes with no counterpart there")
    if node.op == "call_function" and node.target is operator.getitem and node.args[0].op == "call_function":
        call = node.args[0]
        if getattr(call.target, "__name__", None) == DELEGATE_CALL:
            lowered = getattr(bad.graph_module, call.args[0].target)
            return NodeFinding(
                None, steps(path_to(node, errors, weights(bad)), errors), delegate_call=call.name,
                note=f"the outputs of delegate call {call.name} ({lowered.backend_id}) diverge while its inputs agree",
            )
    divergence = divergence_at(node, errors, [bad, *sources], f"against the {good_name} program's {matched[node.name]}")
    return NodeFinding(divergence, steps(path_to(node, errors, weights(bad)), errors))


def delegate_outputs(lowered_program: ExportedProgram) -> dict[str, str]:
    """Each getitem of a delegate call in a lowered program -> the name of the node of the
    program before lowering whose value it is (the delegate's original program keeps names)."""
    named = {}
    for node in lowered_program.graph.nodes:
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        call = node.args[0]
        if getattr(call, "op", None) != "call_function" or getattr(call.target, "__name__", None) != DELEGATE_CALL:
            continue
        lowered = getattr(lowered_program.graph_module, call.args[0].target)
        outputs = lowered.original_module.graph.output_node().args[0]
        source = outputs[node.args[1]]
        if isinstance(source, torch.fx.Node):
            named[node.name] = source.name
    return named


def match_lowered(split: ExportedProgram, lowered: ExportedProgram) -> dict[str, str]:
    """`match`, with each delegate output matched through the delegate's original program."""
    matched = match(split, lowered)
    matched.update(delegate_outputs(lowered))
    return matched
