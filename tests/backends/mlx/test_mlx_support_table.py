"""Every op ExecuTorch's MLX backend claims, alone in a program, compiled for MLX and run against eager.

The claimed ops come from the backend's own handler registry, not a hand list. Each
one-op program's inputs are derived from the op's ATen schema (INPUT_OVERRIDES for the
few ops whose arguments must agree with each other). The property checked is that MLX
partition and MLX lowering agree: the program compiles (a node MLX tags lowers), every
node is on MLX or on the CPU with a reason, and the numbers equal eager's. Ops that
cannot be built as a one-op program are in NOT_BUILDABLE with the reason.

Each op is run a second time per non-tensor argument, with that argument off its default
(or off the base case's value): a handler that ignores an argument (stock's sort ignored
`descending`) gives a wrong number only there. Cases are named op-argument=value.

The default run takes every other op in its first dtype; `-m slow` adds the rest, float16, bfloat16 and
int32 wherever eager takes them, and runs the argument variants. What does not depend on MLX (the inputs from the schema,
the module, the other argument values) is in tests/backends/op_programs.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
from backends.op_programs import (  # tests/backends/op_programs.py, shared with the XNNPACK sweep
    SHAPE,
    OneOp,
    OpSweep,
    aten as _aten,
    compare as _compare,
    eager as _eager,
    idx as _idx,
    op_label as _op_label,
    positive as _positive,
    rand as _rand,
    tensor as _t,
    variant_id as _variant_id,
    weight as _w,
)

import compiler
from compiler.backends.mlx.generated import ensure_generated
from compiler.backends.mlx.interpreter import UnsupportedMLXNode
from compiler.ir.errors import CaptureError, VerificationError

FIRST_DTYPES = (torch.float32, torch.int32, torch.bool)  # an op's default dtype: the first eager takes
MORE_DTYPES = (torch.float16, torch.bfloat16, torch.int32)

# Claimed targets no one-op program can stand for, with the reason.
NOT_BUILDABLE = {
    "NOOP": "a marker for dead nodes, not an op",
    "auto_functionalized_v2": "a higher-order wrapper export puts around custom mutating ops",
    "operator.getitem": "takes one output of a multi-output op; covered by topk, sort, split, ...",
    "aten.item.default": "returns a Python scalar, which a program cannot output",
    "aten._assert_scalar.default": "a run-time check on a SymInt; returns nothing",
    "mlx.gather_mm.default": "ExecuTorch MLX's own MoE op, made by its LLM source transforms",
    "mlx.gather_qmm.default": "ExecuTorch MLX's own quantized MoE op, made by its LLM source transforms",
    "mlx.moe_gather_inputs.default": "ExecuTorch MLX's own MoE op, made by its LLM source transforms",
    "mlx.moe_scatter_outputs.default": "ExecuTorch MLX's own MoE op, made by its LLM source transforms",
    "mlx.rope.default": "ExecuTorch MLX's own op, made by its LLM source transforms",
    "mlx.sample.default": "ExecuTorch MLX's own sampling op, made by its LLM source transforms",
    "kvcache.update_and_attend.default": "ExecuTorch's KV-cache op, made by its LLM source transforms",
    "torchao.dequantize_affine.default": "a torchao quantization primitive; only part of a quantized pattern",
}
# Claimed targets that appear only in a dynamic-shape program: test_symbolic_sizes_stay_on_mlx_and_match_eager
# builds one holding them all (label -> the op its placement row names).
SYMBOLIC = {
    "operator.add": "add",
    "operator.sub": "sub",
    "operator.mul": "mul",
    "operator.floordiv": "floordiv",
    "operator.mod": "mod",
    "operator.neg": "neg",
    "aten.sym_size.int": "aten.sym_size.int",
}
# Claimed ops whose one-op program trips a driver bug outside the MLX backend (owner told).
DRIVER_BUGS: dict[str, str] = {}
# Ops our rules (compiler/backends/mlx/support.py) send to the CPU in their one-op program: reason text.
REFUSED = {
    "aten._native_batch_norm_legit_no_training.default": "never writes",  # the program reads save_mean/invstd
    "aten.max_pool2d_with_indices.default": "never writes",  # the program reads the indices
}
# Ops decomposed into one our rules send to the CPU in their one-op program: (that op, reason text).
DECOMPOSED_REFUSED = {
    "aten.max_pool1d_with_indices.default": ("aten.max_pool2d_with_indices.default", "never writes"),
}
# Ops stock's own handler declines in their one-op program (which reads every output): its reason.
STOCK_REFUSED = {
    "aten.convolution.default": "_convolution_handler refused aten.convolution.default: aten.convolution with",
    "aten.native_layer_norm.default": "_native_layer_norm_handler refused aten.native_layer_norm.default",
    "aten.native_group_norm.default": "_native_group_norm_handler refused aten.native_group_norm.default",
}
# ...and, over integers, these (and what they decompose into): MLX's matmul and conv take floats only.
REFUSED_OVER_INTEGERS = (
    "aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.matmul.default", "aten.linear.default",
    "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default",
)
# Ops with no valid program when all their outputs are read: MLX cannot, the CPU runtime has no kernel.
NO_VALID_PROGRAM = {
    "aten.max_pool3d_with_indices.default": "indices: MLX never writes them, and the runtime has no CPU kernel",
}
IN_PLACE = (
    "in-place: export functionalizes it, and only stock's MLXReinplacePass (which this driver "
    "does not run) puts it back"
)


# Ops whose arguments must agree with each other: (dtype) -> (args, kwargs).
INPUT_OVERRIDES: dict[str, Callable[[torch.dtype], tuple[tuple, dict]]] = {
    "aten.mm.default": lambda d: ((_t((3, 4), d), _t((4, 5), d)), {}),
    "aten.bmm.default": lambda d: ((_t((2, 3, 4), d), _t((2, 4, 5), d)), {}),
    "aten.addmm.default": lambda d: ((_t((5,), d), _t((3, 4), d), _t((4, 5), d)), {}),
    "aten.matmul.default": lambda d: ((_t((2, 3, 4), d), _t((4, 5), d)), {}),
    "aten.linear.default": lambda d: ((_t((2, 3, 4), d), _t((5, 4), d), _t((5,), d)), {}),
    "aten.conv1d.default": lambda d: ((_t((1, 2, 8), d), _w((3, 2, 3), d), _w((3,), d)), {}),
    "aten.conv2d.default": lambda d: ((_t((1, 2, 6, 6), d), _w((3, 2, 3, 3), d), _w((3,), d)), {}),
    "aten.conv3d.default": lambda d: ((_t((1, 2, 4, 4, 4), d), _w((3, 2, 3, 3, 3), d), _w((3,), d)), {}),
    "aten.conv_transpose1d.default": lambda d: ((_t((1, 2, 5), d), _w((2, 3, 3), d), _w((3,), d)), {}),
    "aten.conv_transpose2d.input": lambda d: ((_t((1, 2, 4, 4), d), _w((2, 3, 3, 3), d), _w((3,), d)), {}),
    "aten.conv_transpose3d.input": lambda d: ((_t((1, 2, 3, 3, 3), d), _w((2, 3, 2, 2, 2), d), _w((3,), d)), {}),
    "aten.convolution.default": lambda d: (
        (_t((1, 2, 6, 6), d), _w((3, 2, 3, 3), d), _w((3,), d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        {},
    ),
    "aten.avg_pool1d.default": lambda d: ((_t((1, 2, 7), d), [2]), {}),
    "aten.avg_pool2d.default": lambda d: ((_t((1, 2, 7, 7), d), [2, 2]), {}),
    "aten.avg_pool3d.default": lambda d: ((_t((1, 2, 5, 5, 5), d), [2, 2, 2]), {}),
    "aten.max_pool1d.default": lambda d: ((_t((1, 2, 7), d), [2]), {}),
    "aten.max_pool1d_with_indices.default": lambda d: ((_t((1, 2, 7), d), [2]), {}),
    "aten.max_pool2d_with_indices.default": lambda d: ((_t((1, 2, 7, 7), d), [2, 2]), {}),
    "aten.max_pool3d_with_indices.default": lambda d: ((_t((1, 2, 5, 5, 5), d), [2, 2, 2]), {}),
    "aten.upsample_nearest2d.default": lambda d: ((_t((1, 2, 3, 3), d), [6, 6]), {}),
    "aten.upsample_nearest2d.vec": lambda d: ((_t((1, 2, 3, 3), d), None, [2.0, 2.0]), {}),
    "aten.layer_norm.default": lambda d: ((_t(SHAPE, d), [4], _t((4,), d), _t((4,), d)), {}),
    "aten.native_layer_norm.default": lambda d: ((_t(SHAPE, d), [4], _t((4,), d), _t((4,), d), 1e-5), {}),
    "aten.rms_norm.default": lambda d: ((_t(SHAPE, d), [4], _t((4,), d), 1e-6), {}),
    "aten.native_group_norm.default": lambda d: (
        (_t((2, 4, 3), d), _t((4,), d), _t((4,), d), 2, 4, 3, 2, 1e-5),
        {},
    ),
    "aten._native_batch_norm_legit_no_training.default": lambda d: (
        (_t((2, 3, 4), d), _t((3,), d), _t((3,), d), _t((3,), d), _positive(d, (3,)), 0.1, 1e-5),
        {},
    ),
    "aten.embedding.default": lambda d: ((_t((10, 4), d), _idx(1, 3, 9)), {}),
    "aten.index_select.default": lambda d: ((_t(SHAPE, d), 1, _idx(2, 0)), {}),
    "aten.index.Tensor": lambda d: ((_t(SHAPE, d), [None, _idx(2, 0, 1)]), {}),
    "aten.scatter_add.default": lambda d: ((_t(SHAPE, d), 1, torch.randint(0, 3, SHAPE), _t(SHAPE, d)), {}),
    "aten.slice_scatter.default": lambda d: ((_t(SHAPE, d), _t((2, 1, 4), d), 1, 1, 2), {}),
    "aten.copy.default": lambda d: ((_t(SHAPE, d), _t(SHAPE, d)), {}),
    "aten.where.self": lambda d: ((_rand(torch.bool), _t(SHAPE, d), _t(SHAPE, d)), {}),
    "aten.clamp.Tensor": lambda d: ((_t(SHAPE, d), _t(SHAPE, d) - 1, _t(SHAPE, d) + 1), {}),
    "aten.clamp.default": lambda d: ((_t(SHAPE, d), -1, 1), {}),
    "aten.full.default": lambda d: (([2, 3], 1.5 if d.is_floating_point else 3), {"dtype": d}),
    "aten.zeros.default": lambda d: (([2, 3],), {"dtype": d}),
    "aten.ones.default": lambda d: (([2, 3],), {"dtype": d}),
    "aten.scalar_tensor.default": lambda d: ((2.5 if d.is_floating_point else 3,), {"dtype": d}),
    "aten.arange.default": lambda d: ((6,), {"dtype": d}),
    "aten.arange.start_step": lambda d: ((1, 9, 2), {"dtype": d}),
    "aten.view.default": lambda d: ((_t(SHAPE, d), [6, 4]), {}),
    "aten.view_copy.default": lambda d: ((_t(SHAPE, d), [6, 4]), {}),
    "aten.reshape.default": lambda d: ((_t(SHAPE, d), [4, 6]), {}),
    "aten.expand.default": lambda d: ((_t((3, 1), d), [2, 3, 4]), {}),
    "aten.expand_copy.default": lambda d: ((_t((3, 1), d), [2, 3, 4]), {}),
    "aten.permute.default": lambda d: ((_t(SHAPE, d), [2, 0, 1]), {}),
    "aten.permute_copy.default": lambda d: ((_t(SHAPE, d), [2, 0, 1]), {}),
    "aten.repeat.default": lambda d: ((_t(SHAPE, d), [1, 2, 1]), {}),
    "aten.roll.default": lambda d: ((_t(SHAPE, d), [1], [2]), {}),
    "aten.flip.default": lambda d: ((_t(SHAPE, d), [0, 2]), {}),
    "aten.constant_pad_nd.default": lambda d: ((_t(SHAPE, d), [1, 2]), {}),
    "aten.split_with_sizes.default": lambda d: ((_t(SHAPE, d), [1, 3], 2), {}),
    "aten.split_with_sizes_copy.default": lambda d: ((_t(SHAPE, d), [1, 3], 2), {}),
    "aten.squeeze.default": lambda d: ((_t((2, 1, 4), d),), {}),
    "aten.squeeze_copy.default": lambda d: ((_t((2, 1, 4), d),), {}),
    "aten.squeeze.dims": lambda d: ((_t((2, 1, 4), d), [1]), {}),
    "aten.squeeze_copy.dims": lambda d: ((_t((2, 1, 4), d), [1]), {}),
    "aten.topk.default": lambda d: ((_t(SHAPE, d), 2), {}),
    "aten.narrow.default": lambda d: ((_t(SHAPE, d), 2, 1, 2), {}),
    "aten._softmax.default": lambda d: ((_t(SHAPE, d), -1, False), {}),
    "aten._log_softmax.default": lambda d: ((_t(SHAPE, d), -1, False), {}),
    "aten.div.Tensor_mode": lambda d: ((_t(SHAPE, d), _positive(d)), {"rounding_mode": "floor"}),
    "aten.repeat_interleave.self_int": lambda d: ((_t(SHAPE, d), 2, 1), {}),
    # Integer powers with negative exponents (0 or 1 / n truncated in torch) are left out.
    "aten.pow.Tensor_Tensor": lambda d: ((_positive(d), _t(SHAPE, d) if d.is_floating_point else _positive(d)), {}),
}

# (op, argument) -> a value that only one op's other arguments decide.
VALUES = {
    ("aten.repeat_interleave.self_int", "output_size"): 6,  # the size the output has: 3 repeated twice
}
# (op, argument) -> inputs under which the argument can take another value: (dtype) -> (args, kwargs).
VARIANT_INPUTS: dict[tuple[str, str], Callable[[torch.dtype], tuple[tuple, dict]]] = {
    ("aten.conv1d.default", "groups"): lambda d: ((_t((1, 2, 8), d), _w((4, 1, 3), d), _w((4,), d)), {}),
    ("aten.conv2d.default", "groups"): lambda d: ((_t((1, 2, 6, 6), d), _w((4, 1, 3, 3), d), _w((4,), d)), {}),
    ("aten.conv3d.default", "groups"): lambda d: (
        (_t((1, 2, 4, 4, 4), d), _w((4, 1, 3, 3, 3), d), _w((4,), d)),
        {},
    ),
    ("aten.conv3d.default", "dilation"): lambda d: ((_t((1, 2, 6, 6, 6), d), _w((3, 2, 3, 3, 3), d), _w((3,), d)), {}),
    ("aten.conv_transpose1d.default", "groups"): lambda d: ((_t((1, 2, 5), d), _w((2, 3, 3), d), _w((6,), d)), {}),
    ("aten.conv_transpose2d.input", "groups"): lambda d: (
        (_t((1, 2, 4, 4), d), _w((2, 3, 3, 3), d), _w((6,), d)),
        {},
    ),
    ("aten.conv_transpose3d.input", "groups"): lambda d: (
        (_t((1, 2, 3, 3, 3), d), _w((2, 3, 2, 2, 2), d), _w((6,), d)),
        {},
    ),
    ("aten.clone.default", "memory_format"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
    ("aten._to_copy.default", "memory_format"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
    ("dim_order_ops._clone_dim_order.default", "dim_order"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
    ("dim_order_ops._to_dim_order_copy.default", "dim_order"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
}


@functools.cache
def claimed() -> dict[str, Any]:
    """label -> target, for every target ExecuTorch's MLX handler registry holds."""
    ensure_generated()
    import executorch.backends.mlx.ops  # noqa: F401  registers the handlers
    import executorch.backends.mlx.patterns  # noqa: F401
    from executorch.backends.mlx.builder.op_registry import REGISTRY

    return {_op_label(t): t for t in REGISTRY.registered_ops()}


def not_buildable(label: str, target: Any) -> str | None:
    if label in NOT_BUILDABLE:
        return NOT_BUILDABLE[label]
    if label in SYMBOLIC:
        return "a SymInt op: built in a dynamic-shape program by test_symbolic_sizes_stay_on_mlx_and_match_eager"
    op = _aten(target)
    if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable:
        return IN_PLACE
    return None


SWEEP = OpSweep(claimed, INPUT_OVERRIDES, VARIANT_INPUTS, VALUES, FIRST_DTYPES)


def one_op_program(label: str, dtype: torch.dtype) -> OneOp | None:
    """The one-op module for `label` over `dtype`, or None when eager does not take that dtype."""
    return SWEEP.one_op_program(label, dtype)


# --- the cases ---------------------------------------------------------------------------


def _buildable() -> list[str]:
    return sorted(label for label, target in claimed().items() if not_buildable(label, target) is None)


def _first_dtype(label: str) -> torch.dtype:
    return SWEEP.first_dtype(label)


def _cases() -> list:
    cases = []
    for index, label in enumerate(_buildable()):
        first = _first_dtype(label)
        known = [pytest.mark.xfail(reason=DRIVER_BUGS[label], strict=True)] if label in DRIVER_BUGS else []
        sampled = known if index % 2 == 0 else [pytest.mark.slow, *known]  # the default run: every other op
        cases.append(pytest.param(label, first, id=f"{label}-{str(first)[6:]}", marks=sampled))
        for dtype in MORE_DTYPES:
            if dtype != first:
                marks = [pytest.mark.slow, *known]
                cases.append(pytest.param(label, dtype, id=f"{label}-{str(dtype)[6:]}", marks=marks))
    return cases


def _placement_is_explained(label: str, artifact) -> None:
    """Every op is on MLX or on the CPU with a reason; printed (-s) as the sweep's table row."""
    rows = artifact.report.placement
    for row in rows:
        assert row.where == "MLXBackend" or (row.where == "cpu" and row.reason), row
    mine = [row for row in rows if row.op == label]
    where = f"{mine[0].where}: {mine[0].reason}" if mine else "decomposed: " + ", ".join(r.op for r in rows)
    print(f"\nTABLE {label} | {where[:200]}")


def _assert_on_cpu(artifact, ops, reason: str) -> None:
    rows = [row for row in artifact.report.placement if row.op in ops]
    assert rows and all(row.where == "cpu" and reason in row.reason for row in rows), rows


@pytest.mark.parametrize(("label", "dtype"), _cases())
def test_op_lowers_and_matches_eager(label, dtype, request):
    module = one_op_program(label, dtype)
    if module is None:
        if not request.node.get_closest_marker("slow"):
            pytest.fail(f"eager takes none of {FIRST_DTYPES} for {label}: fix its inputs")
        pytest.skip(f"eager does not take {dtype} for {label}")
    _lowers_and_matches_eager(label, dtype, module)


def _lowers_and_matches_eager(label: str, dtype: torch.dtype, module: OneOp, case: str = "") -> None:
    """Compile `module` for MLX, check where `label` lands, run it and compare with eager
    (`case` names a variant, for the VARIANT_ tables)."""
    expected = _eager(module)
    if label in NO_VALID_PROGRAM or case in VARIANT_NO_VALID_PROGRAM:
        with pytest.raises(VerificationError, match="no kernel"):
            compiler.compile(module, module.example, backend="mlx")
        return

    artifact = compiler.compile(module, module.example, backend="mlx")  # a tagged node must lower
    _placement_is_explained(label, artifact)
    refused = VARIANT_REFUSED.get(case) or REFUSED.get(label) or STOCK_REFUSED.get(label)
    if label in REFUSED_OVER_INTEGERS and not dtype.is_floating_point:
        _assert_on_cpu(artifact, REFUSED_OVER_INTEGERS, "floating types only")  # before stock's check
    elif refused:
        _assert_on_cpu(artifact, [label], refused)
    elif label in DECOMPOSED_REFUSED:
        became, reason = DECOMPOSED_REFUSED[label]
        _assert_on_cpu(artifact, [became], reason)
    elif not case and dtype == _first_dtype(label):  # the base case, not refused: the op is MLX's
        # (or, decomposed, every op it became is; dropped, none is left)
        mine = [row for row in artifact.report.placement if row.op == label] or artifact.report.placement
        assert all(row.where == "MLXBackend" for row in mine), mine
    try:
        outputs = compiler.run(artifact, module.example)
    except UnsupportedMLXNode as gap:
        pytest.xfail(f"runner gap: {', '.join(gap.nodes)}")
    _compare(outputs, expected)


def _unbuildable() -> list:
    return [
        pytest.param(label, not_buildable(label, target), id=label)
        for label, target in sorted(claimed().items())
        if not_buildable(label, target)
    ]


def test_every_claimed_op_is_built_or_listed_with_a_reason():
    """The claimed ops (the handler registry) are exactly the base cases' ops plus the listed
    ones (NOT_BUILDABLE, SYMBOLIC, the in-place ops), each listed one with a reason; no
    listed op is also built, and no table names an op the registry does not claim."""
    labels = claimed()
    built = {case.values[0] for case in _cases()}
    in_place = {label for label, target in labels.items() if label not in NOT_BUILDABLE
                and isinstance(_aten(target), torch._ops.OpOverload) and _aten(target)._schema.is_mutable}
    listed = set(NOT_BUILDABLE) | set(SYMBOLIC) | in_place
    assert built | listed == set(labels), sorted(set(labels) - built - listed)  # nothing claimed is left out
    assert not built & listed, sorted(built & listed)
    assert not set(NOT_BUILDABLE) & set(SYMBOLIC)
    for label, reason in (case.values for case in _unbuildable()):
        assert isinstance(reason, str) and reason.strip(), label  # every op left out says why
    extra = (dict.fromkeys(REFUSED_OVER_INTEGERS),)
    tables = (NOT_BUILDABLE, SYMBOLIC, INPUT_OVERRIDES, REFUSED, DECOMPOSED_REFUSED, STOCK_REFUSED, NO_VALID_PROGRAM)
    for table in (*tables, DRIVER_BUGS, *extra):
        assert set(table) <= set(labels), set(table) - set(labels)  # no stale entries


class SymbolicSizes(torch.nn.Module):
    """Every SymInt op MLX claims, between the sym_size nodes of a dynamic batch."""

    def forward(self, x):
        n = x.shape[0]
        a = (n + 2) * 3 - 1
        return x * a + a // 2 - a % 5, x[: n - 1] * (-n)


def test_symbolic_sizes_stay_on_mlx_and_match_eager():
    model, dynamic = SymbolicSizes(), ({0: torch.export.Dim("n", min=3, max=16)},)
    artifact = compiler.compile(model, (torch.randn(4, 3),), backend="mlx", dynamic_shapes=dynamic)
    placed = {row.op: row.where for row in artifact.report.placement}
    assert {op: placed.get(op) for op in SYMBOLIC.values()} == dict.fromkeys(SYMBOLIC.values(), "MLXBackend")
    for n in (4, 7):  # two sizes: the sizes are computed at run time, not baked in
        x = torch.randn(n, 3)
        _compare(compiler.run(artifact, (x,)), list(model(x)))


class MaxPool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.max_pool2d(x, 2) * 2.0


def test_max_pool_whose_indices_are_unread_stays_on_mlx():
    x = torch.randn(1, 2, 6, 6)
    artifact = compiler.compile(MaxPool().eval(), (x,), backend="mlx")
    assert all(row.where == "MLXBackend" for row in artifact.report.placement)
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, MaxPool()(x))


# --- variants: each non-tensor argument with a default, at another value ----------------
#
# The cases above pass non-tensor arguments at their defaults, so a handler that ignores
# one (stock's sort ignored `descending`) passes them. Here each such argument of each
# buildable op is set, one at a time, to a value other than the base case's, chosen by its
# schema type and name: the first candidate eager takes whose output differs from the base
# case's (else the first eager takes, and the table row says "same output"). These run
# with `-m slow` (CI's slow job), in every dtype: the default run's time budget keeps the
# base cases only.

# NO_OTHER_VALUE and COMPANIONS (backends/op_programs.py): arguments not varied, and those set in
# pairs; VALUES and VARIANT_INPUTS (above, beside INPUT_OVERRIDES): the values and inputs of a few.
# Variants torch.export cannot capture though eager runs them: case id with dtype -> reason.
VARIANT_EXPORT_FAILS = {
    "aten.arange.start_step-step=0.5-int32": "export's fake arange truncates a float step for an integer dtype",
}
# Variants our rules (compiler/backends/mlx/support.py) send to the CPU: case id -> reason text.
VARIANT_REFUSED: dict[str, str] = {}
# Variants with no valid program: stock's MLX handler refuses them and the CPU runtime has no kernel.
_NO_AVG_POOL3D = "stock's pool handler refuses it, and the runtime has no CPU avg_pool3d kernel"
VARIANT_NO_VALID_PROGRAM = {
    "aten.avg_pool3d.default-ceil_mode=True": _NO_AVG_POOL3D,
    "aten.avg_pool3d.default-count_include_pad=False+padding=[1,1,1]": _NO_AVG_POOL3D,
    "aten.avg_pool3d.default-divisor_override=3": _NO_AVG_POOL3D,
}


def variant_program(label: str, dtype: torch.dtype, changes: dict[str, Any]) -> OneOp | None:
    """The one-op module for `label` over `dtype` with `changes` made, or None when eager refuses it."""
    return SWEEP.variant_program(label, dtype, changes)


def _variant(label: str, argument, dtype: torch.dtype) -> tuple[dict[str, Any] | None, str]:
    """(changes, note) for one argument: the arguments to set, or None and why there are none."""
    return SWEEP.variant(label, argument, dtype)


def _varied_arguments(label: str) -> list:
    """Every non-tensor argument: those with a default, and the required ones the base case sets."""
    return SWEEP.varied_arguments(label)


def _export_fails(case_id: str) -> list:
    reason = VARIANT_EXPORT_FAILS.get(case_id)
    return [pytest.mark.xfail(reason=reason, raises=CaptureError, strict=True)] if reason else []


@functools.cache
def _variants() -> tuple[list, list]:
    """(cases, skips): one case per defaulted non-tensor argument of every buildable op."""
    cases, skips = [], []
    for label in _buildable():
        dtype = _first_dtype(label)
        for argument in _varied_arguments(label):
            changes, note = _variant(label, argument, dtype)
            if changes is None:
                skips.append(pytest.param(label, argument.name, note, id=f"{label}-{argument.name}"))
                continue
            case_id = _variant_id(label, changes)
            cases.append(pytest.param(label, dtype, changes, note, id=f"{case_id}-{str(dtype)[6:]}", marks=pytest.mark.slow))
            for more in MORE_DTYPES:
                if more != dtype:
                    slow = [pytest.mark.slow, *_export_fails(f"{case_id}-{str(more)[6:]}")]
                    cases.append(pytest.param(label, more, changes, note, id=f"{case_id}-{str(more)[6:]}", marks=slow))
    return cases, skips


@pytest.mark.parametrize(("label", "dtype", "changes", "note"), _variants()[0])
def test_op_with_an_argument_off_its_default_matches_eager(label, dtype, changes, note, request):
    module = variant_program(label, dtype, changes)
    if module is None:
        pytest.skip(f"eager does not take {dtype} for {label} with {changes}")
    case_id = _variant_id(label, changes)
    print(f"\nVARIANT {case_id} {note}", end="")
    _lowers_and_matches_eager(label, dtype, module, case_id)


def test_every_argument_without_another_value_says_why():
    """The arguments no variant is made for (not cases, so real skips stand out): each
    of a built op, with a reason."""
    built = set(_buildable())
    for skip in _variants()[1]:
        label, name, reason = skip.values
        assert label in built and name in {a.name for a in _varied_arguments(label)}, (label, name)
        assert isinstance(reason, str) and reason.strip(), (label, name)


def test_every_listed_variant_is_a_case():
    ids = {_variant_id(case.values[0], case.values[2]) for case in _variants()[0]}
    for table in (VARIANT_REFUSED, VARIANT_NO_VALID_PROGRAM):
        assert set(table) <= ids, set(table) - ids  # no stale entries
    assert set(VARIANT_EXPORT_FAILS) <= {case.id for case in _variants()[0]}
    for label, name in (*VARIANT_INPUTS, *VALUES):
        assert name in {a.name for a in _varied_arguments(label)}, (label, name)
