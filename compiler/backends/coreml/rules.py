"""Every reason the Core ML backend leaves an op on the CPU, one small predicate each.

Two kinds of rule:

- node rules look at one node (its op, arguments, dtypes and ranks) and hold
  wherever the node ends up;
- partition rules look at a node inside a proposed Core ML partition (what it
  reads from outside, who uses its result) and are asked again after every
  search, until no partition breaks one.

A rule returns None when it does not apply, or the one-line reason the node
runs on the CPU. Node rules are registered in `NODE_RULES` with a summary
(docs/refusal-rules.md lists them) and the upstream coremltools / ExecuTorch issue
they work around where there is one, so a rule can be dropped when that is fixed.
Rules take ATen and Edge spellings alike (the keep-whole filter asks them on ATen nodes).
"""

from __future__ import annotations

import operator
from typing import Collection, Optional

import attrs
import coremltools as ct
import torch
from coremltools.converters.mil.frontend.torch.utils import TORCH_DTYPE_TO_NUM
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from compiler.backends.coreml import fixes
from compiler.backends.node_rules import RuleBook, first_refusal
from compiler.ir import dynamic
from compiler.ir.dialect import op_name
from compiler.ir.private_api import (
    aten_overload,
    coreml_is_arg_min_max_over_flattened_input,
    coreml_unsupported_op_targets,
)

# Dtypes Core ML cannot take as model inputs or give as outputs (stock: `KeyError: torch.uint8`).
REFUSED_DTYPES = frozenset({torch.uint8, torch.int8, torch.bfloat16})
CORE_ML_MAX_RANK = 5


@attrs.frozen
class RuleContext:
    """What node rules may depend on besides the node: the user's options."""

    minimum_deployment_target: Optional[ct.target] = None
    # Normalised op names (see `normalise_op_name`) the user asked to keep off Core ML.
    skipped_ops: frozenset[str] = frozenset()

    @property
    def ios16(self) -> bool:
        target = self.minimum_deployment_target
        return target is not None and target >= ct.target.iOS16

    @property
    def ios18(self) -> bool:
        target = self.minimum_deployment_target
        return target is not None and target >= ct.target.iOS18


NODE_RULES = RuleBook("Core ML", __name__)


def refusal(node: torch.fx.Node, ctx: RuleContext) -> Optional[str]:
    """The first node rule that refuses `node`, as its reason; None if none does. A tuple access
    is not judged: it goes where the op it reads goes."""
    if node.target is operator.getitem:
        return None
    return first_refusal(node, NODE_RULES, ctx)


# --- small helpers ------------------------------------------------------------------


def aten_op(target) -> object:
    """The ATen overload behind an ATen or Edge target (other targets unchanged)."""
    return aten_overload(target)


def _is(node: torch.fx.Node, *packets) -> bool:
    op = aten_op(node.target)
    return isinstance(op, torch._ops.OpOverload) and op.overloadpacket in packets


def tensor_values(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces (several for split/topk/...)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return [val] if isinstance(val, torch.Tensor) else []


def tensor_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    return {v.dtype for v in tensor_values(node)}


def normalise_op_name(name: str) -> str:
    """`aten::add.Tensor`, `aten.add.Tensor`, `torch.ops.aten.add.Tensor` -> `aten.add.tensor`."""
    name = name.strip().lower().replace("::", ".")
    for prefix in ("torch.ops.", "exir_ops.", "edge."):
        name = name.removeprefix(prefix)
    return name


def op_spellings(target) -> set[str]:
    """The names a user may give for `target` in skip_ops_for_coreml_delegation."""
    name = normalise_op_name(op_name(target))
    names = {name, normalise_op_name(getattr(target, "__name__", name))}
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    names.add(packet)  # `aten.add` skips every overload
    return names


# --- node rules, in the order they are asked ----------------------------------------


@NODE_RULES.refuses("an op the user listed in `skip_ops_for_coreml_delegation`")
def skipped_by_user(node, ctx) -> Optional[str]:
    if ctx.skipped_ops and op_spellings(node.target) & ctx.skipped_ops:
        return (
            f"you asked to keep {op_name(node.target)} off Core ML (skip_ops_for_coreml_delegation); "
            "remove it from that option to delegate it"
        )
    return None


@NODE_RULES.refuses("an op coremltools 9.0 has no converter for")
def no_coremltools_converter(node, ctx) -> Optional[str]:
    try:
        supported = ct.converters.mil.frontend.torch.is_torch_fx_node_supported(node)
    except AssertionError:  # coremltools asserts on in-place ops instead of answering
        supported = False
    if not supported:
        return f"Core ML cannot convert {op_name(node.target)}: coremltools 9.0 has no converter for it"
    return None


@NODE_RULES.refuses("an antialiased resize: coremltools converts it as a plain one (antialias ignored)")
def antialiased_resize(node, ctx) -> Optional[str]:
    """Capture writes these as matrix products; one that still reaches Core ML (a stage file from
    before) stays on the CPU rather than computing another resize."""
    if _is(node, torch.ops.aten._upsample_bilinear2d_aa, torch.ops.aten._upsample_bicubic2d_aa):
        return (
            f"coremltools converts {op_name(node.target)} as a resize without antialias (0.2 off eager on a "
            "camera frame); capture writes it as matrix products, so compile from the model again"
        )
    return None


@NODE_RULES.refuses(
    "`add` or `sub` with `alpha` other than 1: coremltools converts it wrongly",
    issue="https://github.com/apple/coremltools/issues/2573",
)
def add_sub_with_alpha(node, ctx) -> Optional[str]:
    if _is(node, torch.ops.aten.add, torch.ops.aten.sub) and node.kwargs.get("alpha", 1) != 1:
        return (
            f"coremltools converts {op_name(node.target)} with alpha != 1 wrongly; multiply the "
            "second operand by alpha in the model instead to delegate it"
        )
    return None


@NODE_RULES.refuses(
    "an op ExecuTorch's Core ML partitioner refuses: its conversion is wrong or missing",
    issue="https://github.com/apple/coremltools/issues/2565, /2569, pytorch/executorch#11722",
)
def refused_by_executorch(node, ctx) -> Optional[str]:
    if aten_op(node.target) in coreml_unsupported_op_targets():
        return (
            f"Core ML cannot run {op_name(node.target)} correctly: ExecuTorch's Core ML partitioner "
            "refuses it (its conversion is wrong or missing)"
        )
    return None


@NODE_RULES.refuses(
    "`argmax` or `argmin` over the whole tensor (`dim=None`): Core ML crashes at run time",
    issue="https://github.com/pytorch/executorch/issues/11715",
)
def arg_reduction_over_flattened_input(node, ctx) -> Optional[str]:
    if coreml_is_arg_min_max_over_flattened_input(node) or (
        _is(node, torch.ops.aten.argmax, torch.ops.aten.argmin)
        and (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")) is None
    ):
        return f"{op_name(node.target)} over the whole tensor (dim=None) crashes Core ML at run time"
    return None


_MIN_MAX = (
    torch.ops.aten.amax,
    torch.ops.aten.amin,
    torch.ops.aten.max,
    torch.ops.aten.min,
    torch.ops.aten.maximum,
    torch.ops.aten.minimum,
)


@NODE_RULES.refuses("a max or min over bool tensors: Core ML's reductions take no bools")
def min_max_over_bool(node, ctx) -> Optional[str]:
    if _is(node, *_MIN_MAX) and any(
        torch.bool in tensor_dtypes(arg) for arg in node.all_input_nodes
    ):
        return (
            f"Core ML's max and min ops take no bool tensors, and this {op_name(node.target)} runs over bool; "
            "cast the input to int32 in the model to delegate it (stock: ValueError from reduce_max)"
        )
    return None


@NODE_RULES.refuses("`bitwise_and` of integers: coremltools converts it of bools only")
def bitwise_and_of_non_bool(node, ctx) -> Optional[str]:
    if _is(node, torch.ops.aten.bitwise_and) and tensor_dtypes(node) - {torch.bool}:
        return (
            "coremltools converts bitwise_and only of bool tensors, and this one is of integers "
            "(stock: NotImplementedError: 'The `bitwise_and` op only supports boolean input')"
        )
    return None


@NODE_RULES.refuses("`log1p`: coremltools computes log(x + 1), which loses its precision near 0")
def log1p_as_log_of_x_plus_one(node, ctx) -> Optional[str]:
    # log_sigmoid decomposes to min(x, 0) - log1p(exp(-|x|)), so this keeps it off too.
    if _is(node, torch.ops.aten.log1p):
        return (
            f"coremltools converts {op_name(node.target)} to Core ML's log with epsilon 1, log(x + 1), which "
            "loses log1p's precision near 0 (x = 1e-4 in float16 gives 0); the payload check refuses it"
        )
    return None


@NODE_RULES.refuses("an op given a dtype coremltools cannot name (bfloat16)")
def dtype_coremltools_cannot_name(node, ctx) -> Optional[str]:
    for value in (*node.args, *node.kwargs.values()):
        if isinstance(value, torch.dtype) and value not in TORCH_DTYPE_TO_NUM:
            name = str(value).removeprefix("torch.")
            return (
                f"Core ML cannot convert it: it takes the dtype {name} as an argument, which coremltools "
                f"cannot name (stock: KeyError: torch.{name})"
            )
    return None


# The fills coremltools converts to Core ML's fill with the shape as given, not cast to int32
# (`full`, `new_full` cast it; `zeros` folds to a constant, the `*_like` fills read a tensor's
# shape): the empty shape of a 0-d result is a float constant. Refused, they are not kept whole
# and decompose to a `full`, which Core ML takes.
_FILLS_OF_UNCAST_SHAPE = (torch.ops.aten.ones, torch.ops.aten.new_zeros)


@NODE_RULES.refuses("`ones` or `new_zeros` of a 0-d result: coremltools gives Core ML's fill a float shape")
def zero_dim_fill(node, ctx) -> Optional[str]:
    value = node.meta.get("val")
    if _is(node, *_FILLS_OF_UNCAST_SHAPE) and isinstance(value, torch.Tensor) and value.dim() == 0:
        return (
            f"Core ML cannot make a 0-d tensor with {op_name(node.target)}: coremltools gives Core ML's "
            "fill an empty float shape (stock: 'expects tensor or scalar of dtype from type domain [int32]')"
        )
    return None


# Ops coremltools converts to MIL ops whose data takes fp16, fp32 or int32 only (not `index`:
# its gathers cast bool data to a number and back).
_NO_BOOL_DATA = (
    torch.ops.aten.slice_scatter, torch.ops.aten.select_scatter,  # torch_tensor_assign
    torch.ops.aten.index_select, torch.ops.aten.gather,  # gather, gather_along_axis
    torch.ops.aten.pad, torch.ops.aten.constant_pad_nd,  # pad: a bool comes out float64, which no op takes
)


@NODE_RULES.refuses("a slice or select scatter, gather, `index_select` or pad of bool data: Core ML's ops take numbers")
def bool_data_core_ml_refuses(node, ctx) -> Optional[str]:
    data = node.args[0] if node.args else None
    if _is(node, *_NO_BOOL_DATA) and isinstance(data, torch.fx.Node) and torch.bool in tensor_dtypes(data):
        return (
            f"Core ML cannot convert {op_name(node.target)} of bool data: the Core ML op it becomes takes "
            "fp16, fp32 or int32 only (stock: 'expects tensor or scalar of dtype from type domain')"
        )
    return None


# Pools coremltools converts to a Core ML pool that gives the values only, not the indices.
_POOLS_WITH_INDICES = (
    torch.ops.aten.max_pool1d_with_indices, torch.ops.aten.max_pool2d_with_indices,
    torch.ops.aten.max_pool3d_with_indices, torch.ops.aten.adaptive_max_pool1d,
    torch.ops.aten.adaptive_max_pool2d,
)


@NODE_RULES.refuses("a max pool whose indices are used: Core ML's pool gives the values only")
def pool_indices_used(node, ctx) -> Optional[str]:
    if not _is(node, *_POOLS_WITH_INDICES):
        return None
    if any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users):
        return (
            f"Core ML cannot give the indices of {op_name(node.target)}, whose indices are used: coremltools "
            "converts it to a pool that gives the values only (stock: 'coremltools lowering does not "
            "handle/bind value at index 1')"
        )
    return None


_BATCH_NORMS = (
    torch.ops.aten.native_batch_norm, torch.ops.aten._native_batch_norm_legit,
    torch.ops.aten._native_batch_norm_legit_no_training, torch.ops.aten._native_batch_norm_legit_functional,
)


@NODE_RULES.refuses("a batch norm whose saved mean or inverse std is used: Core ML's gives the normalized values only")
def batch_norm_statistics_used(node, ctx) -> Optional[str]:
    if not _is(node, *_BATCH_NORMS):
        return None
    if any(user.target is operator.getitem and user.args[1] >= 1 and user.users for user in node.users):
        return (
            f"Core ML cannot give the saved mean or inverse std of {op_name(node.target)}, which are used: "
            "coremltools converts it to a batch norm that gives the normalized values only (stock: "
            "'coremltools lowering does not handle/bind value at index 1')"
        )
    return None


_CEIL_MODE_POOLS = {  # pool -> position of ceil_mode among its arguments
    **{getattr(torch.ops.aten, f"max_pool{n}d{s}"): 5 for n in (1, 2, 3) for s in ("", "_with_indices")},
    **{getattr(torch.ops.aten, f"avg_pool{n}d"): 4 for n in (1, 2, 3)},
}


def _ints(value, n: int) -> list[int]:
    value = [value] if isinstance(value, int) else list(value)
    return value * n if len(value) == 1 else value


def _pool_drops_unpadded_last_window(node: torch.fx.Node) -> bool:
    """Whether torch drops a ceil-mode pool's last window (it would start past the input)
    on an axis without padding; Core ML drops it only on a padded axis."""
    op = aten_op(node.target).overloadpacket
    x, out = (node.args[0].meta.get("val") if node.args else None), node.meta.get("val")
    if isinstance(out, (list, tuple)):
        out = out[0]
    index = _CEIL_MODE_POOLS[op]
    ceil_mode = node.args[index] if len(node.args) > index else node.kwargs.get("ceil_mode", False)
    if not ceil_mode or not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    n = int(op.__name__.split("_pool")[1][0])  # spatial dims
    kernel = _ints(node.args[1], n)
    stride = _ints(node.args[2] if len(node.args) > 2 and node.args[2] else kernel, n)
    padding = _ints(node.args[3] if len(node.args) > 3 else 0, n)
    dilation = _ints(node.args[4] if len(node.args) > 4 and "max" in op.__name__ else 1, n)
    for size, got, k, st, p, d in zip(x.shape[-n:], out.shape[-n:], kernel, stride, padding, dilation):
        every_window = -(-(size + 2 * p - d * (k - 1) - 1) // st) + 1  # ceil, none dropped
        if p == 0 and got != every_window:
            return True
    return False


@NODE_RULES.refuses("a `ceil_mode` pool whose last window starts past an unpadded input: Core ML keeps it")
def ceil_mode_pool_past_the_input(node, ctx) -> Optional[str]:
    if _is(node, *_CEIL_MODE_POOLS) and _pool_drops_unpadded_last_window(node):
        return (
            f"Core ML would give {op_name(node.target)} with ceil_mode a larger output than torch: its last "
            "window would start past the input on an unpadded axis, which torch drops and Core ML keeps"
        )
    return None


@NODE_RULES.refuses("`pixel_unshuffle` below iOS 16")
def pixel_unshuffle_before_ios16(node, ctx) -> Optional[str]:
    # Refused, it is not kept whole either: its decomposition (views, a permute) is delegated.
    if _is(node, torch.ops.aten.pixel_unshuffle) and not ctx.ios16:
        return (
            f"Core ML has no {op_name(node.target)} below iOS 16; set minimum_deployment_target=iOS16 to "
            "delegate it (stock: 'No available version for pixel_unshuffle in the coremltools.target.iOS15 opset')"
        )
    return None


# How stock 1.5.1 fails on each index_put form; a form without a text builds on stock, but
# coremltools converts it wrongly.
_STOCK_BOOL_NEXT_TO_SLICE = "the named input `y` must have the same data type as the named input `x`"
_STOCK_BROADCAST = "Component tensor ... has shape ..., others have ..."
_STOCK_SEVERAL_ENTRIES = "Input squeeze_0 has rank 1 != other inputs rank 0"
_STOCK_ZERO_D = "AttributeError: type object 'int' has no attribute 'get_primitive'"
_STOCK_VALUES_VARY = "The updates tensor should have shape [...]"


def _index_put_problem(node: torch.fx.Node, ctx: RuleContext) -> Optional[tuple[str, Optional[str]]]:
    """Which index_put form coremltools converts wrongly or not at all, and stock's failure text."""
    self_arg, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate:
        return "accumulate=True", None
    given = [(i, idx) for i, idx in enumerate(indices) if idx is not None]
    has_slice = len(given) < len(indices)
    metas = [idx.meta.get("val") for _, idx in given]
    if any(m is None for m in metas):
        return "index tensors of unknown shape", None
    if any(m.dtype == torch.bool for m in metas):
        if len(given) > 1 or has_slice:
            return "a bool index next to a slice or another index", _STOCK_BOOL_NEXT_TO_SLICE
        if not ctx.ios18:
            return "a bool mask index below iOS 18 (set minimum_deployment_target=iOS18 to delegate it)", None
        return None
    if len({tuple(map(str, m.shape)) for m in metas}) > 1:  # str: a dynamic size is an unhashable SymInt
        return "index tensors that broadcast against each other", _STOCK_BROADCAST
    # One 1-D index of several entries beside slices converts (`conversion._index_put_at_one_axis`).
    if has_slice and not all(statically_known_true(m.numel() <= 1) for m in metas):
        if len(given) > 1:
            return "several indices of more than one entry next to a slice", _STOCK_SEVERAL_ENTRIES
        if metas[0].dim() > 1:
            rank = metas[0].dim()
            return f"an index of rank {rank} next to a slice", f"Input squeeze_0 has rank {rank} != other inputs rank 0"
    zero_d = any(m.dim() == 0 for m in metas)
    if zero_d and not has_slice:
        # coremltools asks the first index for its element type, which a 0-d index has not.
        return "a 0-d index and no slice", _STOCK_ZERO_D
    if zero_d or (has_slice and len(given) > 1):
        # coremltools writes a block of size 1 in every indexed dim and broadcasts the values
        # to it: fine only when the values vary only after the last indexed dim.
        last = given[-1][0]
        self_val, values_val = self_arg.meta.get("val"), values.meta.get("val")
        trailing = self_val.dim() - last - 1
        leading = values_val.shape[: max(values_val.dim() - trailing, 0)]
        if any(size != 1 for size in leading):
            return (
                "a 0-d index or several indices next to a slice, with values that vary before the last index",
                None if zero_d else _STOCK_VALUES_VARY,
            )
    return None


@NODE_RULES.refuses("an `index_put` form coremltools converts wrongly or not at all")
def unsupported_index_put(node, ctx) -> Optional[str]:
    if not _is(node, torch.ops.aten.index_put) or not fixes.on("index_put_refusals"):
        return None
    found = _index_put_problem(node, ctx)
    if not found:
        return None
    problem, stock_text = found
    stock_says = f"stock: {stock_text!r}" if stock_text else "coremltools converts it wrongly"
    return f"Core ML cannot run {op_name(node.target)} with {problem} ({stock_says})"


def _argument(node: torch.fx.Node, name: str):
    """What `node` passes for its schema's argument `name` (None when it leaves it out)."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(aten_op(node.target), "_schema", None)
    positions = [i for i, argument in enumerate(schema.arguments if schema else ()) if argument.name == name]
    return node.args[positions[0]] if positions and positions[0] < len(node.args) else None


def _first_input(node: torch.fx.Node) -> Optional[torch.Tensor]:
    first = node.args[0] if node.args else None
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


@NODE_RULES.refuses("an op over a dim of a 0-d tensor: coremltools indexes a dim the tensor has not")
def dim_of_a_zero_d_tensor(node, ctx) -> Optional[str]:
    x, dims = _first_input(node), _argument(node, "dim")
    if x is None or x.dim() or dims in (None, []) or _is(node, torch.ops.aten.select, torch.ops.aten.unsqueeze):
        return None
    return (
        f"coremltools cannot convert {op_name(node.target)} over dim {dims} of a 0-d tensor (stock: 'pop from "
        "empty list' or 'list assignment index out of range')"
    )


@NODE_RULES.refuses("a flip of no dims, a roll without dims, an mse_loss of the default reduction: no converter takes them")
def arguments_left_out(node, ctx) -> Optional[str]:
    """`flip(x, [])` (a copy) gives Core ML's reverse an empty float list; `roll` without dims and
    `mse_loss` without its reduction leave out arguments coremltools' converters require."""
    if _is(node, torch.ops.aten.flip) and not list(node.args[1]):
        problem = "of no dims (Core ML's reverse takes an int32 list of axes; stock: 'expects tensor or scalar of dtype int32')"
    elif _is(node, torch.ops.aten.roll) and not _argument(node, "dims"):
        problem = "without dims, which rolls the flattened tensor (stock: 'got 2 input(s), expected [3]')"
    elif _is(node, torch.ops.aten.mse_loss) and len(node.args) < 3 and "reduction" not in node.kwargs:
        problem = "with its default reduction left out (stock: 'got 2 input(s), expected [3]')"
    else:
        return None
    return f"coremltools cannot convert {op_name(node.target)} {problem}"


@NODE_RULES.refuses("an FFT of a real input: Core ML's complex FFTs take complex input")
def fft_of_a_real_input(node, ctx) -> Optional[str]:
    x = _first_input(node)
    if x is None or x.is_complex() or not op_name(node.target).startswith("aten.fft_"):
        return None
    return (
        f"Core ML's complex FFTs take complex input, and this {op_name(node.target)} reads a real one (stock: "
        "'expects tensor or scalar of dtype from type domain [complex64]', or 'got 3 input(s), expected [4]')"
    )


@NODE_RULES.refuses("an op giving a complex tensor: Core ML's complex tensors stay inside its FFTs")
def complex_result(node, ctx) -> Optional[str]:
    complex_dtypes = sorted(str(d).removeprefix("torch.") for d in tensor_dtypes(node) if d.is_complex)
    if not complex_dtypes:
        return None
    return (
        f"Core ML cannot give a {complex_dtypes[0]} tensor, and this {op_name(node.target)} gives one "
        f"(stock: KeyError: torch.{complex_dtypes[0]})"
    )


@NODE_RULES.refuses("an average pool with `divisor_override`: coremltools has none")
def pool_with_divisor_override(node, ctx) -> Optional[str]:
    if _is(node, torch.ops.aten.avg_pool1d, torch.ops.aten.avg_pool2d, torch.ops.aten.avg_pool3d) and _argument(
        node, "divisor_override"
    ) is not None:
        return f"coremltools cannot convert {op_name(node.target)} with divisor_override (stock: ValueError)"
    return None


@NODE_RULES.refuses("an op reading or producing a tensor of rank above 5")
def rank_above_five(node, ctx) -> Optional[str]:
    produced = max((v.dim() for v in tensor_values(node)), default=0)
    read = max((v.dim() for arg in node.all_input_nodes for v in tensor_values(arg)), default=0)
    if max(produced, read) > CORE_ML_MAX_RANK:
        verb = "produces" if produced > CORE_ML_MAX_RANK else "reads"
        return (
            f"Core ML takes tensors of rank {CORE_ML_MAX_RANK} at most, and this op {verb} a rank "
            f"{max(produced, read)} tensor (only view/permute chains between lower-rank tensors are "
            "rewritten to fit)"
        )
    return None



def _data_dependent_scalars(node: torch.fx.Node) -> list[str]:
    """The symbols of the scalars read from tensors at run time (`u0`, `zuf0`: `.item()`,
    `_local_scalar_dense`) that `node` makes or reads."""
    values = [node.meta.get("val")] + [arg.meta.get("val") for arg in node.all_input_nodes]
    symbolic = [v for v in values if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    return sorted({str(s) for v in symbolic for s in free_unbacked_symbols(v)})


@NODE_RULES.refuses("an op using a number read from a tensor at run time (`.item()`)")
def scalar_read_at_run_time(node, ctx) -> Optional[str]:
    symbols = _data_dependent_scalars(node)
    if not symbols:
        return None
    return (
        f"Core ML cannot use {', '.join(symbols)}, a number read from a tensor at run time (.item()): "
        "coremltools leaves a tensor where the number is expected (slice: 'concat op should share "
        "the same data type'), and Core ML gives no number outputs"
    )


# --- quantized ops: the forms ExecuTorch's and coremltools' converters take ---------


def _named(node: torch.fx.Node, *prefixes: str) -> bool:
    """Whether the op's name starts with one of `prefixes` (quantized ops by name: their
    namespaces exist only once TorchAO or PT2E has loaded)."""
    return op_name(node.target).startswith(prefixes)


def _shape(value) -> Optional[tuple]:
    meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return tuple(meta.shape) if isinstance(meta, torch.Tensor) else None


@NODE_RULES.refuses("a `dequantize_affine` not of a constant 2-D int4 or int8 weight in blocks of one row")
def dequantize_affine_form(node, ctx) -> Optional[str]:
    if not _named(node, "torchao.dequantize_affine."):
        return None
    data, block_size = node.args[:2]
    quant_range = tuple(node.args[5:7])
    shape = _shape(data)
    if not isinstance(data, torch.fx.Node) or data.op != "placeholder":
        problem = "data computed in the program (Core ML dequantizes constant weights only)"
    elif shape is None or len(shape) != 2 or list(block_size)[:1] != [1]:
        problem = f"data of shape {shape} in blocks of {list(block_size)} (Core ML takes 2-D data in blocks of one row)"
    elif quant_range not in ((-8, 7), (-128, 127)):
        problem = f"the range {quant_range} (Core ML takes int4 [-8, 7] and int8 [-128, 127])"
    else:
        return None
    return f"Core ML cannot convert {op_name(node.target)} of {problem}"


@NODE_RULES.refuses("a `dequantize_codebook` not of constant 2-D codes with scalar tables per group of rows or columns")
def dequantize_codebook_form(node, ctx) -> Optional[str]:
    if not _named(node, "quant.dequantize_codebook."):
        return None
    codes, codebook = node.args[:2]
    codes_shape, table_shape = _shape(codes), _shape(codebook)
    if not all(isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in (codes, codebook)):
        return f"Core ML cannot convert {op_name(node.target)} of codes or tables computed in the program"
    if (
        codes_shape is None or table_shape is None or len(codes_shape) != 2 or len(table_shape) != 4
        or 1 not in table_shape[:2] or table_shape[3] != 1
    ):
        return (
            f"Core ML cannot convert {op_name(node.target)} of codes {codes_shape} and tables {table_shape}: "
            "ExecuTorch's converter takes 2-D codes with scalar tables per group of rows or of columns"
        )
    return None


# quantize op -> position of quant_min (quant_max follows, then the dtype).
_QUANTIZE_RANGE_AT = {
    "quantized_decomposed.quantize_per_tensor.": 3,
    "quantized_decomposed.quantize_per_channel.": 4,
}


@NODE_RULES.refuses("a quantize clamping to less than its dtype's range: coremltools drops the range")
def quantize_to_a_narrower_range(node, ctx) -> Optional[str]:
    at = next((i for prefix, i in _QUANTIZE_RANGE_AT.items() if _named(node, prefix)), None)
    if at is None or len(node.args) < at + 3:
        return None
    quant_min, quant_max, dtype = node.args[at : at + 3]
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point:
        return None
    full = torch.iinfo(dtype)
    if (quant_min, quant_max) == (full.min, full.max):
        return None
    return (
        f"Core ML's quantize clips to the whole {str(dtype).removeprefix('torch.')} range, and this "
        f"{op_name(node.target)} clamps to [{quant_min}, {quant_max}] (coremltools drops the range)"
    )


@NODE_RULES.refuses("dynamic activation quantization (`choose_qparams`): coremltools has no converter")
def dynamic_activation_quantization(node, ctx) -> Optional[str]:
    if _named(node, "quantized_decomposed.choose_qparams"):
        return (
            f"Core ML has no dynamic activation quantization: coremltools raises NotImplementedError "
            f"for {op_name(node.target)}; quantize for Core ML with a weight-only or static scheme"
        )
    return None


# --- partition rules -----------------------------------------------------------------


def reads_refused_dtype(node: torch.fx.Node, inside: Collection[torch.fx.Node]) -> Optional[str]:
    """Core ML takes no uint8/int8/bfloat16 model inputs (stock: `KeyError: torch.uint8`)."""
    for source in node.all_input_nodes:
        if source in inside:
            continue
        refused = sorted(str(d).removeprefix("torch.") for d in tensor_dtypes(source) & REFUSED_DTYPES)
        if refused:
            return (
                f"Core ML takes no {refused[0]} inputs, and this op reads {source.name} ({refused[0]}) "
                f"from outside its Core ML partition (stock: KeyError: torch.{refused[0]})"
            )
    return None


def reads_float16_before_ios16(node: torch.fx.Node, inside: Collection[torch.fx.Node], ctx: RuleContext) -> Optional[str]:
    """Core ML takes float16 inputs only from iOS 16 (stock: 'To use fp16 input, please set
    minimum deployment target to iOS16+')."""
    if ctx.ios16:
        return None
    for source in node.all_input_nodes:
        if source not in inside and torch.float16 in tensor_dtypes(source):
            return (
                f"Core ML takes float16 inputs only from iOS 16, and this op reads {source.name} (float16) "
                "from outside its Core ML partition; set minimum_deployment_target=iOS16 to delegate it"
            )
    return None


def size_expressions(node: torch.fx.Node) -> list[str]:
    """The sizes of `node`'s tensors that are expressions of symbols (`16*u0`), not one symbol or a number."""
    return [
        str(size)
        for value in tensor_values(node)
        for size in value.shape
        if isinstance(size, torch.SymInt) and not (size.node.expr.is_Symbol or size.node.expr.is_number)
    ]


def reads_size_expression(node: torch.fx.Node, inside: Collection[torch.fx.Node]) -> Optional[str]:
    """coremltools names each input size by one symbol of the program's range constraints
    (`exir_utils._construct_ct_tensor_type_from_torch`) and refuses an expression of them."""
    for source in node.all_input_nodes:
        sizes = [] if source in inside else size_expressions(source)
        if sizes:
            dims = sorted({str(s) for v in tensor_values(source) for d in v.shape if isinstance(d, torch.SymInt)
                           for s in d.node.expr.free_symbols if not free_unbacked_symbols(d)})
            made_of = f" (of the dynamic size {dynamic.describe_sizes(node.graph, dims)})" if dims else ""
            return (
                f"Core ML names each input size by one symbol, and this op reads {source.name} sized "
                f"{sizes[0]}{made_of} from outside its Core ML partition (stock: 'Core ML does not support size "
                "variables that are expressions of symbolic variables')"
            )
    return None


def gives_refused_dtype(node: torch.fx.Node, inside: Collection[torch.fx.Node]) -> Optional[str]:
    """A uint8/int8/bfloat16 result used outside Core ML cannot be a Core ML output."""
    refused = sorted(str(d).removeprefix("torch.") for d in tensor_dtypes(node) & REFUSED_DTYPES)
    if not refused:
        return None
    users = list(node.users)
    for user in list(users):  # look through tuple access
        if user.target is operator.getitem:
            users += list(user.users)
    if any(user not in inside and user.target is not operator.getitem for user in users):
        return f"Core ML cannot output {refused[0]}, and this op's {refused[0]} result is used outside Core ML"
    return None


NO_INPUTS_REASON = (
    "its Core ML partition would have no tensor inputs, which Core ML takes only from iOS 18; "
    "set minimum_deployment_target=iOS18 to delegate it"
)
