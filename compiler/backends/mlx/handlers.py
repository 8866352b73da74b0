"""MLX handlers of ours: stock handlers that take a dynamic size as a number, run under our own
while we use them, and handlers for ops stock has none for.

Stock ExecuTorch 1.5.1's `aten.index.Tensor` handler (a multi-index gather, then a reshape to
the node's output shape) takes that shape as ints (`int(d)`, also at upstream's HEAD). Taking
a symbolic size as a number fixes it for the whole program (see `compiler.ir.dynamic`), so
outside `dynamic_sizes_inferred` the guard is refused and the node stays on the CPU. Inside it,
an output with one dynamic size is reshaped with that size inferred (-1), which MLX's reshape
computes from the gather's result at run time, as the device does.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compiler.ir.private_api import mlx_index_handler


def _dynamic_dims(value) -> list[int]:
    return [
        i for i, size in enumerate(getattr(value, "shape", ()))
        if isinstance(size, torch.SymInt) and not size.node.expr.is_number
    ]


def index_inferring_its_dynamic_size(P, n: torch.fx.Node):
    """Stock's index handler, its final reshape told -1 for the one dynamic size of the output."""
    from executorch.backends.mlx.serialization.mlx_graph_schema import IntOrVid, ReshapeNode

    stock, value = mlx_index_handler(), n.meta.get("val")
    dims = _dynamic_dims(value)
    if len(dims) != 1:
        return stock(P, n)  # none to infer, or more than a reshape can: stock's, whose guard is refused
    (dim,) = dims

    def emit(op) -> None:
        if isinstance(op, ReshapeNode) and len(op.shape) == value.dim():
            op.shape[dim] = IntOrVid.from_literal(-1)
        type(P).emit(P, op)

    # Stock reads the output's sizes as numbers: it is given the example's, and the reshape it
    # emits is told -1 where the dynamic one is.
    example = [s.node.hint if isinstance(s, torch.SymInt) else s for s in value.shape]
    with value.fake_mode:  # the builder's slots take fake tensors only
        n.meta["val"] = torch.empty(example, dtype=value.dtype)
    P.emit = emit
    try:
        return stock(P, n)
    finally:
        n.meta["val"] = value
        del P.emit


@contextlib.contextmanager
def dynamic_sizes_inferred() -> Iterator[None]:
    """While inside, MLX lowers `aten.index.Tensor` with `index_inferring_its_dynamic_size`."""
    from executorch.backends.mlx.builder.op_registry import REGISTRY

    target = torch.ops.aten.index.Tensor
    REGISTRY.unregister(target)
    REGISTRY.register(target)(index_inferring_its_dynamic_size)
    try:
        yield
    finally:
        REGISTRY.unregister(target)
        REGISTRY.register(target)(mlx_index_handler())


def register_item_of_a_tensor() -> None:
    """Stock lowers `aten.item` (ItemIntNode) but not `aten._local_scalar_dense`, which an item
    the plan could not keep whole decomposes to (a start position read from `input_pos` in the
    backend's own LLM ops); the same handler lowers both."""
    from executorch.backends.mlx.builder.op_registry import REGISTRY

    dense = torch.ops.aten._local_scalar_dense.default
    if dense not in REGISTRY.registered_ops():
        item = types.SimpleNamespace(target=torch.ops.aten.item.default)  # the lookup reads the target only
        REGISTRY.register(dense)(REGISTRY.get_handler(item))


def _put_along_one_axis(n: torch.fx.Node) -> tuple[int, torch.fx.Node, int]:
    """(axis, positions, leading dims of size 1 the values lack) of an `index_put` that
    IndexCopyNode computes: whole slices written at 1-D int64 positions along one axis, values
    shaped like what they replace (torch's `x[..., positions] = v` drops their leading 1s); else
    ValueError saying why (stock reports it as the node's reason for staying on the CPU)."""
    destination, indices, values = n.args[:3]
    if n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False):
        raise ValueError("it adds into the destination (accumulate=True); IndexCopyNode writes")
    given = [(axis, index) for axis, index in enumerate(indices) if index is not None]
    if len(given) != 1:
        raise ValueError(f"it indexes {len(given)} dimensions at once; IndexCopyNode writes along one")
    ((axis, positions),) = given
    where, into, put = positions.meta["val"], destination.meta["val"], values.meta["val"]
    if where.dim() != 1 or where.dtype != torch.int64:
        raise ValueError(
            f"its positions {positions.name} are {where.dtype} of rank {where.dim()}; IndexCopyNode takes 1-D int64"
        )
    # Compared without a guard: the positions' length is the call's dynamic one in a KV cache.
    expected = [*into.shape[:axis], where.shape[0], *into.shape[axis + 1:]]
    missing = len(expected) - put.dim()
    if missing < 0 or not all(
        statically_known_true(a == b) for a, b in zip([1] * missing + list(put.shape), expected)
    ):
        raise ValueError(
            f"it puts values of shape {list(put.shape)} where IndexCopyNode takes {expected} (the destination's, "
            f"the positions' length at dim {axis}): it does not broadcast them"
        )
    return axis, positions, missing


def index_put_as_index_copy(P, n: torch.fx.Node):
    """`aten.index_put` writing slices at positions along one axis (`cache[:, :, positions] = new`:
    transformers' StaticCache update, its `index_copy_` decomposed to this) as MLX's IndexCopyNode,
    which reads the number of positions at run time, so a dynamic length stays dynamic. Written
    into the destination's own slot when it is a buffer the delegate owns and this is its only
    reader (MLX then updates the cache without copying it), else into a new one."""
    from executorch.backends.mlx.builder.slot_manager import IdSpace
    from executorch.backends.mlx.serialization.mlx_graph_schema import ExpandDimsNode, IndexCopyNode

    axis, positions, missing = _put_along_one_axis(n)
    destination, _, values = n.args[:3]
    into, at, put = P.slot_map([destination, positions, values])
    for _ in range(missing):  # the leading 1s back: IndexCopyNode slices values of the destination's rank
        _, expanded = P.make_tmp_slot()
        P.emit(ExpandDimsNode(x=P.slot_to_tid(put), out=P.slot_to_tid(expanded), axis=0))
        put = expanded
    in_place = into.id_space == IdSpace.MutableBuffer and len(destination.users) == 1
    out = into if in_place else P.make_or_get_slot(n)
    P.emit(
        IndexCopyNode(
            dst=P.slot_to_tid(into), update=P.slot_to_tid(put), indices=P.slot_to_tid(at),
            out=P.slot_to_tid(out), axis=axis,
        )
    )
    if in_place:
        P.set_slot(n, out)
    return out


def register_index_put() -> None:
    """Stock 1.5.1 has no handler for `aten.index_put`, and its INDEX_COPY pattern matches a
    functional `index_copy` only: capture leaves the cache's `index_copy_` in place, which cannot
    be kept whole, so decomposition makes it `index_put`. Ours, if none is registered."""
    from executorch.backends.mlx.builder.op_registry import REGISTRY

    target = torch.ops.aten.index_put.default
    if target not in REGISTRY.registered_ops():
        REGISTRY.register(target)(index_put_as_index_copy)
