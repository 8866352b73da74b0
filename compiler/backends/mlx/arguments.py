"""The arguments of a call: what a node passes for a schema argument, and the arguments stock's
MLX handlers ignore (the rules refuse such calls; the rewrites make the value explicit)."""

from __future__ import annotations

from typing import Optional

import torch

from compiler.backends.mlx import fixes
from compiler.ir.dialect import op_name
from compiler.ir.private_api import aten_overload


def schema_of(node: torch.fx.Node):
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        # Edge ops wrap the ATen overload they stand for.
        schema = getattr(aten_overload(node.target), "_schema", None)
    return schema


# Arguments stock 1.5.1's MLX handlers never read, with the only value they honour.
_IGNORED_ARGUMENTS = {
    "aten.sort.default": ("descending", False),
    "aten.argsort.default": ("descending", False),
    "aten.topk.default": ("largest", True),
}


def argument(node: torch.fx.Node, name: str, default):
    """The value `node` passes for the schema argument `name` (its default when not passed)."""
    for position, argument in enumerate(schema_of(node).arguments):
        if argument.name != name:
            continue
        if name in node.kwargs:
            return node.kwargs[name]
        return node.args[position] if position < len(node.args) else default
    return default


def ignored_argument(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's MLX sort, argsort and topk handlers read only the tensor, k and dim:
    `sort(descending=True)` came back ascending and `topk(largest=False)` gave the largest
    values, silently. Those calls stay on the CPU."""
    ignored = _IGNORED_ARGUMENTS.get(op_name(node.target))
    if ignored is None or not fixes.on("ignored_arguments_made_explicit"):
        return None
    name, honoured = ignored
    value = argument(node, name, honoured)
    if value == honoured:
        return None
    return (
        f"ExecuTorch 1.5.1's MLX handler ignores {name} (it computes {name}={honoured}), and this call "
        f"passes {name}={value}"
    )
