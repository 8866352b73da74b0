"""One-op programs built from an op's ATen schema, for the backends' support-table sweeps.

A sweep (tests/backends/mlx/test_mlx_support_table.py, tests/backends/xnnpack/
test_xnnpack_support_table.py) takes every op a backend claims, builds a program of that
op alone whose inputs come from the op's schema (a backend's INPUT_OVERRIDES for the ops
whose arguments must agree with each other), compiles it for the backend and compares
with eager. Then it sets each non-tensor argument, one at a time, off its default (or
off the base case's value): a lowering that ignores an argument gives a wrong number
only there. This module holds what does not depend on the backend: the inputs, the
module, eager's answer, the comparison and the choice of the other argument values.
`OpSweep` ties them to one backend's claimed ops and tables.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from torch.utils import _pytree as pytree

from compiler.ir.dialect import op_name

SHAPE = (2, 3, 4)
TOLERANCE = {torch.float32: 1e-4, torch.complex64: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}

Overrides = dict[str, Callable[[torch.dtype], tuple[tuple, dict]]]


def rand(dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    count = math.prod(shape)  # distinct integers: ties would let sort, topk, argmax pick either
    return (torch.randperm(count) - count // 2).reshape(shape).to(dtype)


def positive(dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    return (torch.rand(shape) * 3 + 0.1).to(dtype)


def unit(dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    return (torch.rand(shape) * 1.8 - 0.9).to(dtype)


def at_least_one(dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    return (torch.rand(shape) * 3 + 1.0).to(dtype)


# The input domain where an op is defined (elsewhere eager gives nan and compares nothing).
DOMAINS: dict[str, Callable[..., torch.Tensor]] = {
    **dict.fromkeys(["log", "log2", "log10", "sqrt", "rsqrt", "log1p", "reciprocal"], positive),
    **dict.fromkeys(["asin", "acos", "atanh"], unit),
    "acosh": at_least_one,
}


def idx(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def tensor(shape, dtype):
    return rand(dtype, shape)


def weight(shape, dtype):
    """A weight: a parameter of the program (as in a model), not an input."""
    return torch.nn.Parameter(rand(dtype, shape), requires_grad=False)


def op_label(target: Any) -> str:
    if isinstance(target, str):
        return target
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    return op_name(target)


def aten(target: Any) -> Any:
    return target._op if isinstance(target, EdgeOpOverload) else target


# --- inputs from the schema ------------------------------------------------------------

_DIMS = {"dim": 1, "dim0": 0, "dim1": 2, "index": 1, "start": 1, "length": 2, "split_size": 2, "k": 2, "repeats": 2}


def _scalar(dtype: torch.dtype) -> float | int:
    return 0.5 if dtype.is_floating_point else 2


def _tensor_for(label: str, dtype: torch.dtype) -> torch.Tensor:
    domain = DOMAINS.get(label.split(".")[1])
    return domain(dtype) if domain else rand(dtype)


def _argument(label: str, argument, dtype: torch.dtype) -> Any:
    """A value for one required schema argument, or KeyError when the schema says too little."""
    kind, name = str(argument.type), argument.name
    if kind == "Tensor":
        return rand(torch.bool) if name == "condition" else _tensor_for(label, dtype)
    if kind == "List[Tensor]":
        return [_tensor_for(label, dtype), _tensor_for(label, dtype)]
    if kind == "int" and name in _DIMS:
        return _DIMS[name]
    if kind in ("List[int]", "Optional[List[int]]") and name in ("dim", "dims"):
        return [1]
    if kind == "number":
        return _scalar(dtype)
    raise KeyError(f"{kind} {name}")


def schema_inputs(label: str, op: torch._ops.OpOverload, dtype: torch.dtype, overrides: Overrides) -> tuple[tuple, dict]:
    """Arguments for `op` from its schema: every argument without a default gets a value."""
    if label in overrides:
        return overrides[label](dtype)
    args, kwargs = [], {}
    for argument in op._schema.arguments:
        if argument.has_default_value():
            continue
        value = _argument(label, argument, dtype)
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


class OneOp(torch.nn.Module):
    """forward(*tensors) = op(args) with the tensors, and the weights, put back where they were."""

    def __init__(self, op, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.op = op
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        is_weight = [isinstance(leaf, torch.nn.Parameter) for leaf in leaves]
        self.weights = torch.nn.ParameterList(leaf for leaf, w in zip(leaves, is_weight) if w)
        self.weight_positions = [i for i, w in enumerate(is_weight) if w]
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and not is_weight[i]]
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.example = tuple(leaves[i] for i in self.positions)

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        for position, weight in zip(self.weight_positions, self.weights):
            leaves[position] = weight
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(*args, **kwargs)


def eager(module: OneOp) -> list[torch.Tensor] | None:
    """The op's eager outputs, or None when eager does not take these inputs."""
    try:
        with torch.no_grad():
            out = module(*module.example)
    except Exception:  # noqa: BLE001  any refusal by eager means these inputs are not the op's
        return None
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def compare(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected, strict=True):
        assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, out.dtype, want.shape, want.dtype)
        tolerance = TOLERANCE.get(want.dtype, 0.0)  # an int input can give a float output (exp, cos, ...)
        torch.testing.assert_close(out, want, atol=tolerance, rtol=tolerance, equal_nan=True)


def same(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(left, right, strict=True)
    )


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


# --- variants: each non-tensor argument with a default, at another value ----------------
#
# A base case passes non-tensor arguments at their defaults, so a lowering that ignores
# one passes it. A variant sets one such argument to a value other than the base case's,
# chosen by its schema type and name: the first candidate eager takes whose output
# differs from the base case's (else the first eager takes, noted "same output").

# Arguments with one meaning on this CPU, whatever value they are given: the reason.
NO_OTHER_VALUE = {
    "layout": "torch.strided is the only layout these ops take",
    "device": "the CPU is the only device here",
    "pin_memory": "pinning needs an accelerator",
}
# Arguments that change nothing unless another one is set too: what is set with them.
COMPANIONS = {
    "count_include_pad": lambda n: {"padding": [1] * n},  # counts padding only where there is some
    "output_padding": lambda n: {"stride": [2] * n},  # must be smaller than the stride
}


def is_tensor_type(kind: str) -> bool:
    return "Tensor" in kind


def bound(op, args: tuple, kwargs: dict) -> dict[str, Any]:
    """name -> the value the call passes (its default when it passes none)."""
    values = {}
    for position, argument in enumerate(op._schema.arguments):
        if not argument.kwarg_only and position < len(args):
            values[argument.name] = args[position]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def changed(op, args: tuple, kwargs: dict, changes: dict[str, Any]) -> tuple[tuple, dict]:
    """The call with `changes` made: in place where passed by position, else by keyword."""
    args, kwargs = list(args), dict(kwargs)
    positions = {a.name: i for i, a in enumerate(op._schema.arguments) if not a.kwarg_only}
    for name, value in changes.items():
        if positions.get(name, len(args)) < len(args):
            args[positions[name]] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def spatial(values: dict[str, Any]) -> int:
    """How many spatial dimensions a pool or convolution call has (entries of its stride, padding, ...)."""
    return len(values.get("kernel_size") or values.get("stride") or [])


def _dtype_candidates(dtype: torch.dtype) -> list[torch.dtype]:
    return [d for d in (torch.float16, torch.float32, torch.int32) if d != dtype]


def candidates(argument, values: dict[str, Any], dtype: torch.dtype) -> list:
    """Values for a non-tensor argument, by schema type and name, most telling first."""
    kind, name = str(argument.type), argument.name
    if kind.startswith("Optional["):
        kind = kind[len("Optional[") : -1]
    n = spatial(values)
    by_name = {
        "dtype": _dtype_candidates(dtype),
        "memory_format": [torch.channels_last, torch.contiguous_format],
        "dim_order": [[0, 2, 3, 1], [0, 1, 2]],
        "dim": [1, 0, -1, -2] if kind == "int" else [[1], [0], [-1]],
        "dim0": [1, 0, -1, -2],
        "dim1": [1, 0, -1, -2],
        "dims": [[1], [0], [-1], [0, 2, 1]],
        "index": [-1, 0],
        "rounding_mode": ["trunc", None],
        "shifts": [[-1]],
        "pad": [[1, 0, 0, 1]],
        "scale_factors": [[2.2, 1.7]],  # an output twice the input (torch ignores that scale), and not
        "kernel_size": [[3] * n],
        "diagonal": [1, -1],
        "start": [1, -2],
        "end": [-1, 3],
        "correction": [0, 2],
        "eps": [0.1],
        "scales_h": [3.0],
        "scales_w": [3.0],
        "stride": [[1] * n, [2] * n],
        "padding": [[1] * n, [0] * n],
        "dilation": [[2] * n],
        "output_padding": [[1] * n],
        "approximate": ["tanh"],
        "divisor_override": [3],
    }
    if name in by_name:
        return by_name[name]
    if kind == "bool":  # the other value than the base case's, which may be off the default already
        return [not values.get(name, argument.default_value)]
    if kind == "int":
        return [2, 1]
    if kind in ("number", "float"):
        return [0.5, 2, -0.5] if dtype.is_floating_point else [2, -1, 0.5]
    return []


def variant_id(label: str, changes: dict[str, Any]) -> str:
    def shown(value):
        return str(value).removeprefix("torch.").replace(" ", "")

    return label + "-" + "+".join(f"{name}={shown(value)}" for name, value in changes.items())


@attrs.frozen
class OpSweep:
    """One backend's sweep: its claimed ops and the tables that shape their programs.

    claimed: () -> label -> the op target (an ATen or Edge op overload).
    overrides: label -> (dtype) -> (args, kwargs), for ops whose arguments must agree.
    variant_inputs: (label, argument) -> (dtype) -> (args, kwargs): the inputs under which
        that argument can take another value.
    values: (label, argument) -> the one other value to try (only the op's other arguments decide it).
    """

    claimed: Callable[[], dict[str, Any]]
    overrides: Overrides
    variant_inputs: dict[tuple[str, str], Callable[[torch.dtype], tuple[tuple, dict]]]
    values: dict[tuple[str, str], Any]
    first_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.int32, torch.bool)

    def one_op_program(self, label: str, dtype: torch.dtype) -> OneOp | None:
        """The one-op module for `label` over `dtype`, or None when eager does not take that dtype."""
        op = self.claimed()[label]  # an Edge op (dim_order_ops) runs eagerly and exports as itself
        torch.manual_seed(0)
        args, kwargs = schema_inputs(label, op, dtype, self.overrides)
        module = OneOp(op, args, kwargs).eval()
        return module if eager(module) is not None else None

    def first_dtype(self, label: str) -> torch.dtype:
        """The first of `first_dtypes` eager takes for `label` (an op's default dtype)."""
        for dtype in self.first_dtypes:
            try:
                if self.one_op_program(label, dtype) is not None:
                    return dtype
            except KeyError:
                break  # the schema says too little: the test shows which argument
        return self.first_dtypes[0]

    def base_call(self, label: str, name: str, dtype: torch.dtype) -> tuple[tuple, dict]:
        op = self.claimed()[label]
        torch.manual_seed(0)
        if (label, name) in self.variant_inputs:
            return self.variant_inputs[(label, name)](dtype)
        return schema_inputs(label, op, dtype, self.overrides)

    def variant_program(self, label: str, dtype: torch.dtype, changes: dict[str, Any]) -> OneOp | None:
        """The one-op module for `label` over `dtype` with `changes` made, or None when eager refuses it."""
        op = self.claimed()[label]
        args, kwargs = self.base_call(label, next(iter(changes)), dtype)
        module = OneOp(op, *changed(op, args, kwargs, changes)).eval()
        return module if eager(module) is not None else None

    def variant(self, label: str, argument, dtype: torch.dtype) -> tuple[dict[str, Any] | None, str]:
        """(changes, note) for one argument: the arguments to set, or None and why there are none."""
        if argument.name in NO_OTHER_VALUE:
            return None, NO_OTHER_VALUE[argument.name]
        op = self.claimed()[label]
        args, kwargs = self.base_call(label, argument.name, dtype)
        values = bound(op, args, kwargs)
        base = eager(OneOp(op, args, kwargs))
        if (label, argument.name) in self.values:
            tried = [self.values[(label, argument.name)]]
        else:
            tried = candidates(argument, values, dtype)
        n = spatial(values)
        taken = None
        for value in tried:
            if value == values.get(argument.name):
                continue
            changes = {argument.name: value, **COMPANIONS.get(argument.name, lambda _: {})(n)}
            module = self.variant_program(label, dtype, changes)
            if module is None:
                continue
            if base is None or not same(eager(module), base):
                return changes, ""
            taken = taken or changes
        if taken:
            return taken, "same output"
        if not tried:
            return None, f"no value to try for a {argument.type} named {argument.name} (a shape: another program)"
        return None, f"eager takes none of {tried} for {argument.name}"

    def varied_arguments(self, label: str) -> list:
        """Every non-tensor argument: those with a default, and the required ones the base case sets."""
        op = self.claimed()[label]
        return [a for a in op._schema.arguments if not is_tensor_type(str(a.type))]
