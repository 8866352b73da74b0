"""Which operators the installed ExecuTorch runtime has CPU kernels for.

Asked of the runtime itself (its operator registry), never guessed from
whether an op has an out variant: `aten::matmul.out` exists as a schema, but
the pip runtime registers no kernel for it and a program using it fails at load.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from executorch.exir.operator.convert import to_out_variant

from compiler.ir.dialect import op_dialect


@functools.lru_cache(maxsize=1)
def registered_kernels() -> frozenset[str]:
    """Names like `aten::add.out` that the runtime linked into this process registers."""
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    return frozenset(_get_operator_names())


def kernel_name(target: Any) -> str | None:
    """The runtime kernel a CPU call to `target` will need, or None if none is needed."""
    op = target._op if isinstance(target, EdgeOpOverload) else target
    if op_dialect(target) is None or not isinstance(op, torch._ops.OpOverload):
        return None  # tuple access, symbolic ints, higher-order ops: emitted specially
    schema = op._schema
    if any(arg.is_out for arg in schema.arguments) or not schema.returns:
        return f"{schema.name}.{schema.overload_name}"
    try:
        out_op, _ = to_out_variant(op)
    except Exception:  # no out variant at all: the emitter cannot call it either
        return f"{schema.name}.out"
    return f"{out_op._schema.name}.{out_op._schema.overload_name}"


def missing_kernel(target: Any) -> str | None:
    """The kernel name `target` needs on the CPU if the runtime lacks it."""
    name = kernel_name(target)
    if name is None or name in registered_kernels():
        return None
    # Ops without an out form (e.g. `aten::_local_scalar_dense`) register bare.
    if name.split(".")[0] in registered_kernels():
        return None
    return name
