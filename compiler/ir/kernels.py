"""Which operators the installed ExecuTorch runtime has CPU kernels for.

Asked of the runtime itself (its operator registry), never guessed from
whether an op has an out variant: `aten::matmul.out` exists as a schema, but
the pip runtime registers no kernel for it and a program using it fails at load.

The kernel an op needs is named the way `to_executorch` names it: an Edge op
becomes its out variant as `EdgeOpOverload.to_out_variant` finds it (the op's
own signature matched against its packet's overloads), symbolic-int helpers
become ExecuTorch's prim ops, asserts are removed, and the emitter writes
`namespace::name.overload` (no overload for `default`).

`executorch.exir.operator.convert.to_out_variant` is not used: it groups every
schema of an op name, TorchScript's scalar overloads included, and for `pow`
(`pow.int(int, int) -> float` next to `pow.int_to_int(int, int) -> int`) it
fails an assertion, which is how `pow.Tensor_Scalar` once got a guessed kernel.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any

import torch
from torchgen.model import SchemaKind

from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.dialects.edge.op.api import to_variant

from compiler.ir import kernel_fixes
from compiler.ir.private_api import (
    aten_overload,
    executorch_sym_ops,
    native_schema,
    python_sym_ops_to_executorch,
    registered_operator_names,
)

logger = logging.getLogger(__name__)

# Removed by `to_executorch` (RemoveGraphAssertsPass) before anything is emitted.
_REMOVED_BEFORE_EMIT = frozenset(
    [
        torch.ops.aten._assert_async.msg,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten._assert_tensor_metadata.default,
        torch.ops.aten.sym_constrain_range.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
    ]
)

# Symbolic-int helpers, called as they are (held as Backend ops; their torch ops too).
_SYM_OPS = frozenset(aten_overload(op) for op in executorch_sym_ops())

# Python's symbolic-int operators -> the prim op each is emitted as.
_PYTHON_SYM_OPS = python_sym_ops_to_executorch()

# Emitted specially (tuple access, delegate calls), never as a kernel call.
_NOT_KERNEL_CALLS = frozenset([operator.getitem, executorch_call_delegate])


@functools.lru_cache(maxsize=1)
def load_quantized_kernels() -> None:
    """Register ExecuTorch's quantized CPU kernels (quantize, dequantize, choose_qparams per
    tensor, channel and token; embedding_byte/2bit/4bit) in this process, for both sides: the
    runtime's registry (the wheel ships them as `lib/libexecutorch_kernels_quantized.so`,
    which registers into the `libexecutorch.so` the pybindings link, but nothing loads it)
    and torch's, whose `.out` variants `to_executorch` emits. Without them a PT2E program
    with a quantize op on the CPU fails to load: "Missing operator
    quantized_decomposed::dequantize_per_tensor.Tensor_out"."""
    import ctypes
    import pathlib

    import executorch
    import executorch.kernels.quantized  # noqa: F401  (the .out variants, for the emitter)

    library = pathlib.Path(list(executorch.__path__)[0]) / "lib" / "libexecutorch_kernels_quantized.so"
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=1)
def load_llm_kernels() -> None:
    """Register ExecuTorch's LLM custom ops (`llama::custom_sdpa`, `llama::update_cache`,
    `llama::sdpa_with_kv_cache`...) for both sides: importing the wheel's
    `extension.llm.custom_ops` loads `libcustom_ops_aot_lib.so`, which holds torch's
    implementations (eager, export) and the runtime's `.out` kernels, registered into the
    `libexecutorch.so` the pybindings and TextLLMRunner link. Nothing else loads it, so
    without this a program calling them fails to load: "Missing operator llama::custom_sdpa.out"."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401


@functools.lru_cache(maxsize=1)
def registered_kernels() -> frozenset[str]:
    """Names like `aten::add.out` that the runtime linked into this process registers."""
    load_quantized_kernels()
    load_llm_kernels()
    return frozenset(registered_operator_names())


def runtime_name(op: Any) -> str:
    """The name the emitter writes into the `.pte` for a call to `op` (and the runtime registers)."""
    op = aten_overload(op)
    overload = op._overloadname
    qualified = op._overloadpacket._qualified_op_name
    return qualified if overload == "default" else f"{qualified}.{overload}"


class _QuietSchemaWarnings(logging.Filter):
    """`to_variant` warns on the root logger for each TorchScript-only overload it cannot
    parse (`aten::pow.complex`...): those are never called, so the warnings are noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot be converted to torch.FunctionSchema" not in str(record.msg)


@functools.lru_cache(maxsize=None)
def out_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload a CPU call to `op` becomes in the `.pte`, or None if it has none.

    As `to_executorch` does it: out variants and in-place ops are called as they are,
    any other op through the out variant `EdgeOpOverload.to_out_variant` finds.
    """
    schema = native_schema(op._schema)
    if schema is None:
        return None  # TorchScript-only schemas (complex scalars, lists): no ExecuTorch kernel
    if schema.kind() in (SchemaKind.out, SchemaKind.inplace):
        return op
    quiet = _QuietSchemaWarnings()
    logging.getLogger().addFilter(quiet)
    try:
        return to_variant(op, SchemaKind.out)
    except RuntimeError as exc:
        logger.debug("no out variant for %s: %s", op, exc)
        return None
    finally:
        logging.getLogger().removeFilter(quiet)


def kernel_name(target: Any) -> str | None:
    """The runtime kernel a CPU call to `target` needs, or None if it needs none.

    Raises `LookupError` for an op that has no out variant: the emitter cannot call it.
    """
    if target in _PYTHON_SYM_OPS:
        return runtime_name(_PYTHON_SYM_OPS[target])
    if target in _REMOVED_BEFORE_EMIT or target in _NOT_KERNEL_CALLS:
        return None
    op = aten_overload(target)
    if not isinstance(op, torch._ops.OpOverload):
        return None  # higher-order ops (control flow) and plain Python callables
    if op in _SYM_OPS:
        return runtime_name(op)
    called = out_variant(op)
    if called is None:
        raise LookupError(f"{runtime_name(op)} has no out variant")
    return runtime_name(called)


def missing_kernel(target: Any) -> str | None:
    """What `target` needs on the CPU that the runtime lacks: a kernel name, or its
    missing out variant; None when the runtime can run it."""
    load_quantized_kernels()  # before any out variant is looked up (and cached)
    load_llm_kernels()
    try:
        name = kernel_name(target)
    except LookupError:
        return f"an out variant of {runtime_name(target)} (it has none)"
    if name is None or name in registered_kernels():
        return None
    return name


# Kernels of ExecuTorch 1.5.1's portable runtime that compute something other than
# torch for some inputs: op name -> (when, what goes wrong). A stage that leaves such
# a call on the CPU is refused by the `cpu_ops_have_kernels` invariant; the decompose
# stage rewrites these ops into ones whose kernels agree.
def _integer_result(node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not value.dtype.is_floating_point


def _half_input(node) -> bool:
    value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)


_FLOORS = (_integer_result, "integer remainder truncates (C's %) where torch floors", "integer_remainder")
_HALF = "accumulates in float16 or bfloat16 where torch's kernel accumulates in float32"

# Op name -> (when, what goes wrong, the fix switch in `kernel_fixes`).
WRONG_KERNELS: dict[str, tuple[Any, str, str]] = {
    "aten.remainder.Tensor": _FLOORS,
    "aten.remainder.Scalar": _FLOORS,
    # float16 rows of 2048: layer norm 0.96 of the largest output off, var 0.03 (bfloat16: 0.36, 0.38).
    "aten.native_layer_norm.default": (_half_input, _HALF, "half_precision_accumulation"),
    "aten.var.correction": (_half_input, _HALF, "half_precision_accumulation"),
    "aten.cumsum.default": (_half_input, _HALF, "half_precision_accumulation"),
}


def wrong_kernel(node) -> str | None:
    """Why the runtime's CPU kernel for `node` computes otherwise than torch, or None."""
    target = aten_overload(node.target)
    entry = WRONG_KERNELS.get(str(target)) if isinstance(target, torch._ops.OpOverload) else None
    if entry is None or not kernel_fixes.on(entry[2]):
        return None
    return entry[1] if entry[0](node) else None
