"""Shape-only chains through rank > 5, rewritten at rank <= 5 so Core ML can take them.

Core ML takes no tensor of rank above 5 (stock: "ValueError: Core ML only
supports tensors with rank <= 5 ... outputs a rank 6 tensor"). Models often pass
through rank 6 only on the way between rank-5-or-less tensors: a pixel-shuffle
written as reshape -> permute -> reshape, or `torch.stack` of 5-D camera tensors
(a `cat` and a view to rank 6) flattened right after. Such a chain of views,
permutes and copies only moves elements, so it is one reshape -> permute ->
reshape of its input; merging the axes the permute keeps together usually needs
no more than five. `reduce_rank` replaces each such chain by those (at most
three) ops, in place, before the partition search; the chain's rank-6 ops go
away when nothing else reads them. What cannot be written at rank <= 5 (an op
that computes at rank 6, a rank-6 program output, a permute that interleaves six
axes) is left as it is, and the rank rule sends it to the CPU.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument

from compiler.backends.coreml import rules
from compiler.ir.dialect import op_name
from compiler.ir.private_api import edge_ops

exir_ops = edge_ops()

_VIEW = exir_ops.edge.aten.view_copy.default
_PERMUTE = exir_ops.edge.aten.permute_copy.default

# Edge ops that only reshape (their result is the input's elements in the same order).
_RESHAPES = {
    "aten.view_copy.default",
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze_copy.default",
    "aten.squeeze_copy.default",
    "aten.squeeze_copy.dim",
    "aten.squeeze_copy.dims",
    "aten.alias_copy.default",
    "aten.clone.default",
    "dim_order_ops._clone_dim_order.default",
}


def _op(node: torch.fx.Node) -> str:
    return op_name(node.target)


def _shape(node) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return None  # dynamic shapes are not rewritten
    return tuple(val.shape)


def _is_chain_op(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = _op(node)
    if name != "aten.permute_copy.default" and name not in _RESHAPES:
        return False
    shape = _shape(node)
    if shape is None or _shape(node.args[0]) is None or 0 in shape:
        return False
    if name == "aten.permute_copy.default":
        return True
    # A copy into a non-contiguous dim order keeps the values but not the layout the user asked for.
    order = node.kwargs.get("dim_order")
    return order is None or list(order) == list(range(len(_shape(node))))


class _Atoms:
    """The input's elements as a list of axes ("atoms") in the input's order.

    The current tensor's dims are lists of atoms; a permute reorders dims, a
    reshape regroups the atoms in the current order, splitting an atom when a
    new dim covers only its outer part.
    """

    def __init__(self, shape: Sequence[int]) -> None:
        self.sizes: list[int] = []
        self.source: list[int] = []  # atom ids in the input's order
        self.dims: list[list[int]] = []
        for size in shape:
            self.dims.append([self._new(size)] if size != 1 else [])
        self.source = [a for dim in self.dims for a in dim]

    def _new(self, size: int) -> int:
        self.sizes.append(size)
        return len(self.sizes) - 1

    def permute(self, order: Sequence[int]) -> None:
        self.dims = [self.dims[d % len(self.dims)] for d in order]

    def reshape(self, shape: Sequence[int]) -> bool:
        """Regroup for `shape`; False when an atom would need splitting across two dims."""
        sequence = self._coalesced([a for dim in self.dims for a in dim])
        dims, at = [], 0
        for size in shape:
            group, covered = [], 1
            while covered < size:
                atom = sequence[at]
                whole = covered * self.sizes[atom]
                if size % whole == 0:
                    group.append(atom)
                    covered = whole
                    at += 1
                    continue
                if whole % size or size % covered:
                    return False
                outer, inner = self._new(size // covered), self._new(whole // size)
                sequence[at : at + 1] = [outer, inner]
                where = self.source.index(atom)
                self.source[where : where + 1] = [outer, inner]
                group.append(outer)
                covered = size
                at += 1
            dims.append(group)
        self.dims = dims
        return at == len(sequence)

    def _coalesced(self, sequence: list[int]) -> list[int]:
        """`sequence` with atoms that follow each other in the input too merged into one."""
        merged: list[int] = []
        for atom in sequence:
            if merged and self.source.index(atom) == self.source.index(merged[-1]) + 1:
                previous = merged.pop()
                joined = self._new(self.sizes[previous] * self.sizes[atom])
                where = self.source.index(previous)
                self.source[where : where + 2] = [joined]
                atom = joined
            merged.append(atom)
        return merged

    def as_reshape_permute(self) -> tuple[list[int], list[int]]:
        """The input's reshape (atoms merged where the result keeps them together) and the permute."""
        result = [a for dim in self.dims for a in dim]
        position = {a: i for i, a in enumerate(self.source)}
        blocks: list[list[int]] = []
        for atom in result:
            if blocks and position[atom] == position[blocks[-1][-1]] + 1:
                blocks[-1].append(atom)
            else:
                blocks.append([atom])
        in_source_order = sorted(blocks, key=lambda b: position[b[0]])
        shape = [math.prod(self.sizes[a] for a in block) for block in in_source_order]
        order = [in_source_order.index(block) for block in blocks]
        return shape, order


def _chain_into(end: torch.fx.Node) -> Optional[list[torch.fx.Node]]:
    """The rank > 5 chain ops `end` reads through, first first; None unless `end` ends such a chain."""
    if not _is_chain_op(end) or len(_shape(end)) > rules.CORE_ML_MAX_RANK:
        return None
    chain, current = [], end.args[0]
    while (
        isinstance(current, torch.fx.Node)
        and _is_chain_op(current)
        and len(_shape(current)) > rules.CORE_ML_MAX_RANK
    ):
        chain.insert(0, current)
        current = current.args[0]
    if not chain or not isinstance(current, torch.fx.Node):
        return None
    start = _shape(current)
    if start is None or len(start) > rules.CORE_ML_MAX_RANK or 0 in start:
        return None
    return chain + [end]


def as_reshape_permute(
    shape: Sequence[int], steps: Sequence[tuple[str, Sequence[int]]]
) -> Optional[tuple[list[int], list[int]]]:
    """A reshape of a tensor of `shape`, then a permute, that does what `steps` do.

    `steps` are ("permute", dims) and ("reshape", shape); the last reshape to the
    result's shape is left to the caller. None when no single permute does it.
    """
    atoms = _Atoms(shape)
    for kind, arg in steps:
        if kind == "permute":
            atoms.permute(arg)
        elif not atoms.reshape(arg):
            return None
    return atoms.as_reshape_permute()


def _replacement(source: torch.fx.Node, chain: list[torch.fx.Node]) -> Optional[tuple[list[int], list[int]]]:
    """The reshape and permute of `source` that give `chain[-1]`, if at rank <= 5."""
    steps = [
        ("permute", node.args[1]) if _op(node) == "aten.permute_copy.default" else ("reshape", _shape(node))
        for node in chain
    ]
    found = as_reshape_permute(_shape(source), steps)
    if found is None or len(found[0]) > rules.CORE_ML_MAX_RANK:
        return None
    return found


def _add(graph: torch.fx.Graph, target, args, like: torch.fx.Node) -> torch.fx.Node:
    node = graph.call_function(target, args)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "debug_handle"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["val"] = target(args[0].meta["val"], *args[1:])
    return node


def reduce_rank(program: ExportedProgram) -> list[str]:
    """Rewrite every shape-only chain through rank > 5 at rank <= 5, in place.

    Returns the names of the nodes that ended such chains (now replaced)."""
    graph = program.graph
    rewritten = []
    for end in list(graph.nodes):
        chain = _chain_into(end)
        if chain is None:
            continue
        source = chain[0].args[0]
        found = _replacement(source, chain)
        if found is None:
            continue
        shape, order = found
        with graph.inserting_before(end):
            value = source
            if order != sorted(order):  # otherwise the chain is one reshape
                if list(shape) != list(_shape(source)):
                    value = _add(graph, _VIEW, (value, list(shape)), end)
                value = _add(graph, _PERMUTE, (value, order), end)
            if value is source or list(_shape(value)) != list(_shape(end)):
                value = _add(graph, _VIEW, (value, list(_shape(end))), end)
        end.replace_all_uses_with(value)
        for spec in program.graph_signature.output_specs:  # outputs are listed by node name
            if isinstance(spec.arg, TensorArgument) and spec.arg.name == end.name:
                spec.arg = TensorArgument(value.name)
        rewritten.append(end.name)
        for node in reversed(chain):
            if not node.users:
                graph.erase_node(node)
    if rewritten:
        program.graph_module.recompile()
    return rewritten
