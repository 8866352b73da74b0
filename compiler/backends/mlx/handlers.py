"""Stock MLX handlers that take a dynamic size as a number, run under our own while we use them.

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
