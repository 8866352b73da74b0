"""`check_nodes`: every node of a compiled program against eager, even where its outputs pass.

A program's outputs can agree with eager while a node inside computes otherwise: a softmax, a
sigmoid or a max behind it squashes the difference below the outputs' tolerance. Here each
node's value as the compiled program computes it is read (inside Core ML and MLX payloads
through their taps; inside XNNPACK's by lowering the partition again with every node an output;
on the CPU by emitting the lowered program again with every CPU node an output and running it
under the runtime) and compared with what eager's op gives **on the same inputs**: the op of the
captured program's node it came from (`nodes.match`), or, for a node with none (a rewrite's or a
decomposition's op), its own op, run by torch. A node without a value of its own (fused into the
op that reads it) is computed here from its inputs the same way, so its readers are still judged.

Judging each node on its own inputs holds it to its own precision and magnitude: an error that
came from upstream is not its own, so a deep float16 stack raises no false alarm, and a node
that computes otherwise is seen however its readers squash it.
"""

from __future__ import annotations

import logging
import operator
import re
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.export import ExportedProgram

from compiler import backends
from compiler.ir.errors import CompileError, UserInputError
from compiler.running.tolerance import largest_finite
from compiler.tools.locate import compare, cut, nodes
from compiler.tools.locate.programs import (
    PayloadRefused, ProgramRun, least_precise, placeholder_values, run_exported, user_leaves,
)
from compiler.tools.locate.report import Divergence
from compiler.ir.private_api import delegate_named_data

logger = logging.getLogger(__name__)

# A node's own error is held to this share of the larger of its eager value's and its inputs'
# largest magnitude (the inputs': a difference or a sum of large terms is as exact as its terms,
# not its result), by the precision it computes in, plus a floor for values near zero. Float32:
# a hundred units in the last place (another summation order over a 2048-long row, or another
# polynomial for exp or erf, is within a few); float16 and bfloat16: as the check (ten of their
# units: a payload computes a node in several rounded steps).
OWN_SHARE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
OWN_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# A quantizer's integer result may round one step otherwise on inputs one unit in the last
# place apart: it is held to one step, other integers and booleans to none.
ROUNDING_TO_INTEGER = ("quantize", "choose_qparams")
# A constant a converter folded computed its ops with its own library (numpy's sin of a large
# timestep differs from torch's in the fifth digit): held to a thousandth of its magnitude.
FOLDED_SHARE = 1e-3


@attrs.frozen
class NodeCheck:
    """Every compared node of a compiled program: those whose own error leaves their tolerance."""

    backend: str
    compared: int
    over: tuple[Divergence, ...] = ()
    unmeasured: tuple[str, ...] = ()  # nodes the program gives no value of their own (fused)
    refused: str | None = None  # a payload its runner refuses to run
    notes: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.over and self.refused is None

    @property
    def first(self) -> tuple[Divergence, ...]:
        """The nodes over their tolerance whose inputs are within theirs (the others read one of them)."""
        over = {d.node for d in self.over}
        return tuple(d for d in self.over if not any(name in over for name, _ in d.input_errors))

    def describe(self) -> str:
        verdict = "every one within its tolerance" if self.passed else f"{len(self.over)} over its tolerance"
        lines = [f"check nodes: {self.compared} nodes compared with eager's op on the compiled program's own "
                 f"inputs ({self.seconds:.1f} s): {verdict}"]
        if self.refused:
            lines.append(f"  {self.refused}")
        first = self.first
        for divergence in first:
            lines += divergence.lines(indent="  ")
        downstream = [d.node for d in self.over if d not in first]
        if downstream:
            lines.append(f"  also over, reading one of the above: {', '.join(downstream)}")
        if self.unmeasured:
            shown = ", ".join(self.unmeasured[:8]) + (", ..." if len(self.unmeasured) > 8 else "")
            lines.append(f"not compared: {len(self.unmeasured)} nodes with no value of their own in the compiled "
                         f"program (fused into their readers, which are compared): {shown}")
        lines += list(self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "passed": self.passed}


def check_nodes(result: Any, model: torch.nn.Module, inputs: Any, *, backend: Any = None,
                at_float32: bool = True) -> NodeCheck:
    """Compare every node of `result`'s compiled program with eager's op on the program's own
    inputs to it. `backend`: the Backend object it was compiled with, when not the one its
    configuration names. A program whose delegate computes in float16 is checked again
    converted computing in float32 (`at_float32`), where a fault below float16's noise shows."""
    from compiler.process.dependency_output import DependencyOutput

    del model  # the captured program is eager's graph; kept in the signature beside `locate`'s
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with DependencyOutput():
        found = _check(result, inputs, backend)
        remake = getattr(result, "at_float32", None)
        variant = remake() if at_float32 and found.refused is None and callable(remake) else None
        if variant is not None:
            also = _check(variant, inputs, None)
            seen = {d.node for d in found.over}
            extra = tuple(attrs.evolve(d, found_by=f"{d.found_by}, in the same partitions converted computing in "
                                                   "float32") for d in also.over if d.node not in seen)
            found = attrs.evolve(found, over=found.over + extra, seconds=found.seconds + also.seconds,
                                 notes=found.notes + (f"checked again converted computing in float32: "
                                                      f"{also.compared} nodes compared",))
    return found


def _check(result: Any, inputs: tuple, backend: Any) -> NodeCheck:
    start = time.perf_counter()
    name = result.config.backend
    stages = result.stages
    captured, split, lowered = stages.get("capture"), stages.get("split_constants"), stages.get("lower")
    if any(getattr(a, "program", None) is None for a in (captured, split, lowered)):
        raise UserInputError(
            "check_nodes needs the captured, split and lowered programs of a whole compile",
            hint="check the result of a compile that ran every stage (not one resumed after capture)",
        )
    backend = backend or backends.resolve(name, result.config.backend_options)
    try:
        run = run_exported(lowered.program, inputs, keep=True)
    except PayloadRefused as refused:
        return NodeCheck(name, 0, refused=f"the payload cannot run: {refused.reason}",
                         seconds=time.perf_counter() - start)
    measured = _Measured()
    _read_payloads(lowered.program, split, run, backend, result.config, inputs, measured)
    _read_runtime(lowered, backend, result.config, inputs, run, measured)
    # Where the precision stage changed the dtype the program computes in (a bfloat16 model on
    # XNNPACK computes in float32), each node is judged against its op in that dtype: the change
    # is the driver's choice, checked against the model by the output check, not a node's fault.
    chosen = getattr(stages.get("precision"), "program", None) or captured.program
    reference, counterpart = _reference(chosen, stages.get("decompose"), split.program, measured)
    # A captured program may write into its inputs in place: its placeholders are read before it runs.
    eager = {**run_exported(reference, inputs, keep=True).values, **_placeholders(reference, inputs)}
    in_torch = {**run_exported(split.program, inputs, keep=True).values, **_placeholders(split.program, inputs)}

    def judged() -> dict[str, _Verdict]:
        judge = _Judge(reference, split.program, counterpart, measured.values, eager, in_torch, run,
                       measured.payload_ops)
        return {node.name: verdict for node in split.program.graph.nodes
                if node.op == "call_function" and node.name in measured.values
                and (verdict := judge.node(node)) is not None}

    verdicts = judged()
    # A tap may read a var a converter's pass changed: the value the payload returns decides. Not for
    # a value of another kind or shape (a float where torch gives an integer): returned, it would be
    # cast to the node's dtype at the payload's boundary, and the fault hidden. Every node is judged
    # again after a cut: its readers' eager values were computed from the tap's value.
    cut_for = set()
    while tapped := [n for n, v in verdicts.items()
                     if v.over and v.reason is None and n in measured.tapped and n not in cut_for]:
        cut_for.update(tapped)
        _confirm_by_cutting(tapped, split, backend, result.config, inputs, measured)
        verdicts = judged()
    sources = [captured.program, reference, split.program]
    by_name = {n.name: n for n in split.program.graph.nodes}
    over = [v.divergence(by_name[n], sources, measured) for n, v in verdicts.items() if v.over]
    compared = len(verdicts)
    unmeasured = tuple(n.name for n in split.program.graph.nodes
                       if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
                       and n.name not in measured.values)
    return NodeCheck(name, compared, tuple(over), unmeasured, notes=tuple(measured.notes),
                     seconds=time.perf_counter() - start)


def _reference(captured: ExportedProgram, decomposed: Any, split: ExportedProgram,
               measured: _Measured) -> tuple[ExportedProgram, dict[str, str]]:
    """The program whose ops judge the compiled nodes, and each split node's counterpart there:
    the captured program, its in-place writes made functional (its ops kept) so that each node's
    value is one value (a write into a view changes what a node read before it holds). Where
    torch cannot make it functional (it traces a data-dependent size again, and loses it:
    `PendingUnbackedSymbolNotFound`), the decompose stage's program, functional already."""
    if not any(n.op == "call_function" and _mutates(n) for n in captured.graph.nodes):
        return captured, nodes.match(captured, split)
    try:
        functional = captured.run_decompositions({})
    except Exception as exc:  # torch's retrace, which has many ways to fail
        program = getattr(decomposed, "program", None)
        if program is None:
            raise
        measured.notes.append(f"each node is judged by the decompose stage's op: the captured program writes in "
                              f"place and torch could not make it functional ({type(exc).__name__})")
        return program, nodes.match(program, split)
    return functional, _through(nodes.match(captured, split), captured, functional)


def _through(matched: Mapping[str, str], captured: ExportedProgram, functional: ExportedProgram) -> dict[str, str]:
    """`matched` (split node -> captured node) carried on to the functional program's node of the
    same value: the one whose provenance names the captured node (made functional, the program's
    nodes are named anew, and a name may now be another node's)."""
    if functional is captured:
        return dict(matched)
    known = {n.name: n for n in captured.graph.nodes}
    same: dict[str, str] = {}
    for node in functional.graph.nodes:
        names = nodes.provenance(node) if node.op == "call_function" else [node.name]
        origin = next((name for name in names if name in known), None)
        if origin is not None and nodes.same_kind(node, known[origin]):
            same[origin] = node.name  # of several made from one node, the last computes its value
    return {split: same[captured_name] for split, captured_name in matched.items() if captured_name in same}


def _placeholders(program: ExportedProgram, inputs: tuple) -> dict[str, Any]:
    given = placeholder_values(program, inputs)
    return {n.name: v for n, v in zip((n for n in program.graph.nodes if n.op == "placeholder"), given)}


@attrs.define
class _Measured:
    """Node values of the split program's nodes as the compiled program computes them, and how."""

    values: dict[str, Any] = attrs.field(factory=dict)
    found_by: dict[str, str] = attrs.field(factory=dict)
    delegate: dict[str, str] = attrs.field(factory=dict)
    payload_ops: dict[str, str] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    tapped: set[str] = attrs.field(factory=set)  # values read through a backend's tap


def _calls(program: ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if getattr(n.target, "__name__", None) == nodes.DELEGATE_CALL]


def _computed(program: ExportedProgram) -> list[str]:
    return [n.name for n in program.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]


def _read_payloads(program: ExportedProgram, split: Any, run: ProgramRun, backend: Any, config: Any,
                   inputs: tuple, measured: _Measured) -> None:
    """Each delegate's node values: through its backend's tap, else by cutting (all such
    delegates in one lowering)."""
    to_cut: dict[str, str] = {}
    for call in _calls(program):
        module = getattr(program.graph_module, call.args[0].target)
        delegate = f"{call.name} ({module.backend_id})"
        hook = backends.intermediate_values(module.backend_id)
        values = None
        if hook is not None:
            given = [run.values[a.name] for a in call.args[1:] if isinstance(a, torch.fx.Node)]
            data = delegate_named_data(module)
            try:
                values = hook(module.processed_bytes, given, data, program=module.original_module)
            except CompileError as exc:
                measured.notes.append(f"{delegate}: its payload's values cannot be read ({exc.reason}); cut instead")
        computed = set(_computed(module.original_module))
        if values is None:
            to_cut.update((n.name, delegate) for n in module.original_module.graph.nodes
                          if n.name in computed and not _copies(n) and not _quantizer(n))
            continue
        found_by = f"the {module.backend_id} payload's intermediate values"
        wanted = {n.name for n in module.original_module.graph.nodes if n.name in computed and not _quantizer(n)}
        for node_name, value in values.items():
            if node_name in wanted:
                measured.values[node_name] = value
                measured.found_by[node_name] = found_by
                measured.delegate[node_name] = delegate
                measured.tapped.add(node_name)
        measured.payload_ops.update(getattr(values, "ops", {}))
    if to_cut:
        cutter = cut.Cut(split, backend, config, inputs)
        values = _cut_all(cutter, list(to_cut))
        seconds = sum(s for _, s in cutter.lowerings)
        found_by = f"cutting the delegate: lowered again with every node an output ({len(cutter.lowerings)} lowerings, {seconds:.1f} s)"
        for node_name, value in values.items():
            measured.values[node_name] = value
            measured.found_by[node_name] = found_by
            measured.delegate[node_name] = to_cut[node_name]


# Ops whose value is their input's: not cut out (a backend drops the copy, and two outputs of one
# value make the partition fail to lower); computed here from their input like a fused node.
COPIES = ("aten.clone.default", "dim_order_ops._clone_dim_order.default", "aten.alias_copy.default")


def _copies(node: torch.fx.Node) -> bool:
    return nodes.op_name(node) in COPIES


def _quantizer(node: torch.fx.Node) -> bool:
    """A quantize, dequantize or choose_qparams op: a backend fuses it into the op it feeds and
    holds its integers its own way (Core ML's uint8 for int8, XNNPACK's own scales), so it has no
    value of its own to compare; the float op reading it is compared."""
    return any(word in nodes.op_name(nodes.producer(node)) for word in ROUNDING_TO_INTEGER)


def _confirm_by_cutting(names: list[str], split: Any, backend: Any, config: Any, inputs: tuple,
                        measured: _Measured) -> None:
    """The values of `names` (over their tolerance as a tap read them) as the payload returns them:
    the partition lowered again with each an output. A converter's pass may have folded another
    node's op into the var a tap reads (Core ML's attention scale into a transpose); a value the
    payload returns is the node's own. A node the cut cannot return keeps the tap's value."""
    cutter = cut.Cut(split, backend, config, inputs)
    values = _cut_all(cutter, names)
    seconds = sum(s for _, s in cutter.lowerings)
    for name, value in values.items():
        measured.values[name] = value
        measured.found_by[name] = (f"{measured.found_by[name]}, then the partition lowered again with it an output "
                                   f"({seconds:.1f} s)")
        measured.tapped.discard(name)


def _cut_all(cutter: cut.Cut, names: list[str]) -> dict[str, Any]:
    """The values of as many of `names` as the backend gives a value of their own: all in one
    lowering, else each half, down to single nodes (those fused into their readers left out)."""
    if not names:
        return {}
    try:
        return cutter.values(names)
    except (CompileError, RuntimeError) as exc:  # not lowered, or the runtime would not load the payload
        if len(names) == 1:
            cutter.fused.append(names[0])
            return {}
        # XNNPACK names a value another partition reads, which it cannot also return: "Output node
        # 'aten_add_tensor' is already in the inputs". Left out, the rest goes in one lowering again.
        named = [n for n in re.findall(r"'([\w.]+)'", str(exc)) if n in names]
        if named:
            cutter.fused.extend(named)
            return _cut_all(cutter, [n for n in names if n not in named])
    middle = len(names) // 2
    return {**_cut_all(cutter, names[:middle]), **_cut_all(cutter, names[middle:])}


def _read_runtime(lowered: Any, backend: Any, config: Any, inputs: tuple, run: ProgramRun, measured: _Measured) -> None:
    """The CPU nodes' values (and the delegates' outputs) as the runtime computes them: the
    lowered program emitted again with each of them an output; the fx interpreter's where the
    runtime cannot be asked (said in a note)."""
    program = lowered.program
    names = _computed(program)
    outputs = nodes.delegate_outputs(program)
    values: Mapping[str, Any]
    try:
        values = cut.Cut(lowered, backend, config, inputs, span=cut.EMIT).values(names) if names else {}
        found_by = "the runtime: the lowered program emitted again with the node an output"
    except CompileError as exc:
        measured.notes.append(f"the CPU nodes' values are the fx interpreter's: emitting the program with them as "
                              f"outputs failed ({exc.reason.splitlines()[0]})")
        values = {n: run.values[n] for n in names if n in run.values}
        found_by = "the lowered program in the fx interpreter"
    for node_name, value in values.items():
        key = outputs.get(node_name, node_name)
        if node_name in outputs and key in measured.values:
            continue  # a delegate output: the payload's own reading already holds it
        measured.values[key] = value
        measured.found_by[key] = found_by


@attrs.frozen
class _Verdict:
    error: float
    tolerance: float
    reference: str
    input_errors: tuple[tuple[str, float | None], ...]
    reason: str | None = None

    @property
    def over(self) -> bool:
        return self.error > self.tolerance

    def divergence(self, node: torch.fx.Node, sources: Sequence[ExportedProgram], measured: _Measured) -> Divergence:
        named = nodes.producer(node)
        source, module = nodes.origin(named, sources)
        return Divergence(
            node.name, nodes.op_name(named), self.error, self.tolerance, self.input_errors, source, module,
            measured.delegate.get(node.name), measured.found_by.get(node.name, "node values"), self.reference,
            measured.payload_ops.get(node.name), self.reason,
        )


class _Local:
    """Values of one graph's nodes computed by torch from the compiled program's values: a node
    the program measured is its measured value; a placeholder is its own; any other node is its
    op on such values (memoized)."""

    def __init__(self, graph: torch.fx.Graph, measured: Callable[[str], Any], reference: Mapping[str, Any]) -> None:
        self.by_name = {n.name: n for n in graph.nodes}
        self.measured = measured
        self.reference = reference
        self.computed: dict[str, Any] = {}

    def value(self, node: torch.fx.Node) -> Any:
        got = self.measured(node.name)
        if got is not None:
            return _like(got, self.reference.get(node.name))
        if node.op != "call_function":
            return self.reference.get(node.name)
        return self.evaluate(node)

    def evaluate(self, node: torch.fx.Node) -> Any:
        """The node's op on its inputs' values here."""
        if node.name not in self.computed:
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
                self.computed[node.name] = self.evaluate(node.args[0])[node.args[1]]
            else:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.value)
                if _mutates(node):  # an in-place op of a captured program: it must not write into a kept value
                    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
                with torch.no_grad():
                    self.computed[node.name] = node.target(*args, **kwargs)
        return self.computed[node.name]


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _like(got: Any, want: Any) -> Any:
    """A measured value as the reference's value of the node: in its dtype and shape where it is
    the same kind of number and count, or a wider kind holding the same numbers (Core ML holds a
    boolean as 0.0 and 1.0); else as it is (a boolean where torch gives a float is a fault of its
    own), so its readers are judged on what they were given."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return got
    if got.numel() == want.numel():
        got = got.reshape(want.shape)
    if _width(got) == _width(want):
        return got.to(want.dtype)
    if _width(got) > _width(want):
        converted = got.to(want.dtype)
        if torch.equal(converted.to(got.dtype), got):
            return converted
    return got


def _width(value: torch.Tensor) -> int:
    """bool 0, integer 1, floating 2: a kind holds every value of the kinds before it."""
    return 0 if value.dtype == torch.bool else 2 if value.is_floating_point() else 1


class _Judge:
    """Each node's own error: its measured value against eager's op (or its own, for a node
    with no counterpart) on the compiled program's values of its inputs."""

    def __init__(self, captured: ExportedProgram, split: ExportedProgram, counterpart: Mapping[str, str],
                 measured: Mapping[str, Any], eager: Mapping[str, Any], in_torch: Mapping[str, Any], run: ProgramRun,
                 payload_ops: Mapping[str, str] = {}) -> None:
        self.payload_ops = payload_ops
        self.unwritten: dict[str, bool] = {}
        to_split = {c: s for s, c in counterpart.items()}
        self.counterpart = counterpart
        self.measured = measured
        self.captured = {n.name: n for n in captured.graph.nodes}
        self.eager_side = _Local(captured.graph, lambda c: measured.get(to_split.get(c, "")), eager)
        self.own_side = _Local(split.graph, measured.get, in_torch)
        self.to_split = to_split
        self.run = run
        self.own_errors: dict[str, float] = {}
        self.inputs = set(captured.graph_signature.user_inputs) | set(split.graph_signature.user_inputs)

    def _unwritten(self, node: torch.fx.Node) -> bool:
        """Whether `node`'s value, as computed here, may hold memory never written: an allocation
        (`torch.empty`), or a fused node reading one (a measured value holds the program's own
        memory, which its readers computed from)."""
        if node.name not in self.unwritten:
            self.unwritten[node.name] = _uninitialized(node) or (
                node.op == "call_function" and node.name not in self.measured
                and any(self._unwritten(n) for n in node.all_input_nodes))
        return self.unwritten[node.name]

    def _own_error(self, node: torch.fx.Node, got: torch.Tensor) -> float:
        try:
            mine = self.own_side.evaluate(node)
        except Exception:  # an op torch cannot run on its own
            return float("inf")
        if not isinstance(mine, torch.Tensor) or mine.shape != got.shape:
            return float("inf")
        return _or_infinite(compare.error_as_consumed(_like(got, mine), mine))

    def node(self, node: torch.fx.Node) -> _Verdict | None:
        if _uninitialized(node) or any(self._unwritten(n) for n in node.all_input_nodes):
            return None  # memory never written holds whatever it held: no value to compare
        if not node.users:
            return None  # read by nothing: a backend need not compute it (XNNPACK returned garbage for one)
        got = self.measured[node.name]
        twin = self.captured.get(self.counterpart.get(node.name, ""))
        try:
            if twin is not None and twin.op == "call_function":
                side, local = self.eager_side, twin
                reference = f"eager's {nodes.op_name(twin)} ({twin.name}) on the compiled program's inputs to it"
            else:
                side, local = self.own_side, node
                reference = "its own op run by torch on the compiled program's inputs to it"
            want = side.evaluate(local)
            inputs = [side.value(n) for n in local.all_input_nodes]
        except Exception as exc:  # an op torch cannot run on its own (a payload-only op): not judged
            logger.info("check nodes: %s not judged (%s: %s)", node.name, type(exc).__name__, str(exc).splitlines()[0])
            return None
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
            return None
        tolerance = _tolerance(node, got, want, inputs, self.run) + _activation_steps(side, local, want, self.inputs)
        got = _like(got, want)
        want = _saturated(want, got, _precision(got, want, self.run))
        reason = compare.unlike(got, want, tolerance)
        error = float("inf") if reason else compare.error_as_consumed(got, want)
        if error is None:
            return None
        if error > tolerance and not reason:
            error = min(error, _fused_retry_error(side, local, got, want))
        if error > tolerance and not reason and side is self.eager_side and _same_op(node, twin):
            # The counterpart may be one of the same shape but another meaning (attention's views of
            # one shape): the node's own op on the same inputs decides then. Not for the last node
            # of a rewrite (an `add` standing for a layer norm): its own op agrees with whatever
            # the rewrite computed, right or wrong.
            error = min(error, self._own_error(node, got))
        folded = "const (folded at conversion)" in (self.payload_ops.get(node.name) or "")
        if error > tolerance and folded and want.is_floating_point():
            tolerance = max(tolerance, FOLDED_SHARE * _scale(want, inputs))
        self.own_errors[node.name] = error
        input_errors = tuple((n.name, self.own_errors.get(n.name)) for n in node.all_input_nodes
                             if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor))
        return _Verdict(error, tolerance, reference, input_errors, reason)


# Ops that are one op under two spellings (Edge's `_copy` forms aside): a view by any name.
_SPELLINGS = {"reshape": "view", "_unsafe_view": "view", "transpose": "permute", "t": "permute"}


def _base_op(node: torch.fx.Node) -> str:
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return f"{_base_op(node.args[0])}[{node.args[1]}]"
    parts = nodes.op_name(node).split(".")
    name = parts[-2 if len(parts) > 1 else -1].replace("_dim_order", "").removesuffix("_copy")
    return _SPELLINGS.get(name, name)


def _same_op(node: torch.fx.Node, twin: torch.fx.Node) -> bool:
    """Whether a compiled node computes its counterpart's op, not stands for it as a rewrite's."""
    return _base_op(node) == _base_op(twin)


def _uninitialized(node: torch.fx.Node) -> bool:
    """An op that allocates without writing (`torch.empty` and its kin)."""
    return node.op == "call_function" and "empty" in nodes.op_name(node).split(".")[-2:][0]


def _eager_for_fused(side: _Local, node: torch.fx.Node) -> Any:
    """`node`'s op on its inputs, each fused one (no value of its own) as eager computed it."""
    def value(n: torch.fx.Node) -> Any:
        if side.measured(n.name) is None and n.op == "call_function":
            return side.reference.get(n.name)
        return side.value(n)

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
    with torch.no_grad():
        return node.target(*args, **kwargs)


def _activation_steps(side: _Local, node: torch.fx.Node, want: torch.Tensor, inputs: set[str]) -> float:
    """For an op reading an activation quantized as the program runs (a dequantize of values
    computed from the user's inputs, not of a weight): what moving every element of it one
    quantization step, by random signs, does to the op's value. A backend quantizes with its own
    scales and rounding (XNNPACK's dynamic quantization) and lands a step away from eager's on
    some elements, as the check allows for its outputs (`activation_allowance`)."""
    if not want.is_floating_point():
        return 0.0
    quantized = [n for n in node.all_input_nodes if "dequantize" in nodes.op_name(n) and _reads(n, inputs)]
    if not quantized:
        return 0.0
    generator = torch.Generator().manual_seed(0)
    moved = {}
    try:
        for source in quantized:
            value = side.value(source)
            step = _argument(source, ("scale", "scales"))
            step = torch.as_tensor(side.value(step) if isinstance(step, torch.fx.Node) else step, dtype=value.dtype)
            if step.dim() and step.dim() < value.dim():  # one scale per row (per token)
                step = step.reshape(step.shape + (1,) * (value.dim() - step.dim()))
            signs = torch.randint(0, 2, value.shape, generator=generator).to(value.dtype) * 2 - 1
            moved[source.name] = value + step * signs
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: moved[n.name] if n.name in moved else side.value(n))
        with torch.no_grad():
            shifted = node.target(*args, **kwargs)
    except Exception as exc:  # a quantizer of another form: no allowance, said at INFO
        logger.info("check nodes: no activation step allowance for %s (%s)", node.name, exc)
        return 0.0
    return compare.error(shifted, want) or 0.0


def _argument(node: torch.fx.Node, names: Sequence[str]) -> Any:
    """The value `node` passes for the first schema argument called one of `names` (None: none)."""
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name in names:
            return node.kwargs.get(argument.name, node.args[position] if position < len(node.args) else None)
    return None


def _reads(node: torch.fx.Node, inputs: set[str]) -> bool:
    """Whether `node` depends on one of the user's inputs (named in `inputs`)."""
    seen, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.op == "placeholder" and current.name in inputs:
            return True
        frontier += current.all_input_nodes
    return False


def _precision(got: torch.Tensor, want: torch.Tensor, run: ProgramRun) -> torch.dtype:
    """The least precise of the node's dtypes and what the program computes in."""
    precision = least_precise([want.dtype, got.dtype if got.is_floating_point() else None, run.computes_in,
                               torch.float16 if run.computes_in_float16 else None]) or torch.float32
    return precision if precision in OWN_SHARE else torch.float32


def _saturated(want: torch.Tensor, got: torch.Tensor, precision: torch.dtype) -> torch.Tensor:
    """Eager's value as a program computing in `precision` can hold it: beyond float16's range an
    infinity (a mask's float32 minimum, -3.4e38, is -inf in float16), where the program's value
    is that infinity too."""
    if precision == torch.float32 or not want.is_floating_point() or got.shape != want.shape:
        return want
    narrowed = want.to(precision).to(want.dtype)
    return torch.where(narrowed.isinf() & (got == narrowed), narrowed, want)


def _fused_retry_error(side: _Local, local: torch.fx.Node, got: torch.Tensor, want: torch.Tensor) -> float:
    """The error again with each fused input as eager computed it, not computed here from the
    program's values before it: that chain runs through other nodes' counterparts, and one of one
    shape but another meaning (a transposed square) raised an alarm the node was not to blame for
    (ACT's attention on Core ML)."""
    if all(side.measured(n.name) is not None or n.op != "call_function" for n in local.all_input_nodes):
        return float("inf")
    try:
        again = _eager_for_fused(side, local)
    except Exception:  # the op on eager's values of another dtype: no second reading
        return float("inf")
    if not isinstance(again, torch.Tensor) or again.shape != want.shape:
        return float("inf")
    return _or_infinite(compare.error_as_consumed(got, again.to(want.dtype)))


def _or_infinite(error: float | None) -> float:
    """An error for a second reading: none (nothing to compare) never clears a node; 0.0 does."""
    return float("inf") if error is None else error


def _tolerance(node: torch.fx.Node, got: torch.Tensor, want: torch.Tensor, inputs: Sequence[Any], run: ProgramRun) -> float:
    """The error a node's own computation may make, for the precision it computes in and the
    magnitude of its value and inputs (see OWN_SHARE)."""
    if not want.is_floating_point():
        rounds = any(word in nodes.op_name(node) for word in ROUNDING_TO_INTEGER)
        return 1.0 if rounds else 0.0
    precision = _precision(got, want, run)
    return OWN_SHARE[precision] * _scale(want, inputs) + OWN_FLOOR[precision]


def _scale(want: torch.Tensor, inputs: Sequence[Any]) -> float:
    """The larger of a value's and its floating inputs' largest finite magnitude."""
    floating = [v for v in user_leaves(inputs) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]
    return max([largest_finite(want.detach().double())] + [largest_finite(v.detach().double()) for v in floating])
