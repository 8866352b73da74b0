"""Constant folding that respects the program's dialect (the fold stage runs it on the ATen
program; the partition stage on the Edge program before its search).

Every op whose inputs are all constants (parameters, buffers that are never
mutated, lifted constants, literals, lists of them) is evaluated once and
replaced by a new lifted constant. Two things stock ExecuTorch 1.5.1 gets
wrong on ATen programs are chosen per dialect here: the clone put in front of
an output that became a constant (stock always inserts the Edge clone, and the
ATen program then fails its verifier), and the ops never folded (stock's skip
list holds only Edge ops, so on an ATen program it folds `full` into a large
constant). Indexing by a constant boolean mask becomes indexing by the mask's
integer positions, so the output shape is static.

Every constant the stage hands on owns its bytes: a folded `p[2:10]` is a view
into `p`'s storage, and delegates serialize a constant's storage from its start
(XNNPACK read `p[0:8]`: silently wrong). Folded constants are stored as their own
contiguous copies (the capture stage already gave the model's own views their
own storage). A value that the
program writes in place (`y = w * 2; y[0] = x`) is not folded: as a constant it
would be mutated (stock: "Constant ... is mutated in the forward method"), and
as a buffer the write would outlive the call.
"""

from __future__ import annotations

import functools

import logging
import operator
from typing import Any, Iterable

import attrs
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from executorch.exir.passes.replace_aten_with_edge_pass import aten_to_edge

from compiler.ir.dialect import ATEN, EDGE, op_from_name
from compiler.ir.errors import UserInputError
from compiler.ir.graph import drop_unread_constants, lift_constant, mutated_buffer_targets, written_arguments
from compiler.ir.invariants import owns_its_bytes, plain_tensor, row_major
from compiler.ir.private_api import aten_overload, edge_ops, quant_primitives

exir_ops = edge_ops()
logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Fills: one op at run time, but as a constant they are as large as their output.
_FILL_OPS = (
    aten.full.default,
    aten.full_like.default,
    aten.zeros.default,
    aten.zeros_like.default,
    aten.ones.default,
    aten.ones_like.default,
    aten.new_full.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
)


def _codebook_ops() -> list:
    """TorchAO's codebook dequantize (Core ML's palettized weights), once its module has
    registered it: ExecuTorch's quant primitives do not list it."""
    try:
        return [torch.ops.quant.dequantize_codebook.default]
    except (AttributeError, RuntimeError):
        return []


def default_skip_ops(dialect: str) -> frozenset:
    """Ops never folded, spelled in the program's dialect: fills and dequantize primitives
    (folding a dequantize stores a quantized weight as float)."""
    ops = [*_FILL_OPS, *quant_primitives(), *_codebook_ops()]
    if dialect == EDGE:
        return frozenset(aten_to_edge(op) for op in ops)
    return frozenset(ops)


def _clone_op(dialect: str, dim_order: bool) -> Any:
    if dialect == ATEN:
        return aten.clone.default
    if dim_order:
        return exir_ops.edge.dim_order_ops._clone_dim_order.default
    return exir_ops.edge.aten.clone.default


@attrs.frozen
class FoldResult:
    nodes_folded: int = 0
    constants_created: int = 0
    bytes_added: int = 0
    bytes_removed: int = 0
    masks_to_positions: int = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage_key(tensor: torch.Tensor) -> int | None:
    """What identifies `tensor`'s storage (None for an empty one: nothing to share)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _stored_constant(value: torch.Tensor, taken: set[int]) -> torch.Tensor:
    """`value` as a folded constant may be stored: its own row-major bytes (strides ExecuTorch
    reads a dim order from), not a view into (or an alias of) another constant's storage."""
    value = value.detach()
    if not plain_tensor(value):  # a tensor subclass (quantized weights) flattens into its own tensors
        return value.contiguous()
    if (
        row_major(value)
        and owns_its_bytes(value)
        and _storage_key(value) not in taken
    ):
        return value
    return value.clone(memory_format=torch.contiguous_format)


def _aliased(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose data `node` is a view of (`select`, `slice`, `t`, `view`..., the items
    of `split` or `unbind`) or, for an in-place op, the node it wrote and returns."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target is operator.getitem:
        return node.args[0] if _aliased(node.args[0]) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    return node.args[0]


def written_in_place(ep: ExportedProgram) -> set[torch.fx.Node]:
    """Nodes whose data some op writes in place, directly or through a view (`y[0] = x`
    writes `y` through `select`): the written base and every alias of it."""
    written = set()
    for node in ep.graph.nodes:
        for target in written_arguments(node):
            while target is not None:
                written.add(target)
                target = _aliased(target)
    for node in ep.graph.nodes:  # every alias of written data sees the writes
        if _aliased(node) in written:
            written.add(node)
    return written


def constant_inputs(ep: ExportedProgram, state: frozenset[str] = frozenset()) -> dict[torch.fx.Node, torch.Tensor]:
    """Placeholder -> value, for parameters, never-mutated buffers and lifted constants. The
    buffers of `state` (the program state another method writes) are none of these: their value
    at capture is not what this method reads."""
    mutated = mutated_buffer_targets(ep) | set(state)
    written = written_in_place(ep)
    values: dict[torch.fx.Node, torch.Tensor] = {}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        node = placeholders.get(spec.arg.name)
        if node is None or spec.target in mutated or node in written:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in ep.state_dict:
            values[node] = ep.state_dict[spec.target]
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR) and spec.target in ep.constants:
            values[node] = ep.constants[spec.target]
    return values


_LITERALS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def _all_constant(args: Any, known: dict[torch.fx.Node, Any]) -> bool:
    return all(
        (isinstance(leaf, torch.fx.Node) and leaf in known) or isinstance(leaf, _LITERALS)
        for leaf in pytree.tree_leaves(args)
    )


def _one_element_fill(node: torch.fx.Node) -> bool:
    """A fill of at most one element (`full([], True)`): as a constant it costs nothing, and what
    it feeds folds then too (a causal mask built from sizes, which otherwise runs on the CPU
    between a delegate's ops on every call). Folded only on request (`tiny_fills`): Core ML
    converts a 0-d fill itself, and its rules for fills are checked on programs that keep them."""
    value = node.meta.get("val")
    return aten_overload(node.target) in _FILL_OPS and isinstance(value, torch.Tensor) and value.numel() <= 1


def _foldable(node: torch.fx.Node, skip: frozenset, tiny_fills: bool) -> bool:
    target = node.target
    if node.op != "call_function" or node.is_impure():
        return False
    if target in skip and not (tiny_fills and _one_element_fill(node)):
        return False
    if target is operator.getitem:
        return True
    op = aten_overload(target)
    if not isinstance(op, torch._ops.OpOverload):
        return False  # higher-order ops (control flow), symbolic-int helpers
    if torch.Tag.nondeterministic_seeded in op.tags or op._schema.is_mutable:
        return False
    return isinstance(node.meta.get("val"), (torch.Tensor, tuple, list))


def _evaluate(
    ep: ExportedProgram, skip: frozenset, compute: bool = True, tiny_fills: bool = False, state: frozenset[str] = frozenset()
) -> dict[torch.fx.Node, Any]:
    """Every node whose value is known before the program runs -> that value
    (with `compute=False`, only which nodes those are; values are not computed)."""
    known: dict[torch.fx.Node, Any] = dict(constant_inputs(ep, state))
    written = written_in_place(ep)
    for node in ep.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            if compute:
                # A handled limit, not the user's to act on: said with -v.
                logger.info("fold: not folding inside control flow (%s)", node.name)
            continue
        if node in written or not _foldable(node, skip, tiny_fills) or not _all_constant((node.args, node.kwargs), known):
            continue
        if not compute:
            known[node] = node.meta.get("val")
            continue
        args, kwargs = pytree.tree_map_only(torch.fx.Node, known.__getitem__, (node.args, node.kwargs))
        with torch.no_grad():
            known[node] = node.target(*args, **kwargs)
    return known


class _Constants:
    """Adds and removes lifted constants, keeping placeholders and the signature in step."""

    def __init__(self, ep: ExportedProgram) -> None:
        self.ep = ep
        # Any node's value will do: a program with no inputs (`arange(6)` alone) has no
        # placeholder to take it from, and one with no fake value at all gets a new mode.
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in ep.graph.nodes]) or FakeTensorMode()
        self.created = 0
        self.bytes_added = 0
        self.bytes_removed = 0
        self.storages = {  # of every constant, so no folded one aliases another
            _storage_key(v) for v in list(ep.state_dict.values()) + list(ep.constants.values()) if plain_tensor(v)
        } - {None}

    def add(self, value: torch.Tensor, like: torch.fx.Node | None = None) -> torch.fx.Node:
        name = self._fresh_name()
        value = _stored_constant(value, self.storages)
        self.storages |= {_storage_key(value)} - {None}
        node = lift_constant(self.ep, name, value, self.fake_mode)
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
        self.created += 1
        self.bytes_added += _nbytes(value)
        return node

    def _fresh_name(self) -> str:
        taken = set(self.ep.constants) | set(self.ep.state_dict)
        taken |= {n.name for n in self.ep.graph.nodes}
        index = self.created
        while f"_folded_constant_{index}" in taken:
            index += 1
        return f"_folded_constant_{index}"

    def remove_unused(self) -> None:
        self.bytes_removed += drop_unread_constants(self.ep)


def needs_folding(
    ep: ExportedProgram, skip: frozenset, tiny_fills: bool = False, state: frozenset[str] = frozenset()
) -> bool:
    """Whether folding would change anything: a foldable op, or a constant bool mask index."""
    known = _evaluate(ep, skip, compute=False, tiny_fills=tiny_fills, state=state)
    if any(n.op != "placeholder" for n in known):
        return True
    return any(
        node.target in (aten.index.Tensor, exir_ops.edge.aten.index.Tensor)
        and any(isinstance(i, torch.fx.Node) and i in known and known[i].dtype == torch.bool for i in node.args[1])
        for node in ep.graph.nodes
        if node.op == "call_function"
    )


def fold_constants(
    ep: ExportedProgram, dialect: str, skip: Iterable | None = None, *, dim_order: bool = True, tiny_fills: bool = False,
    state: frozenset[str] = frozenset(),
) -> FoldResult:
    """Fold `ep` in place. `skip` replaces the default skip set; the fold stage's options add to it.
    `tiny_fills` folds the skipped fills of one element too (`_one_element_fill`); the buffers
    of `state` are read at run time, never folded."""
    skip = frozenset(default_skip_ops(dialect) if skip is None else skip)
    known = _evaluate(ep, skip, tiny_fills=tiny_fills, state=state)
    folded = [n for n in known if n.op != "placeholder"]
    constants = _Constants(ep)
    output = ep.graph.output_node()
    clone = _clone_op(dialect, dim_order)
    for node in folded:
        outside_users = [u for u in node.users if u not in known]
        if not outside_users or not isinstance(known[node], torch.Tensor):
            continue
        constant = constants.add(known[node], like=node)
        for user in outside_users:
            if user is output:
                # An output must not be the constant itself: the runtime would hand out its storage.
                with ep.graph.inserting_before(output):
                    copy = ep.graph.call_function(clone, (constant,))
                copy.meta["val"] = constant.meta["val"]
                user.replace_input_with(node, copy)
                for spec in ep.graph_signature.output_specs:
                    if getattr(spec.arg, "name", None) == node.name:
                        spec.arg = TensorArgument(copy.name)
            else:
                user.replace_input_with(node, constant)
    ep.graph.eliminate_dead_code()
    constants.remove_unused()
    masks = _masks_to_positions(ep, constants, dialect, state)
    ep.graph_module.recompile()
    return FoldResult(
        nodes_folded=len(folded),
        constants_created=constants.created,
        bytes_added=constants.bytes_added,
        bytes_removed=constants.bytes_removed,
        masks_to_positions=masks,
    )


def _index_op(dialect: str):
    return exir_ops.edge.aten.index.Tensor if dialect == EDGE else aten.index.Tensor


def _reshape_op(dialect: str):
    return exir_ops.edge.aten.view_copy.default if dialect == EDGE else aten.reshape.default


def _masks_to_positions(ep: ExportedProgram, constants: _Constants, dialect: str, state: frozenset[str]) -> int:
    """`x[..., mask]` with a constant bool mask -> `x` indexed by the mask's positions.

    A mask over several dimensions is flattened together with those dimensions
    of `x`, so the positions index once (K values, not one index per dimension).
    """
    values = constant_inputs(ep, state)
    rewritten = 0
    for node in list(ep.graph.nodes):
        if node.op != "call_function" or node.target is not _index_op(dialect):
            continue
        source, indices = node.args[0], list(node.args[1])
        given = [i for i, index in enumerate(indices) if index is not None]
        if len(given) != 1:
            continue
        mask = values.get(indices[given[0]])
        if mask is None or mask.dtype != torch.bool:
            continue
        first = given[0]  # a None in front of the mask keeps one dimension each
        positions = constants.add(torch.nonzero(mask.reshape(-1)).reshape(-1), like=indices[first])
        if mask.dim() > 1:
            shape = list(source.meta["val"].shape)
            if any(not isinstance(d, int) for d in shape[first : first + mask.dim()]):
                continue
            flat = shape[:first] + [mask.numel()] + shape[first + mask.dim() :]
            with ep.graph.inserting_before(node):
                source = ep.graph.call_function(_reshape_op(dialect), (source, flat))
        node.args = (source, [None] * first + [positions])
        rewritten += 1
    if rewritten:
        _repropagate_shapes(ep)
        constants.remove_unused()
    return rewritten


def _repropagate_shapes(ep: ExportedProgram) -> None:
    """Recompute every node's fake value once data-dependent sizes became static,
    then drop the size checks and unbacked symbols that no longer mean anything."""
    ep.graph_module.recompile()
    fake_mode = detect_fake_mode([n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"])
    inputs = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(ep.graph_module, fake_mode).propagate_dont_convert_inputs(*inputs)
    _rebind_unbacked(ep.graph)
    for node in list(ep.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_scalar.default:
            if not isinstance(node.args[0], torch.fx.Node):
                if not node.args[0]:
                    raise ValueError(f"size check {node.args[1]!r} fails once the mask is constant")
                ep.graph.erase_node(node)
        elif type(node.meta.get("val")) in (int, bool):  # a size query that became static
            _replace_with_literal(node, node.meta["val"])
    ep.graph.eliminate_dead_code()
    live = set()
    for node in ep.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, torch.Tensor):
                live |= {s for d in leaf.shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
            elif isinstance(leaf, torch.SymInt):
                live |= set(leaf.node.expr.free_symbols)
    ep._range_constraints = {s: r for s, r in ep.range_constraints.items() if s in live or not str(s).startswith("u")}


def _rebind_unbacked(graph: torch.fx.Graph) -> None:
    """Each data-dependent op's `unbacked_bindings` named again after the symbols of its new value.
    Fake propagation leaves them naming fresh symbols no value holds (`u2` where the value is
    `(1, u0, 8)`), and a later trace that rebinds by them stops: "Pending unbacked symbols {u10}
    not in returned outputs". A size that became static is bound no more."""
    import sympy

    for node in graph.nodes:
        bindings = node.meta.get("unbacked_bindings")
        if not bindings:
            continue
        renamed = {}
        for path in bindings.values():
            size = functools.reduce(lambda value, key: key.get(value), path, node.meta.get("val"))
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol):
                renamed[expr] = path
        if renamed:
            node.meta["unbacked_bindings"] = renamed
        else:
            del node.meta["unbacked_bindings"]


def _replace_with_literal(node: torch.fx.Node, value: Any) -> None:
    for user in list(node.users):
        user.args = pytree.tree_map_only(torch.fx.Node, lambda a: value if a is node else a, user.args)
        user.kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: value if a is node else a, user.kwargs)


def resolve_op(op: Any) -> Any:
    """An OpOverload from itself or a name like "aten.t.default" (namespace.op.overload)."""
    if not isinstance(op, str):
        return op
    try:
        return op_from_name(op)
    except (AttributeError, RuntimeError, ValueError) as exc:
        raise UserInputError(
            f"fold_skip_ops names no operator: {op!r}",
            stage="fold",
            hint='spell ops as namespace.name.overload, e.g. "aten.full.default"',
        ) from exc
