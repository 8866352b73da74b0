"""Decompose: ATen program -> Edge program, keeping whole the nodes the dry run planned.

One `run_decompositions` call: the nodes the dry run planned to keep whole are
renamed into ExecuTorch's no-decompose namespace for that one call and named
back afterwards, instead of stock's decompose / rename / decompose-again.

ExecuTorch's decomposition table lacks some ops that are not core ATen but that
torch can decompose (`aten.bucketize.Tensor`, which SigLIP / Idefics3 vision
embeddings use for their patch positions): left whole, the Edge verifier refuses
them (`SpecViolationError: ... is not in Core ATen opset`) and no runtime has a
kernel for them. The table gets torch's decomposition of those the program holds.
And ExecuTorch's own decomposition of `empty_like` makes `aten.empty_permuted`, which
is not core ATen and which no table decomposes (stock `to_edge` fails on a rotary
embedding that fills `torch.empty_like(x)` by slices, as SmolVLA's expert does);
it becomes `empty` in its physical order, permuted back. `aten.median` (all elements,
and along a dim) is in no table and no runtime has a kernel for it: it becomes `topk`
of the smaller half, its last element (NaN where the slice holds one, as torch gives).
Integer `remainder` becomes `a - floor_div(a, b) * b`: the portable runtime's
kernel truncates like C's `%` where torch floors (-2 % 5 gives -2, torch 3: silently
wrong, stock too); the kernel check refuses the op if any stage leaves it on the CPU.
`aten.cat` (or `stack`, kept whole) of tensors of different dtypes
(`torch.cat([mask, x])`: torch promotes) gets explicit casts: the Edge verifier refuses mixed dtypes there ("operators are
taking Tensor inputs with mismatched dtypes"; stock fails the same way).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch._decomp import decomposition_table as _torch_decompositions
from torch.export import ExportedProgram

from executorch.exir.program._program import (
    _register_no_decomp_op,
    _restore_transformed_ops_to_aten_ops,
    aten_op_to_transform_op,
)
from executorch.exir.tracer import _default_decomposition_table

from compiler.ir.artifacts import EdgeProgram, PlannedProgram
from compiler.ir.dialect import op_name
from compiler.ir.graph import call_nodes
from compiler.stages.base import Stage, StageContext
from compiler.stages.edge_conversion import generate_edge_program

logger = logging.getLogger(__name__)


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    """`aten.empty_permuted` from core ops: `empty` of the sizes in physical order, permuted back."""
    physical = [size[dim] for dim in physical_layout]
    empty = torch.ops.aten.empty.memory_format(physical, dtype=dtype, device=device, pin_memory=pin_memory)
    if list(physical_layout) == list(range(len(size))):
        return empty
    return torch.ops.aten.permute.default(empty, [list(physical_layout).index(dim) for dim in range(len(size))])


# Non-core ops that ExecuTorch's own decompositions make and that no table decomposes.
_MADE_BY_DECOMPOSITION = {torch.ops.aten.empty_permuted.default: _empty_permuted}


def _median_dim(self, dim, keepdim=False):
    """`aten.median.dim` from core ops, for runtimes without a median kernel: the
    ((n - 1) // 2 + 1)-th smallest by `topk` (torch's median is the lower of the two
    middle values); a slice holding a NaN gives NaN at its first NaN, as torch does."""
    if self.dim() == 0:
        values, indices = _median_dim(self.reshape(1), 0)
        return values.reshape(()), indices.reshape(())
    dim = dim % self.dim()
    k = (self.shape[dim] - 1) // 2 + 1
    smallest, positions = torch.topk(self, k, dim, largest=False, sorted=True)
    values, indices = smallest.select(dim, k - 1), positions.select(dim, k - 1)
    if self.is_floating_point():  # topk orders NaN last; torch's median returns it
        nan = torch.isnan(self)
        has_nan = nan.any(dim)
        values = torch.where(has_nan, torch.full_like(values, float("nan")), values)
        indices = torch.where(has_nan, torch.argmax(nan.to(self.dtype), dim), indices)
    if keepdim:
        values, indices = values.unsqueeze(dim), indices.unsqueeze(dim)
    return values, indices


def _median(self):
    """`aten.median.default` (the median of all elements): `aten.median.dim` of the flattened tensor."""
    return _median_dim(self.reshape(-1), 0)[0]


# Non-core ATen ops that neither ExecuTorch's table nor torch's decomposes, and no
# ExecuTorch runtime has a kernel for (the portable runtime has `topk`, not `median`).
# Ops joining a list of tensors, which torch promotes and the Edge verifier does not.
_JOINING = (torch.ops.aten.cat.default, torch.ops.aten.stack.default)


def cast_cat_inputs(program: ExportedProgram) -> int:
    """Cast each input of a mixed-dtype `cat` (or `stack`, kept whole) to the dtype of its
    result; returns how many."""
    cast = 0
    for node in call_nodes(program):
        out = node.meta.get("val")
        if node.target not in _JOINING or not isinstance(out, torch.Tensor):
            continue
        tensors = list(node.args[0])
        for i, source in enumerate(tensors):
            value = source.meta.get("val")
            if isinstance(value, torch.Tensor) and value.dtype != out.dtype:
                with program.graph.inserting_before(node):
                    tensors[i] = program.graph.call_function(
                        torch.ops.aten._to_copy.default, (source,), {"dtype": out.dtype}
                    )
                tensors[i].meta["val"] = value.to(out.dtype)
                cast += 1
        node.args = (tensors, *node.args[1:])
    if cast:
        program.graph_module.recompile()
    return cast


def _floored_remainder(self, other):
    """Integer `remainder` as torch defines it (floored), from ops whose CPU kernels agree:
    the portable runtime's own integer remainder truncates (see `WRONG_KERNELS`)."""
    if self.dtype.is_floating_point or getattr(other, "dtype", torch.int64).is_floating_point or isinstance(other, float):
        return NotImplemented
    return self - torch.div(self, other, rounding_mode="floor") * other


_DECOMPOSED_HERE = {
    torch.ops.aten.remainder.Tensor: _floored_remainder,
    torch.ops.aten.remainder.Scalar: _floored_remainder,
    torch.ops.aten.median.default: _median,
    torch.ops.aten.median.dim: _median_dim,
}


def _is_core(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.core in op.tags or torch.Tag.view_copy in op.tags


def decomposition_table(program: ExportedProgram, keep: set[torch._ops.OpOverload]) -> dict:
    """ExecuTorch's table, plus torch's decomposition of each non-core ATen op in
    `program` that ExecuTorch's table lacks (else the Edge verifier refuses it), plus
    ours of the non-core ops ExecuTorch's decompositions make."""
    table = _default_decomposition_table()
    added = {
        node.target
        for node in call_nodes(program)
        if isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "aten"
        and node.target not in table
        and node.target not in keep
        and not _is_core(node.target)
        and node.target in _torch_decompositions
    }
    for op in added:
        table[op] = _torch_decompositions[op]
    ours = {node.target for node in call_nodes(program) if node.target in _DECOMPOSED_HERE and node.target not in keep}
    for op in ours:
        table[op] = _DECOMPOSED_HERE[op]
    for op, decomposition in _MADE_BY_DECOMPOSITION.items():
        if op not in table:
            table[op] = decomposition
    if added or ours:
        logger.debug("decomposing with torch's table too: %s; with ours: %s", sorted(map(str, added)), sorted(map(str, ours)))
    return table


def decompose(
    program: ExportedProgram, keep_nodes: frozenset[str] | set[str]
) -> tuple[ExportedProgram, list[torch._ops.OpOverload]]:
    """Decompose to core ATen except the nodes named; returns the program and the ops kept.

    The names come from the dry run, which already dropped ops that cannot be kept
    whole (mutating or aliasing ones)."""
    table = decomposition_table(program, {n.target for n in call_nodes(program) if n.name in keep_nodes})
    renamed: list[tuple[torch.fx.Node, torch._ops.OpOverload]] = []
    for node in call_nodes(program):
        if node.name in keep_nodes:
            _register_no_decomp_op(node.target)
            renamed.append((node, node.target))
            node.target = aten_op_to_transform_op[node.target]
    try:
        decomposed = program.run_decompositions(table)
    finally:
        for node, target in renamed:  # the input artifact must come back unchanged
            node.target = target
    _restore_transformed_ops_to_aten_ops(decomposed)
    cast_cat_inputs(decomposed)
    return decomposed, sorted({target for _, target in renamed}, key=str)


@contextlib.contextmanager
def _unbacked_symbols_kept_in(program: ExportedProgram):
    """Tracing a data-dependent size leaves a fresh unbacked symbol pending in the shape
    environment the program shares with every trace of it; left there, the next trace
    (the decompose stage after a dry run that dropped a node) fails with "Pending unbacked
    symbols {u4, ...} not in returned outputs"."""
    mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in program.graph.nodes])
    shape_env = getattr(mode, "shape_env", None)
    before = list(shape_env.pending_fresh_unbacked_symbols) if shape_env is not None else None
    try:
        yield
    finally:
        if shape_env is not None:
            shape_env.pending_fresh_unbacked_symbols[:] = before


def to_edge_program(program: ExportedProgram, keep_nodes: frozenset[str] | set[str]) -> EdgeProgram:
    """The Edge program for `program`, keeping whole the nodes named (the dry run uses this too)."""
    with _unbacked_symbols_kept_in(program):
        decomposed, preserved = decompose(program, keep_nodes)
        edge, _ = generate_edge_program(decomposed, preserved)
    return EdgeProgram(edge, tuple(op_name(op) for op in preserved))


class Decompose(Stage):
    """Keeps whole exactly what the dry run planned; never asks the backend again."""

    name = "decompose"
    takes = PlannedProgram
    returns = EdgeProgram

    def run(self, planned: PlannedProgram, ctx: StageContext) -> EdgeProgram:
        if planned.decomposed is not None:
            ctx.metrics["reused"] = "dry run"
            return planned.decomposed
        return to_edge_program(planned.program, planned.keep_whole.nodes)
