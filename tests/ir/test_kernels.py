"""The kernel check accepts every op the installed runtime has a kernel for, and only those."""

import operator

import pytest
import torch

import executorch.exir.passes._device_copy_ops_registry  # noqa: F401  (loads et_copy ops)
import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  (loads dim_order_ops)
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.passes.executorch_prim_ops_registry import _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS

import compiler
from compiler.ir.kernels import kernel_name, missing_kernel, registered_kernels

aten = torch.ops.aten

# Tensor options a functional factory takes and its out variant does not (the out
# tensor carries them).
_TENSOR_OPTIONS = {"dtype", "layout", "device", "pin_memory"}


def _split(name):
    """`ns::op.overload` -> (ns, op, overload); the runtime drops `default`."""
    qualified, _, overload = name.partition(".")
    namespace, op = qualified.split("::")
    return namespace, op, overload or "default"


def _is_out(op):
    return any(arg.is_out for arg in op._schema.arguments)


def _call_signature(op):
    """What a caller passes: arguments by name and type, without out tensors or tensor options."""
    return [
        (arg.name, str(arg.type))
        for arg in op._schema.arguments
        if not arg.is_out and arg.name not in _TENSOR_OPTIONS
    ]


def _functional_ops(packet, kernel_op):
    """The overloads of `packet` whose out variant is `kernel_op`: same call, no out tensor."""
    overloads = [getattr(packet, name) for name in packet.overloads()]
    same_call = [
        op
        for op in overloads
        if not _is_out(op) and op._schema.returns and _call_signature(op) == _call_signature(kernel_op)
    ]
    # Two overloads with one call (quantized_decomposed's embedding_2bit and embedding_2bit.dtype):
    # each has its own out variant, named after it (`out`, `dtype_out`).
    named = kernel_op._overloadname.removesuffix("out").removesuffix("_") or "default"
    return [op for op in same_call if op._overloadname == named] or same_call


def _edge(op):
    packet = getattr(getattr(exir_ops.edge, op.namespace), op._schema.name.split("::")[1])
    return getattr(packet, op._overloadname)


def _registered_ops():
    """(runtime name, op) for each kernel; op is None for those only the emitter writes."""
    for name in sorted(registered_kernels()):
        namespace, op_name, overload = _split(name)
        packet = getattr(getattr(torch.ops, namespace), op_name, None)
        yield name, getattr(packet, overload, None) if packet is not None else None


def test_pow_tensor_scalar_needs_its_registered_out_variant():
    # Regression: the lookup raised for pow (TorchScript's pow.int and pow.int_to_int
    # collide in ExecuTorch's to_out_variant) and a fallback guessed `aten::pow.out`.
    for target in (aten.pow.Tensor_Scalar, exir_ops.edge.aten.pow.Tensor_Scalar):
        assert kernel_name(target) == "aten::pow.Tensor_Scalar_out"
        assert missing_kernel(target) is None


class Square(torch.nn.Module):
    def forward(self, x):
        return x**2.0 + x.pow(3)


def test_pow_runs_on_the_portable_backend():
    x = torch.randn(3, 4)
    artifact = compiler.compile(Square(), (x,), backend="portable", reproducer=False)
    assert "aten::pow.Tensor_Scalar_out" in artifact.program.operators
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, Square()(x))


def test_matmul_is_still_refused():
    for target in (aten.matmul.default, exir_ops.edge.aten.matmul.default):
        assert kernel_name(target) == "aten::matmul.out"
        assert missing_kernel(target) == "aten::matmul.out"


def test_op_without_out_variant_is_refused_by_name():
    refused = missing_kernel(exir_ops.edge.aten.scaled_dot_product_attention.default)
    assert refused == "an out variant of aten::scaled_dot_product_attention (it has none)"
    with pytest.raises(LookupError, match="has no out variant"):
        kernel_name(aten.scaled_dot_product_attention.default)


def test_every_registered_out_kernel_accepts_its_functional_ops():
    checked, unmatched = 0, []
    for name, kernel_op in _registered_ops():
        if kernel_op is None or not _is_out(kernel_op):
            continue
        packet = getattr(getattr(torch.ops, kernel_op.namespace), kernel_op._schema.name.split("::")[1])
        functional = _functional_ops(packet, kernel_op)
        if not functional:
            unmatched.append(name)
        for op in functional:
            for target in (op, _edge(op)):
                assert kernel_name(target) == name, target
                assert missing_kernel(target) is None, target
                checked += 1
        assert missing_kernel(kernel_op) is None  # an out variant is called as it is
    assert unmatched == []
    assert checked > 2 * 180


def test_every_registered_kernel_called_as_it_is_is_accepted():
    """In-place ops (`copy_`, `index_put_`), symbolic-int helpers and ExecuTorch's prim ops."""
    for name, kernel_op in _registered_ops():
        if kernel_op is not None and not _is_out(kernel_op):
            assert kernel_name(kernel_op) == name
            assert missing_kernel(kernel_op) is None
    for python_op, prim in _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS.items():
        assert prim is not None and missing_kernel(python_op) is None and missing_kernel(prim) is None


def test_kernels_without_a_python_op_are_the_emitters_own():
    """Only ExecuTorch's prim ops the emitter writes itself (views, loop outputs) have no op to call."""
    emitter_only = sorted(name for name, op in _registered_ops() if op is None)
    assert emitter_only and all(name.startswith("executorch_prim::") for name in emitter_only)


def test_kernels_that_are_not_registered_are_refused():
    assert missing_kernel(aten.sym_stride.int) == "aten::sym_stride.int"
    assert missing_kernel(aten.add_.Tensor) == "aten::add_.Tensor"  # in place: called as it is
    for target in (operator.getitem, aten._assert_scalar.default):
        assert missing_kernel(target) is None  # not kernel calls
