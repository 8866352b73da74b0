"""Which dialect an op target belongs to.

ATen programs hold `torch._ops.OpOverload`s, Edge programs hold `EdgeOpOverload`s;
both may hold higher-order ops, `operator.getitem` and symbolic-int helpers.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from compiler.ir.private_api import aten_overload, executorch_sym_ops, is_edge_op

ATEN = "aten"
EDGE = "edge"

# Targets legal in either dialect: tuple access, symbolic integer math, and the
# run-time size checks torch.export adds for data-dependent sizes (`y[y > 0]`),
# which ExecuTorch's Edge conversion leaves as ATen ops.
_NEUTRAL_TARGETS = frozenset(
    [
        operator.getitem,
        *executorch_sym_ops(),
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten.sym_constrain_range_for_size.default,
    ]
)


def op_dialect(target: Any) -> str | None:
    """The dialect a call target pins a program to, or None if it fits any."""
    if target in _NEUTRAL_TARGETS or isinstance(target, torch._ops.HigherOrderOperator):
        return None
    if is_edge_op(target):
        return EDGE
    if isinstance(target, torch._ops.OpOverload):
        return ATEN
    return None


def op_name(target: Any) -> str:
    """A short readable op name, the same for the ATen and the Edge spelling."""
    target = aten_overload(target)
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def op_from_name(name: str) -> torch._ops.OpOverload:
    """The OpOverload for a name like "aten.linear.default" (or "aten::linear", "aten.linear")."""
    parts = name.replace("::", ".").split(".")
    if len(parts) == 2:
        parts.append("default")
    namespace, op, overload = parts[:3]
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)
