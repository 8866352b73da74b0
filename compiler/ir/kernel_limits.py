"""Inputs the portable runtime's CPU kernels refuse although torch takes them.

A kernel that exists can still refuse a call: the portable `convolution.out` takes 3-D
or 4-D inputs only, so a 3-D convolution (5-D input) passed the kernel check and then
failed when the program ran; `gather` reads an int64 index only, where torch takes int32 too.
Each limit here is read off a check in the runtime's kernels (the 1.5 source,
`kernels/portable/cpu/`, and `kernels/optimized/cpu/` for the FFTs), which its reason quotes, and a test
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


def _index_not_int64(node: torch.fx.Node) -> bool:
    """Whether the call's index (its third argument) is of another dtype than int64."""
    index = node.args[2] if len(node.args) > 2 else None
    value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype != torch.int64


def _not_over_the_last_dims(node: torch.fx.Node) -> bool:
    """Whether a transform's dims (its second argument) are other than the input's last dims in
    order: torch then lays its result out in another dim order than the input (read off the dims,
    not the strides, so a symbolic size is not fixed by the asking)."""
    rank = _rank(node)
    dims = [d % rank for d in node.args[1]] if rank else []
    return bool(rank) and dims != list(range(rank - len(dims), rank))


def _int64_index_only(name: str, op: str, source: str) -> KernelLimit:
    """The limit of a kernel that reads its index as int64 only (torch takes int32 too)."""
    return KernelLimit(
        name, op, "an index of another dtype than int64 (torch takes int32 too)",
        f"kernels/portable/cpu/util/index_util.cpp:{source}",
        'index.scalar_type() == ScalarType::Long: "Expected dtype int64 for index"',
        _index_not_int64,
    )


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
    KernelLimit(
        "fft_c2r_inner_dim",
        "aten._fft_c2r.default",
        "a transform over dims other than the last ones (torch lays the result out in another dim order)",
        "kernels/optimized/cpu/op_fft_c2r.cpp:opt_fft_c2r_out",
        "tensors_have_same_dim_order(in, out): \"2 input tensors have different dim orders\"",
        _not_over_the_last_dims,
    ),
    KernelLimit(
        "fft_r2c_inner_dim",
        "aten._fft_r2c.default",
        "a transform over dims other than the last ones (torch lays the result out in another dim order)",
        "kernels/optimized/cpu/op_fft_r2c.cpp:opt_fft_r2c_out",
        "tensors_have_same_dim_order(in, out): \"2 input tensors have different dim orders\"",
        _not_over_the_last_dims,
    ),
    _int64_index_only("gather_int32_index", "aten.gather.default", "check_gather_args"),
    _int64_index_only("scatter_src_int32_index", "aten.scatter.src", "check_scatter_src_args"),
    _int64_index_only("scatter_value_int32_index", "aten.scatter.value", "check_scatter_value_args"),
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
