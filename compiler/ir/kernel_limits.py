"""Inputs the portable runtime's CPU kernels refuse although torch takes them.

A kernel that exists can still refuse a call: the portable `convolution.out` takes 3-D
or 4-D inputs only, so a 3-D convolution (5-D input) passed the kernel check and then
failed when the program ran. Each limit here is read off a check in ExecuTorch's portable
kernels (the 1.5 source, `kernels/portable/cpu/`), which its reason quotes, and a test
of tests/backends/portable/test_portable_support_table.py shows the runtime refusing (or
crashing on) it. The partition stage rewrites the calls it can into ones the kernel
takes (`compiler/passes/cpu_rewrites.py`); the `cpu_ops_have_kernels` invariant refuses
a CPU node still over a limit, so the compile fails, not the run.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from compiler.ir.private_api import aten_overload


@attrs.frozen
class KernelLimit:
    """One limit: the op, when a call is over it, and the kernel check that says so."""

    name: str  # names the limit in tests and rewrites
    op: str  # the Edge op's name, as `str(overload)` spells it
    limit: str  # what the kernel refuses, in words
    source: str  # file:function of the check
    reason: str  # the check, quoted
    hit: Callable[[torch.fx.Node], bool]


def _rank(node: torch.fx.Node) -> int | None:
    """The rank of the call's first argument (the input every limit here is about)."""
    first = node.args[0] if node.args else None
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else None


def _transposed(node: torch.fx.Node) -> bool:
    return bool(node.args[6])


KERNEL_LIMITS: tuple[KernelLimit, ...] = (
    KernelLimit(
        "conv3d",
        "aten.convolution.default",
        "input of rank 5 (a 3-D convolution), not transposed",
        "kernels/portable/cpu/util/kernel_ops_util.cpp:check_convolution_args",
        'in.dim() == 3 || in.dim() == 4: "Expect input tensor to be 3-D or 4-D"',
        lambda node: _rank(node) == 5 and not _transposed(node),
    ),
    KernelLimit(
        "conv_transpose3d",
        "aten.convolution.default",
        "input of rank 5 (a 3-D convolution), transposed",
        "kernels/portable/cpu/util/kernel_ops_util.cpp:check_convolution_args",
        'in.dim() == 3 || in.dim() == 4: "Expect input tensor to be 3-D or 4-D"',
        lambda node: _rank(node) == 5 and _transposed(node),
    ),
    KernelLimit(
        "cumsum_0d",
        "aten.cumsum.default",
        "0-d input (torch takes dim 0 or -1)",
        "kernels/portable/cpu/util/kernel_ops_util.cpp:check_cumsum_args",
        "dim_is_valid(dim, in.dim()): dim >= -0 && dim < 0 fails for every dim of a 0-d tensor",
        lambda node: _rank(node) == 0,
    ),
    KernelLimit(
        "sum_0d",
        "aten.sum.dim_IntList",
        "0-d input reduced over dim 0 or -1",
        "kernels/portable/cpu/op_sum.cpp:sum_dim_out",
        "check_dim_list_is_valid lets `in.dim() == 0: d == 0 || d == -1` through, then Tensor::size(d) "
        'aborts the process: "assert failed (dim < dim_ && dim >= 0)"',
        lambda node: _rank(node) == 0 and bool(node.args[1]),
    ),
    KernelLimit(
        "pad_negative",
        "aten.constant_pad_nd.default",
        "a negative padding (torch crops there)",
        "kernels/portable/cpu/util/kernel_ops_util.cpp:check_constant_pad_args",
        'pad[i] >= 0: "Padding values must be non-negative"',
        lambda node: any(isinstance(p, int) and p < 0 for p in node.args[1]),
    ),
)

_BY_OP: dict[str, tuple[KernelLimit, ...]] = {}
for _limit in KERNEL_LIMITS:
    _BY_OP[_limit.op] = _BY_OP.get(_limit.op, ()) + (_limit,)


def kernel_limit(node: torch.fx.Node) -> KernelLimit | None:
    """The limit of the portable kernel that a CPU call `node` is over, or None."""
    if node.op != "call_function":
        return None
    target = aten_overload(node.target)
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return next((limit for limit in _BY_OP.get(str(target), ()) if limit.hit(node)), None)
