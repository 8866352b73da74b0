"""Every op ExecuTorch's XNNPACK partitioner claims, alone in a program, compiled for XNNPACK and run against eager.

The claimed ops come from the partitioner's own configs (`target_partitioner_configs`),
not a hand list. Each one-op program's inputs are derived from the op's ATen schema
(tests/backends/op_programs.py, shared with the MLX sweep; INPUT_OVERRIDES for the ops
whose arguments must agree, or whose weights XNNPACK takes only as parameters). The
property checked is that XNNPACK's partition and its lowering agree: the program
compiles (a node XNNPACK's configs take lowers, or is refused with a named error),
every node is on XNNPACK or on the CPU with a reason, and the numbers equal eager's.
In its float32 base case each op is on XNNPACK (else it is listed in BASE_ON_CPU or
BASE_REWRITTEN): the sweep checks the delegate, not the CPU's kernels. Where stock's
config refuses a variant, the variant checks the CPU's kernel and the placement reason.

Each op is run again per non-tensor argument, with that argument off its default (or
off the base case's value): a node visitor that ignores an argument (stock's GELU
visitor ignored `approximate`) gives a wrong number only there. Cases are named
op-argument=value. The default run is float32; `-m slow` adds float16, which
XNNPACK's configs take too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
from backends.op_programs import (  # tests/backends/op_programs.py, shared with the MLX sweep
    SHAPE,
    OneOp,
    OpSweep,
    compare,
    dtype_id,
    eager,
    op_label,
    positive,
    tensor as _t,
    variant_id,
    weight as _w,
)

import compiler
from compiler.ir.errors import CompileError

XNNPACK = "XnnpackBackend"
FIRST_DTYPES = (torch.float32,)  # the precision XNNPACK's float configs take
MORE_DTYPES = (torch.float16,)

# Claimed targets no one-op program can stand for, with the reason.
_AFFINE = (
    "torchao's quantization primitive: the config takes no node itself, it only keeps the op whole "
    "for a dynamically quantized GEMM (tests/backends/xnnpack/test_quantized_linear.py)"
)
NOT_BUILDABLE = {
    "torchao.quantize_affine.default": _AFFINE,
    "torchao.dequantize_affine.default": _AFFINE,
    "torchao.choose_qparams_affine.default": _AFFINE,
}
# Claimed ops XNNPACK takes only inside a quantized pattern (dq -> op -> q) made by a quantizer:
# test_static_quantization_per_tensor_stays_on_xnnpack_and_matches_eager builds one.
STATIC_QUANT = ("quantized_decomposed.quantize_per_tensor.default", "quantized_decomposed.dequantize_per_tensor.default")
# Ops on the CPU in their base program, with the reason the placement gives.
BASE_ON_CPU = {
    "dim_order_ops._clone_dim_order.default": "a copy whose result leaves the delegate",  # rules.py
}
# Ops no longer in their base program once compiled: the ops they became.
BASE_REWRITTEN = {
    "aten.clone.default": ["dim_order_ops._clone_dim_order.default"],  # on the CPU, as above
    "dim_order_ops._to_dim_order_copy.default": [],  # a copy to the same dtype and dim order: dropped
}

# Ops whose arguments must agree with each other, or whose weights XNNPACK takes only as
# parameters of the program, or whose configs take only some values: (dtype) -> (args, kwargs).
INPUT_OVERRIDES: dict[str, Callable[[torch.dtype], tuple[tuple, dict]]] = {
    "aten.mm.default": lambda d: ((_t((3, 4), d), _w((4, 5), d)), {}),
    "aten.bmm.default": lambda d: ((_t((2, 3, 4), d), _t((2, 4, 5), d)), {}),
    "aten.addmm.default": lambda d: ((_w((5,), d), _t((3, 4), d), _w((4, 5), d)), {}),
    "aten.linear.default": lambda d: ((_t((2, 3, 4), d), _w((5, 4), d), _w((5,), d)), {}),
    "aten.convolution.default": lambda d: (
        (_t((1, 2, 6, 6), d), _w((3, 2, 3, 3), d), _w((3,), d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        {},
    ),
    "aten.avg_pool2d.default": lambda d: ((_t((1, 2, 7, 7), d), [2, 2]), {}),
    "aten.max_pool2d.default": lambda d: ((_t((1, 2, 7, 7), d), [2, 2]), {}),
    "aten.upsample_bilinear2d.vec": lambda d: ((_t((1, 2, 3, 3), d), None, False, [2.0, 2.0]), {}),
    "aten._native_batch_norm_legit_no_training.default": lambda d: (
        (_t((1, 3, 4, 4), d), _w((3,), d), _w((3,), d), _w((3,), d), torch.nn.Parameter(positive(d, (3,)), False), 0.1, 1e-5),
        {},
    ),
    "aten.prelu.default": lambda d: ((_t((1, 3, 4, 4), d), _w((3,), d)), {}),  # stock: 4-D (NHWC)
    "aten._softmax.default": lambda d: ((_t(SHAPE, d), -1, False), {}),
    "aten.clamp.default": lambda d: ((_t(SHAPE, d), -1, 1), {}),
    "aten.constant_pad_nd.default": lambda d: ((_t(SHAPE, d), [1, 2]), {}),
    "aten.view_copy.default": lambda d: ((_t(SHAPE, d), [6, 4]), {}),
    "aten.permute_copy.default": lambda d: ((_t(SHAPE, d), [2, 0, 1]), {}),
    "aten.slice_copy.Tensor": lambda d: ((_t(SHAPE, d), 2, 1, 3), {}),
    "aten.unsqueeze_copy.default": lambda d: ((_t(SHAPE, d), 3), {}),  # stock takes the trailing dim only
    "aten.pow.Tensor_Scalar": lambda d: ((_t(SHAPE, d), 2), {}),  # stock takes the square only
    "aten.mean.dim": lambda d: ((_t((1, 2, 3, 4), d), [2, 3], True), {}),  # stock: 4-D, over H and W, keepdim
    "aten.max.dim": lambda d: ((_t((1, 2, 3, 4), d), 3, True), {}),  # stock: 4-D
}
# Ops whose program returns only some of the op's outputs (XNNPACK takes them only then): which.
OUTPUTS = {
    "aten._native_batch_norm_legit_no_training.default": (0,),  # save_mean/invstd: XNNPACK never writes them
    "aten.max.dim": (0,),  # the indices: XNNPACK never writes them
}

# (op, argument) -> a value that only one op's other arguments decide.
VALUES: dict[tuple[str, str], Any] = {
    ("aten.slice_copy.Tensor", "end"): 2,  # the base slices [1:3] of 4: -1 and 3 end where it does
}
# (op, argument) -> inputs under which the argument can take another value: (dtype) -> (args, kwargs).
VARIANT_INPUTS: dict[tuple[str, str], Callable[[torch.dtype], tuple[tuple, dict]]] = {
    ("aten.convolution.default", "transposed"): lambda d: (  # the weight is (in, out / groups, kH, kW)
        (_t((1, 3, 6, 6), d), _w((3, 2, 3, 3), d), _w((2,), d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        {},
    ),
    ("aten.convolution.default", "output_padding"): lambda d: (  # a transposed convolution's
        (_t((1, 3, 5, 5), d), _w((3, 2, 3, 3), d), _w((2,), d), [2, 2], [1, 1], [1, 1], True, [0, 0], 1),
        {},
    ),
    ("aten.convolution.default", "groups"): lambda d: (
        (_t((1, 2, 6, 6), d), _w((4, 1, 3, 3), d), _w((4,), d), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        {},
    ),
    ("aten.clone.default", "memory_format"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
    ("dim_order_ops._clone_dim_order.default", "dim_order"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
    ("dim_order_ops._to_dim_order_copy.default", "dim_order"): lambda d: ((_t((1, 2, 3, 4), d),), {}),
}
# Variants our rules (compiler/backends/xnnpack/rules.py) send to the CPU: case id -> reason text.
VARIANT_REFUSED = {
    "aten.addmm.default-beta=0.5": "addmm visitor ignores beta and alpha",
    "aten.addmm.default-alpha=0.5": "addmm visitor ignores beta and alpha",
    "aten.max.dim-dim=1": "pools only dim 2 or 3 with keepdim=True",
    "aten.max.dim-keepdim=False": "pools only dim 2 or 3 with keepdim=True",
    "aten.upsample_bilinear2d.vec-scale_factors=[2.2,1.7]": "bilinear resize ignores them",
}
# Variants that fail to compile with a named error: case id -> text of the error.
VARIANT_NAMED_ERROR: dict[str, str] = {}

# The namespaces a config's target name is looked up in, in order: Edge programs hold
# quantized_decomposed's quantize_per_tensor, not ATen's (which makes a quantized tensor).
_NAMESPACES = ("quantized_decomposed", "dim_order_ops", "torchao", "aten")


def _target(name: str, config) -> torch._ops.OpOverload:
    """The op a config's target name ("add.Tensor") stands for."""
    original = config.get_original_aten()
    if original is not None:
        return original
    op, overload = name.split(".")
    for namespace in _NAMESPACES:
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and overload in packet.overloads():
            return getattr(packet, overload)
    raise LookupError(f"no op for XNNPACK's {type(config).__name__} target {name}")


@functools.cache
def claimed() -> dict[str, Any]:
    """label -> op, for every target ExecuTorch's XnnpackPartitioner has a config for."""
    import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  registers dim_order_ops
    import torchao.quantization.quant_primitives  # noqa: F401  registers torchao's ops
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    configs = XnnpackPartitioner().target_partitioner_configs
    return {op_label(op): op for op in (_target(name, config) for name, config in configs.items())}


SWEEP = OpSweep(claimed, INPUT_OVERRIDES, VARIANT_INPUTS, VALUES, FIRST_DTYPES)


class Outputs(torch.nn.Module):
    """A one-op module's outputs at `picked` only."""

    def __init__(self, module: OneOp, picked: tuple[int, ...]) -> None:
        super().__init__()
        self.module, self.picked, self.example = module, picked, module.example

    def forward(self, *tensors):
        out = self.module(*tensors)
        return tuple(out[i] for i in self.picked)


def _reading(label: str, module: OneOp | None) -> torch.nn.Module | None:
    return Outputs(module, OUTPUTS[label]) if module is not None and label in OUTPUTS else module


def _buildable() -> list[str]:
    return sorted(label for label in claimed() if label not in NOT_BUILDABLE and label not in STATIC_QUANT)


def _cases() -> list:
    cases = []
    for label in _buildable():
        cases.append(pytest.param(label, FIRST_DTYPES[0], id=f"{label}-{dtype_id(FIRST_DTYPES[0])}"))
        for dtype in MORE_DTYPES:
            cases.append(pytest.param(label, dtype, id=f"{label}-{dtype_id(dtype)}", marks=pytest.mark.slow))
    return cases


def _rows(artifact, label: str) -> list:
    return [row for row in artifact.report.placement if row.op == label]


def _placement_is_explained(label: str, artifact) -> None:
    """Every op is on XNNPACK or on the CPU with a reason; printed (-s) as the sweep's table row."""
    rows = artifact.report.placement
    for row in rows:
        assert row.where == XNNPACK or (row.where == "cpu" and row.reason), row
    mine = _rows(artifact, label)
    where = f"{mine[0].where}: {mine[0].reason}" if mine else "rewritten: " + ", ".join(r.op for r in rows)
    print(f"\nTABLE {label} | {where[:200]}")


def _lowers_and_matches_eager(label: str, module: torch.nn.Module, case: str = "") -> Any:
    """Compile `module` for XNNPACK, run it and compare with eager; the artifact, or None
    when a VARIANT_NAMED_ERROR case fails as listed."""
    expected = eager(module)
    if case in VARIANT_NAMED_ERROR:
        with pytest.raises(CompileError, match=VARIANT_NAMED_ERROR[case]):
            compiler.compile(module, module.example, "xnnpack")
        return None
    artifact = compiler.compile(module, module.example, "xnnpack")  # a node XNNPACK takes must lower
    _placement_is_explained(label, artifact)
    if case in VARIANT_REFUSED:
        rows = _rows(artifact, label)
        assert rows and all(r.where == "cpu" and VARIANT_REFUSED[case] in r.reason for r in rows), rows
    compare(compiler.run(artifact, module.example), expected)
    return artifact


@pytest.mark.parametrize(("label", "dtype"), _cases())
def test_op_lowers_and_matches_eager(label, dtype, request):
    module = _reading(label, SWEEP.one_op_program(label, dtype))
    if module is None:
        if not request.node.get_closest_marker("slow"):
            pytest.fail(f"eager takes none of {FIRST_DTYPES} for {label}: fix its inputs")
        pytest.skip(f"eager does not take {dtype} for {label}")
    artifact = _lowers_and_matches_eager(label, module)
    rows = _rows(artifact, label)
    if label in BASE_REWRITTEN:
        assert not rows and sorted({r.op for r in artifact.report.placement}) == BASE_REWRITTEN[label], rows
    elif label in BASE_ON_CPU:
        assert rows and all(r.where == "cpu" and BASE_ON_CPU[label] in r.reason for r in rows), rows
    elif dtype == FIRST_DTYPES[0]:  # the base case is the delegate's: one on the CPU checks nothing of XNNPACK
        assert rows and all(r.where == XNNPACK for r in rows), rows


def test_every_claimed_op_is_built_or_listed_with_a_reason():
    """The claimed ops (the partitioner's configs) are exactly the base cases' ops plus the
    listed ones (NOT_BUILDABLE with a reason, STATIC_QUANT built by its own test); none both."""
    labels = claimed()
    built = {case.values[0] for case in _cases()}
    listed = set(NOT_BUILDABLE) | set(STATIC_QUANT)
    assert built | listed == set(labels), sorted(set(labels) - built - listed)
    assert not built & listed, sorted(built & listed)
    assert all(isinstance(r, str) and r.strip() for r in NOT_BUILDABLE.values()), NOT_BUILDABLE  # each says why
    for table in (NOT_BUILDABLE, dict.fromkeys(STATIC_QUANT), INPUT_OVERRIDES, BASE_ON_CPU, BASE_REWRITTEN, OUTPUTS):
        assert set(table) <= set(labels), set(table) - set(labels)  # no stale entries
    assert len(labels) == len(_configs())  # every config's target is an op of its own


def test_static_quantization_per_tensor_stays_on_xnnpack_and_matches_eager():
    """A Linear statically quantized per tensor by XNNPACK's quantizer (dq -> linear -> q):
    the quantize/dequantize ops are XNNPACK's, and the numbers are the quantized module's
    within one output quantization step (and the float module's within a few)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval(), torch.randn(3, 16)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=False))
    prepared = prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
    for calibration in (*torch.randn(4, 3, 16), x):
        prepared(calibration)
    quantized = convert_pt2e(prepared)
    artifact = compiler.compile(quantized, (x,), "xnnpack")
    for label in STATIC_QUANT:
        rows = _rows(artifact, label)
        assert rows and all(r.where == XNNPACK for r in rows), (label, artifact.report.placement)
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    step = [n.args[1] for n in quantized.graph.nodes if n.target == quantize][-1]  # the output's scale
    (out,) = compiler.run(artifact, (x,))
    with torch.no_grad():
        torch.testing.assert_close(out, quantized(x), atol=step, rtol=0)
        torch.testing.assert_close(out, model(x), atol=4 * step, rtol=0)


def _configs() -> dict:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner().target_partitioner_configs


# --- variants: each non-tensor argument at another value ---------------------------------


@functools.cache
def _variants() -> tuple[list, list]:
    """(cases, skips): one case per non-tensor argument of every buildable op."""
    cases, skips = [], []
    for label in _buildable():
        dtype = FIRST_DTYPES[0]
        for argument in SWEEP.varied_arguments(label):
            changes, note = SWEEP.variant(label, argument, dtype)
            if changes is None:
                skips.append(pytest.param(label, argument.name, note, id=f"{label}-{argument.name}"))
                continue
            case_id = variant_id(label, changes)
            cases.append(pytest.param(label, dtype, changes, note, id=f"{case_id}-{dtype_id(dtype)}", marks=pytest.mark.slow))
            for more in MORE_DTYPES:
                cases.append(pytest.param(label, more, changes, note, id=f"{case_id}-{dtype_id(more)}", marks=pytest.mark.slow))
    return cases, skips


@pytest.mark.parametrize(("label", "dtype", "changes", "note"), _variants()[0])
def test_op_with_an_argument_off_its_default_matches_eager(label, dtype, changes, note):
    module = _reading(label, SWEEP.variant_program(label, dtype, changes))
    if module is None:
        pytest.skip(f"eager does not take {dtype} for {label} with {changes}")
    case_id = variant_id(label, changes)
    print(f"\nVARIANT {case_id} {note}", end="")
    _lowers_and_matches_eager(label, module, case_id)


def test_every_argument_without_another_value_says_why():
    """The arguments no variant is made for (not cases, so real skips stand out): each
    of a built op, with a reason."""
    built = set(_buildable())
    for skip in _variants()[1]:
        label, name, reason = skip.values
        assert label in built and name in {a.name for a in SWEEP.varied_arguments(label)}, (label, name)
        assert isinstance(reason, str) and reason.strip(), (label, name)


def test_every_listed_variant_is_a_case():
    ids = {variant_id(case.values[0], case.values[2]) for case in _variants()[0]}
    for table in (VARIANT_REFUSED, VARIANT_NAMED_ERROR):
        assert set(table) <= ids, set(table) - ids  # no stale entries
    for label, name in (*VARIANT_INPUTS, *VALUES):
        assert name in {a.name for a in SWEEP.varied_arguments(label)}, (label, name)


# --- not an argument: the input's rank ------------------------------------------------

# Ops XNNPACK lowers in NHWC (4-D inputs only) whose stock configs take other ranks:
# stock failed inside to_backend; rules.py sends them to the CPU.
OTHER_RANKS = {
    "aten.max_pool2d.default": lambda d: ((_t((2, 7, 7), d), [2, 2]), {}),  # unbatched
    "aten.avg_pool2d.default": lambda d: ((_t((2, 7, 7), d), [2, 2]), {}),  # unbatched
    "aten.prelu.default": lambda d: ((_t((2, 3, 5), d), _w((3,), d)), {}),  # over (N, C, L)
}


@pytest.mark.parametrize("label", sorted(OTHER_RANKS))
def test_nhwc_op_over_another_rank_runs_on_the_cpu(label):
    torch.manual_seed(0)
    module = OneOp(claimed()[label], *OTHER_RANKS[label](torch.float32)).eval()
    artifact = _lowers_and_matches_eager(label, module)
    assert all(row.where == "cpu" for row in _rows(artifact, label))
