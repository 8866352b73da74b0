"""ATen program -> Edge program, with ExecuTorch's own passes, skipping those that cannot apply.

It also finishes what those passes leave half done: ATen ops inserted after the
ATen-to-Edge replacement become Edge ops.

ExecuTorch's ATen-to-Edge conversion runs about a dozen passes, most of them
`ExportPass`es that retrace the whole graph with fake tensors even when they
change nothing: on a 48-block transformer each retrace costs about half a
second. The passes and their order are ExecuTorch's; what this module adds is a
cheap, conservative check per pass of whether the graph holds anything the
pass rewrites. A pass without such a check always runs.

The passes that only swap ops one for one (view ops for their `_copy` variants,
ATen ops for Edge ops, memory-format ops for dim-order ops) rewrite the nodes in
place instead of retracing, when the graph holds nothing but op calls (no
constants, no submodules, no symbols). A retrace also computes every value afresh
(a copy variant's output is contiguous, and so are the elementwise ops reading it;
values downstream of the parameters require grad), renames every node from its op
and stamps fresh metadata: `_restamp_values` gives the values, and one copy of the
graph into a fresh one at the end (`_as_retraced`) the names and metadata, so the
program is the one stock's conversion gives.

Runtime assertions export states through Python's symbolic helpers (`torch.sym_not`,
`torch.sym_ite`), which the Edge verifier refuses, are rewritten without them first, or
dropped, as `to_executorch` drops every assertion (`_sym_helpers_out`).
"""

from __future__ import annotations

import copy
import logging
import operator
import types
from typing import Callable, Iterable

import torch
from torch.export import ExportedProgram
from torch.fx.traceback import NodeSource, NodeSourceAction

from executorch.exir import EdgeCompileConfig
from executorch.exir.dim_order_utils import get_dim_order
from executorch.exir.passes import MemoryFormatOpsPass, OpReplacePass, remove_unused_parameters_pass
from executorch.exir.passes.convert_constant_dim_order_pass import convert_constant_dim_order_pass
from executorch.exir.passes.debug_handle_generator_pass import DebugHandleGeneratorPass
from executorch.exir.passes.dim_order_ops_registry import DimOrderOpsMap
from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
from executorch.exir.passes.remove_graph_asserts_pass import RemoveNonCoreAtenOpGraphAssertsPass
from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
from executorch.exir.passes.replace_aten_with_edge_pass import aten_to_edge, should_lower_to_edge
from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import (
    ReplaceBrokenOpsWithFunctionalOpsPass,
)
from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass
from executorch.exir.verification.verifier import EXIREdgeDialectVerifier
from torch._dispatch.python import enable_python_dispatcher
from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from compiler.ir.dialect import ATEN, op_dialect
from compiler.ir.errors import CompileError
from compiler.ir.private_api import (
    aten_to_edge_passes,
    is_edge_op,
    lift_constant_tensor_pass,
    python_sym_ops_to_executorch,
    transform,
    unwrap_pass,
    updated_graph_signature,
)

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

# The ops RemoveMixedTypeOperators promotes (it rewrites nothing else).
_PROMOTING_OPS = frozenset(
    [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.div.Tensor_mode, aten.minimum.default]
)


def _calls(gm: torch.fx.GraphModule) -> Iterable[torch.fx.Node]:
    return (n for n in gm.graph.nodes if n.op == "call_function")


def _has_transpose(gm: torch.fx.GraphModule) -> bool:
    return any(n.target is aten.t.default for n in _calls(gm))


def _has_view_op(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.is_view for n in _calls(gm))


def _has_symbolic_argument(gm: torch.fx.GraphModule) -> bool:
    return any(
        isinstance(a.meta.get("val"), _SYMBOLIC)
        for n in _calls(gm)
        if isinstance(n.target, torch._ops.OpOverload)
        for a in n.all_input_nodes
    )


def _has_mixed_types(gm: torch.fx.GraphModule) -> bool:
    """A promoting op whose output dtype differs from one of its inputs' (a cast is needed)."""
    for node in _calls(gm):
        if node.target not in _PROMOTING_OPS:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            return True  # cannot tell: let the pass decide
        for arg in node.args:
            value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
            if isinstance(value, torch.Tensor) and value.dtype != out.dtype:
                return True
            if isinstance(value, _SYMBOLIC):
                return True
            if isinstance(value, (bool, int, float)) and not out.dtype.is_floating_point:
                return True  # a Python number next to an integer or bool tensor
    return False


def _has_scalar_for_tensor(gm: torch.fx.GraphModule) -> bool:
    """A Python number passed where the op's schema takes a tensor (the pass makes it a constant)."""
    for node in _calls(gm):
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        for i, argument in enumerate(node.target._schema.arguments):
            if argument.name in node.kwargs:
                value = node.kwargs[argument.name]
            elif not argument.kwarg_only and i < len(node.args):
                value = node.args[i]
            else:
                continue
            if isinstance(value, (bool, int, float)) and isinstance(argument.type, torch.TensorType):
                return True
    return False


# Pass type -> "does the graph hold anything this pass rewrites?"
_APPLIES: dict[type, Callable[[torch.fx.GraphModule], bool]] = {
    NormalizeTransposePass: _has_transpose,
    ReplaceBrokenOpsWithFunctionalOpsPass: _has_view_op,
    ScalarToTensorPass: _has_scalar_for_tensor,
    SymToTensorPass: _has_symbolic_argument,
    RemoveMixedTypeOperators: _has_mixed_types,
}


def _is_static(value) -> bool:
    """No symbol in a value's shape (a retrace may make fresh unbacked ones: leave those to it)."""
    return all(
        not isinstance(v, _SYMBOLIC) and not (isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape))
        for v in pytree.tree_leaves(value)
    )


def _is_plain(gm: torch.fx.GraphModule) -> bool:
    """Only inputs, op calls and getitems, all of static shapes: a retrace of it rebuilds nothing
    but the nodes themselves (no constants to re-create, no submodules, no symbols)."""
    if next(gm.named_children(), None) is not None:
        return False
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if not _is_static(node.meta.get("val")):
            return False
        if node.op == "placeholder":
            continue
        if node.op != "call_function":
            return False
        if not (node.target is operator.getitem or isinstance(node.target, torch._ops.OpOverload) or is_edge_op(node.target)):
            return False
    return True


def fake_mode(gm: torch.fx.GraphModule):
    """The program's fake mode, set up as a retrace sets it up (it lets real tensors in)."""
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    if mode is not None:
        mode.allow_non_fake_inputs = True
    return mode


def fake_result(node: torch.fx.Node, op, mode) -> object:
    """What `op` gives on the node's inputs' fake values: the value a retrace records."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with mode, enable_python_dispatcher():
        return op(*args, **kwargs)


def _view_copy_variant(op) -> torch._ops.OpOverload | None:
    """The op torch's ReplaceViewOpsWithViewCopyOpsPass puts in place of `op` (None: it keeps `op`)."""
    if op is aten._unsafe_view.default:
        return aten.view_copy.default
    if not isinstance(op, torch._ops.OpOverload) or not op._schema.name.startswith("aten::"):
        return None
    arguments = op._schema.arguments
    if not arguments or arguments[0].alias_info is None or arguments[0].alias_info.is_write:
        return None
    packet = getattr(aten, op._schema.name.split("::")[1] + "_copy", None)
    return getattr(packet, op._overloadname, None) or op  # no copy variant: the stock pass raises


def _requires_grad(node: torch.fx.Node, mode, known: dict) -> list[bool] | None:
    """Which of the node's output tensors autograd marks as requiring grad when its op runs
    on its inputs' values, as in a retrace with grad enabled: found by running the op once
    per op and pattern of inputs requiring grad, and kept in `known`. None: the op's output
    layout changed with the grad flags (SDPA's kernel choice may), so its value is computed
    afresh."""
    outputs = pytree.tree_leaves(node.meta.get("val"))
    inputs = pytree.tree_leaves(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val")))
    pattern = tuple(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs)
    if not (torch.is_grad_enabled() and any(pattern)):
        return [False] * len(outputs)
    key = (node.target, pattern, len(outputs))
    if key not in known:
        result = fake_result(node, node.target, mode)
        same_layout = strides(result) == strides(node.meta.get("val"))
        known[key] = [isinstance(v, torch.Tensor) and v.requires_grad for v in pytree.tree_leaves(result)] if same_layout else None
    return known[key]


def _with_grad_flags(value, flags: list[bool]):
    """`value` with its tensors requiring grad as `flags` say: the tensors that differ are new
    ones (the old may be shared with the ATen program, which must not change)."""
    leaves, spec = pytree.tree_flatten(value)
    if all(not isinstance(v, torch.Tensor) or v.requires_grad == f for v, f in zip(leaves, flags)):
        return value
    flagged = [
        v.detach().requires_grad_(f) if isinstance(v, torch.Tensor) and v.requires_grad != f else v
        for v, f in zip(leaves, flags)
    ]
    return pytree.tree_unflatten(flagged, spec)


def strides(value) -> list:
    """The strides of a value's tensors (what a copy variant in place of a view may change)."""
    return [v.stride() if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(value)]


def _restamp_values(gm: torch.fx.GraphModule, mode, swapped: set[torch.fx.Node]) -> None:
    """The values of a first retrace: computed afresh for swapped ops and for ops reading a
    value whose strides changed (elementwise ops follow their input's layout), getitems'
    taken from their op's (the same tensors), the others marked requiring grad as autograd
    marks them."""
    known: dict = {}
    restrided: set[torch.fx.Node] = set()
    for node in _calls(gm):
        old = node.meta.get("val")
        if node.target is operator.getitem:
            node.meta["val"] = node.args[0].meta["val"][node.args[1]]
        elif node in swapped or any(a in restrided for a in node.all_input_nodes):
            node.meta["val"] = fake_result(node, node.target, mode)
        elif (flags := _requires_grad(node, mode, known)) is None:
            node.meta["val"] = fake_result(node, node.target, mode)
        else:
            node.meta["val"] = _with_grad_flags(old, flags)
            continue
        if strides(old) != strides(node.meta["val"]):
            restrided.add(node)


def _copy_view_ops(gm: torch.fx.GraphModule) -> bool:
    """View ops become their `_copy` variants, whose output is a fresh contiguous tensor."""
    mode = fake_mode(gm)
    swaps = [(n, _view_copy_variant(n.target)) for n in _calls(gm)]
    swaps = [(n, op) for n, op in swaps if op is not None]
    if mode is None or any(op is n.target for n, op in swaps):
        return False  # let the stock pass run (and raise on a view op without a copy variant)
    for node, op in swaps:
        node.target = op
    _restamp_values(gm, mode, {n for n, _ in swaps})
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta["tensor_meta"] = pytree.tree_map(_no_tensor_meta, node.meta.get("val"))
    return True


def _use_edge_ops(gm: torch.fx.GraphModule) -> bool:
    """ATen ops become the Edge ops of the same schema (the same values)."""
    for node in _calls(gm):
        if should_lower_to_edge(node.target):
            node.target = aten_to_edge(node.target)
    return True


def _use_dim_order_ops(gm: torch.fx.GraphModule) -> bool:
    """Ops taking a memory format become the dim-order ops taking the dim order it means."""
    nodes = [n for n in _calls(gm) if is_edge_op(n.target) and n.target in DimOrderOpsMap]
    mode = fake_mode(gm) if nodes else None
    if nodes and mode is None:
        return False
    for node in nodes:
        kwargs = dict(node.kwargs)
        memory_format = kwargs.pop("memory_format", torch.preserve_format)
        first = node.args[0]
        tensor = first.meta.get("val") if isinstance(first, torch.fx.Node) else first
        if isinstance(tensor, torch.Tensor):
            ndim = tensor.dim()
        elif isinstance(first, (list, tuple)):
            tensor, ndim = None, len(first)
        else:
            return False  # the stock pass raises on this
        if memory_format in (None, torch.preserve_format):
            kwargs["dim_order"] = [int(d) for d in tensor.dim_order()] if tensor is not None else list(range(ndim))
        else:
            kwargs["dim_order"] = get_dim_order(memory_format, ndim)
        node.target = DimOrderOpsMap[node.target]
        node.kwargs = kwargs
        node.meta["val"] = fake_result(node, node.target, mode)
    return True


# Pass type -> its rewrite in place, for a plain graph (`_is_plain`); False: run the pass.
_IN_PLACE: dict[type, Callable[[torch.fx.GraphModule], bool]] = {
    ReplaceViewOpsWithViewCopyOpsPass: _copy_view_ops,
    OpReplacePass: _use_edge_ops,
    MemoryFormatOpsPass: _use_dim_order_ops,
}


def _no_tensor_meta(value) -> None:
    """A retrace records no tensor_meta for a value it holds a fake tensor for (all of ours)."""
    return None


def _meta_value(value):
    """What a retrace records as a node's value (its fake tensors and symbols, nothing else)."""
    return value if isinstance(value, (torch.Tensor, *_SYMBOLIC, int, float, bool, str)) else None


def _as_retraced(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph copied into a fresh one, as a retrace rebuilds it: each node named afresh
    from its op, in order, with the old node's meta and the value and tensor_meta a retrace
    stamps; no op runs."""
    graph = torch.fx.Graph()
    graph.set_codegen(gm.graph._codegen)
    new_nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), new_nodes.__getitem__)
        name = None
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = graph._target_to_str(node.target.overloadpacket.__name__)
        new = graph.create_node(node.op, node.target, args, kwargs, name)
        new.meta = copy.copy(node.meta)
        if node.op == "call_function" and "from_node" not in new.meta:
            # A retrace records where every node it makes came from (MLX's lowering reads it).
            new.meta["from_node"] = [NodeSource(node, "edge_conversion", NodeSourceAction.CREATE)]
        if node.op != "placeholder":
            # The tracer numbers a node it creates with autograd's counter unless it has a number.
            new.meta.setdefault("seq_nr", torch.autograd._get_sequence_nr() - 1)
            if node.op == "output":
                value = torch.fx.node.map_arg(node.args[0], lambda n: n.meta.get("val"))
            else:
                value = node.meta.get("val")
            new.meta["val"] = pytree.tree_map(_meta_value, value)
            new.meta["tensor_meta"] = pytree.tree_map(_no_tensor_meta, new.meta["val"])
        new_nodes[node] = new
    rebuilt = torch.fx.GraphModule(torch.nn.Module(), graph)
    rebuilt.meta = gm.meta.copy()
    return rebuilt


def _applies(graph_pass, gm: torch.fx.GraphModule) -> bool:
    check = _APPLIES.get(type(unwrap_pass(graph_pass)))
    return check is None or check(gm)


def _is_dead_code_pass(graph_pass) -> bool:
    return getattr(unwrap_pass(graph_pass), "__name__", "") == "dead_code_elimination_pass"


def _eliminate_dead_code(gm: torch.fx.GraphModule):
    """Stock's dead-code pass recompiles every module even when nothing was removed."""
    changed = False
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module.graph.eliminate_dead_code():
            module.recompile()
            changed = True
    return changed


def _generate_debug_handles(program: ExportedProgram, graph_pass) -> ExportedProgram:
    """Stock runs this in-place pass through a pass manager that verifies the whole program
    before and after it (twice the cost of the pass); ours was verified when it was made. The
    pass manager also records the graph's symbols in the range constraints (unbacked ones
    are new there): a program with symbols still goes through it."""
    if not all(_is_static(n.meta.get("val")) for n in program.graph.nodes):
        return transform(program, graph_pass)
    graph_pass(program.graph_module)
    return program


# Python's symbolic helpers (`torch.sym_not`, `torch.sym_ite`, `torch.sym_max`...): plain Python
# functions, which the Edge verifier refuses ("assert op.__name__ in ('alloc',)"). ExecuTorch's
# prim ops for them are no way out in an Edge program: they cannot be traced on a data-dependent
# size, and the passes after this one retrace (`to_executorch` swaps them in after its last).
_SYM_HELPERS = frozenset(f for f in python_sym_ops_to_executorch() if isinstance(f, types.FunctionType))

_SCALARS = (*_SYMBOLIC, bool, int, float)

# A comparison -> its negation, as `operator`'s functions (which the Edge verifier takes).
_NEGATED = {
    operator.eq: operator.ne,
    operator.ne: operator.eq,
    operator.lt: operator.ge,
    operator.ge: operator.lt,
    operator.gt: operator.le,
    operator.le: operator.gt,
}


def _negation(comparison: torch.fx.Node) -> tuple[Callable, tuple]:
    """The negation of `comparison`, as an `operator` function and its arguments. `n != b` where
    b is a bound of n's range is `n > b` (or `n < b`): a retrace narrows n's range by that, by
    `!=` it does not, and `to_executorch` could not order the strides of a tensor sized n
    ("Could not guard on data-dependent expression 256*u3 < 256")."""
    a, b = comparison.args
    value = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
    if comparison.target is operator.eq and isinstance(value, torch.SymInt) and isinstance(b, int):
        bounds = value.node.shape_env.bound_sympy(value.node.expr)
        if bounds.lower == b:
            return operator.gt, (a, b)
        if bounds.upper == b:
            return operator.lt, (a, b)
    return _NEGATED[comparison.target], (a, b)


def _asserted_helpers_out(graph: torch.fx.Graph, helpers: list[torch.fx.Node]) -> None:
    """Rid `graph` of `helpers`, which only assertions read: `sym_not` of a comparison becomes
    the negated comparison (later retraces still learn from it: `torch._check(n != 0)` lets
    `to_executorch` order the strides of a tensor sized `n`); the assertions reading any other
    helper are removed, as `to_executorch` removes every assertion before it emits."""
    negated = [h for h in helpers if h.target is torch.sym_not and getattr(h.args[0], "target", None) in _NEGATED]
    for helper in negated:
        function, args = _negation(helper.args[0])
        with graph.inserting_before(helper):
            negation = graph.call_function(function, args)
        negation.meta.update(helper.meta)
        negation.meta["val"] = function(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]))
        helper.replace_all_uses_with(negation)
    for node in _derived(graph, [h for h in helpers if h not in negated]):
        if node.target is aten._assert_scalar.default:
            graph.erase_node(node)
    graph.eliminate_dead_code()


def _derived(graph: torch.fx.Graph, sources: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """`sources` and every node computed from them, in graph order."""
    derived = set(sources)
    for node in graph.nodes:
        if node not in derived and any(a in derived for a in node.all_input_nodes):
            derived.add(node)
    return [n for n in graph.nodes if n in derived]


def _sym_helpers_out(gm: torch.fx.GraphModule) -> None:
    """Rid the program of Python's symbolic helpers: export states its size checks through them
    (`torch._check(n != 0)` asserts `sym_not(n == 0)`, `torch._check_tensor_all` reads a
    `sym_ite`, as VLMs' image-token merges do), which only assertions read. A helper that feeds
    anything else is refused by name."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        helpers = [n for n in graph.nodes if n.op == "call_function" and n.target in _SYM_HELPERS]
        if not helpers:
            continue
        computed = [
            n
            for n in _derived(graph, helpers)
            if n.target is not aten._assert_scalar.default
            and not (n.op == "call_function" and isinstance(n.meta.get("val"), _SCALARS))
        ]
        if computed:
            names = ", ".join(sorted({f"torch.{h.target.__name__}" for h in helpers}))
            raise CompileError(
                f"{computed[0].name} computes with {names}: an Edge program cannot hold such a Python "
                "function, and ExecuTorch's prim op for it cannot be traced on a data-dependent size "
                "(a helper only assertions read is rewritten or dropped with them)",
                nodes=[h.name for h in helpers] + [c.name for c in computed],
                hint="compute the value with tensor ops (torch.maximum, torch.where) instead of the symbolic helper",
            )
        _asserted_helpers_out(graph, helpers)
        module.recompile()
        logger.debug("rid the program of symbolic helpers: %s", [h.name for h in helpers])


def generate_edge_program(
    program: ExportedProgram, preserve_ops: list[torch._ops.OpOverload]
) -> tuple[ExportedProgram, list[str]]:
    """The Edge program for a decomposed ATen program; also the names of the passes skipped.

    The ATen program's graph may be rewritten in place: pass a program nothing else uses."""
    config = EdgeCompileConfig()
    program = remove_unused_parameters_pass(program)
    _sym_helpers_out(program.graph_module)
    pre_replace, post_replace = aten_to_edge_passes(config)
    passes = [
        RemoveNonCoreAtenOpGraphAssertsPass(),
        ReplaceViewOpsWithViewCopyOpsPass(),
        *pre_replace,
        OpReplacePass(),
        MemoryFormatOpsPass(),
    ]
    gm, skipped, rewritten = program.graph_module, [], False
    for graph_pass in passes:
        if not _applies(graph_pass, gm):
            skipped.append(type(unwrap_pass(graph_pass)).__name__)
            continue
        rewrite = _IN_PLACE.get(type(unwrap_pass(graph_pass)))
        if rewrite is not None and _is_plain(gm) and rewrite(gm):
            rewritten = True
            continue
        gm = graph_pass(gm).graph_module
    if rewritten and _is_plain(gm):  # else a pass retraced it after our last rewrite
        gm = _as_retraced(gm)
    edge = ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=updated_graph_signature(program.graph_signature, gm),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[EXIREdgeDialectVerifier(edge_compile_config=config, class_only=True, preserve_ops=preserve_ops)],
    )
    edge = lift_constant_tensor_pass(edge)
    edge = convert_constant_dim_order_pass(edge)
    for graph_pass in post_replace:
        if _is_dead_code_pass(graph_pass):
            _eliminate_dead_code(edge.graph_module)
        elif isinstance(unwrap_pass(graph_pass), DebugHandleGeneratorPass):
            edge = _generate_debug_handles(edge, graph_pass)
        else:
            edge = transform(edge, graph_pass)
    _finish_edge_ops(edge)
    logger.debug("Edge conversion skipped passes that could not apply: %s", skipped)
    return edge, skipped


def _finish_edge_ops(program: ExportedProgram) -> None:
    """Turn ATen ops that ExecuTorch's passes left behind into Edge ops.

    Stock 1.5.1's Edge passes insert `aten.scalar_tensor` (e.g. for the `masked_fill`
    inside `nn.MultiheadAttention` with a bool mask) after the ATen-to-Edge replacement
    has run, leaving an ATen op in the Edge program.
    """
    leftovers = [n for n in program.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    for node in leftovers:
        node.target = aten_to_edge(node.target)
    if leftovers:
        program.graph_module.recompile()
