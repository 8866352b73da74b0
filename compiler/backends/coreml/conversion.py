"""Fixes to coremltools' torch-op conversion, active only while our programs are lowered.

Each fix wraps the converter coremltools (or ExecuTorch) registered for some
torch ops; `installed()` puts the wrappers into coremltools' torch-op registry
and puts the originals back afterwards, so nothing changes for other users of
coremltools in the process. Compiles may run in threads: the first to enter
installs the fixes, the last to leave restores the registry, and each swap
replaces the whole registry at once, so no thread sees it half patched.

- fills convert with the dtype torch gives them (`torch.full((1, 16), 0)` is
  int64, so int32 in Core ML, not fp32, and an int fill holds its value exactly, not
  rounded to fp32 first; `zeros_like(mask, dtype=float)` in
  `nn.MultiheadAttention` is float, not bool) unless the fill value is only
  known at run time;
- `rms_norm` without eps gets torch's default, the dtype's machine epsilon
  (stock: "got 3 input(s), expected [4]"), and adds it to the mean square as torch does
  (stock adds it to the mean square of x scaled by its largest |x|: 0.3 off at magnitude 1e-3);
- `clamp` by a bound known only at run time converts as torch computes it, min(max(x, low),
  high) (stock: max(min(x, high), low), which gives low where low > high; torch gives high);
- `var` and `std` without a correction divide by n - 1, as torch does (stock: by n);
- `gelu(approximate="tanh")` reads `approximate` from the keyword arguments
  (stock silently converts the exact gelu);
- a max pool without a stride gets its kernel size, torch's default (stock: "got 2
  input(s), expected minimum 3");
- `where` of three 0-d tensors converts to Core ML's select as it is (stock: "Concat
  concat_0 got 0 values" from the broadcast coremltools builds first);
- `where` whose condition has a larger shape than both values, a symbolic one, converts with
  the values broadcast against it (stock: Core ML's select is declared with the values'
  shape, 0-d for two 0-d values, and computes the condition's);
- `reciprocal` (which `1 / x` becomes), `rsqrt` and `log` (`log2`, `log10`) convert
  without the epsilon Core ML's inverse, rsqrt and log add by default (stock: `1 / x`
  is 1/(x + 1e-4), 909 for 1000 at x = 1e-3; log(0) is -103);
- `softplus` honours its threshold, x where beta * x > threshold (stock drops it:
  softplus(2.6, beta=2, threshold=5) is 2.6028, not 2.6);
- `log_softmax` converts as torch computes it, x - max - log(sum(exp(x - max))) (stock:
  log(softmax(x)), -inf in float16 and -103.3 in float32 where softmax underflows);
- `x[:, :, index] = values` (index_put with one 1-D index beside whole slices) converts for
  any number of positions: a slice_update from the first when the MIL program shows them
  consecutive (a KV cache written at `arange(new tokens) + length`; iOS 18), else a scatter
  along that axis (stock: one position only, "Input squeeze_0 has rank 1 != other inputs
  rank 0");
- an op that coremltools converts to its own input (clone, alias, a same-dtype
  copy...) gets a real identity, so an output never repeats an input or another
  output in the payload (stock returns the input tensor itself as an output).

Tests turn single fixes off with `fixes.fixes_off(name)` (see `fixes.py`); each fix asks
`fixes.on(name)` where it acts.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

import numpy as np
import torch

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.frontend.torch.ops import promote_input_dtypes
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.block import is_current_opset_version_compatible_with

from compiler.backends.coreml import fixes
from compiler.ir.errors import CompileError
from compiler.ir.private_api import coreml_converters, swap_coreml_converters

Converter = Callable[..., None]


def _context_var(context, name):
    return context[name] if isinstance(name, str) and name in context else None


def _core_ml_dtype(dtype: torch.dtype) -> str | None:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "fp16" if dtype == torch.float16 else "fp32"
    if not dtype.is_complex:
        return "int32"  # Core ML's only integer dtype for computed tensors
    return None


# --- fills --------------------------------------------------------------------------

# Converter name -> position of the fill value among the node's inputs (None: no value).
_FILLS = {
    "full": 1,
    "full_like": 1,
    "new_full": 2,
    "fill": 1,
    "scalar_tensor": 0,
    "zeros": None,
    "ones": None,
    "zeros_like": None,
    "ones_like": None,
    "new_zeros": None,
    "new_ones": None,
    "empty": None,
    "empty_like": None,
    "new_empty": None,
    "empty.memory_format": None,
    "dim_order_ops._empty_dim_order": None,
}


def _fits_int32(value) -> bool:
    try:
        return np.iinfo(np.int32).min <= int(value) <= np.iinfo(np.int32).max
    except (TypeError, ValueError, OverflowError):  # None, an array, nan or inf
        return False


def _fill_with_torch_dtype(original: Converter, value_index: int | None) -> Converter:
    @functools.wraps(original)
    def convert(context, node):
        if not fixes.on("fill_dtypes"):
            return original(context, node)
        value = node.inputs[value_index] if value_index is not None and len(node.inputs) > value_index else None
        if isinstance(value, str):  # a named value, else a literal
            var = _context_var(context, value)
            if var is not None and var.val is None:
                return original(context, node)  # a run-time fill value: keep coremltools' way
            value = var.val if var is not None else None
        original(context, node)
        expected = node.meta.get("val") if node.meta else None
        dtype = _core_ml_dtype(expected.dtype) if isinstance(expected, torch.Tensor) else None
        result = _context_var(context, node.name)
        if dtype is None or result is None or types.builtin_to_string(result.dtype) == dtype:
            return
        result.name = f"{node.name}_as_converted"
        if dtype == "int32" and _fits_int32(value) and types.is_float(result.dtype):
            # Cast, the float fill keeps its float32 rounding (2**24 + 1 -> 2**24): fill the int.
            exact = np.int32(value)
            if result.rank:
                fixed = mb.fill(shape=mb.shape(x=result), value=exact, name=node.name)
            else:
                fixed = mb.const(val=exact, name=node.name)
        else:
            fixed = mb.cast(x=result, dtype=dtype, name=node.name)
        context.add(fixed, torch_name=node.name, override=True)

    return convert


# --- rms_norm -----------------------------------------------------------------------


def _rms_norm_default_eps(original: Converter) -> Converter:
    """torch's rms_norm is x / sqrt(mean(x^2) + eps) (eps=None: the dtype's machine epsilon).
    coremltools 9.0 divides x by its row's largest |x| m first (so x^2 cannot overflow float16)
    and adds eps to the scaled mean square, which is sqrt(mean(x^2) + eps * m^2): rows of
    magnitude 1e-3 with eps 1e-6 come out 0.3 off (a row of zeros, NaN). We scale by
    s = max(m, sqrt(|eps|)) and add (sqrt(|eps|) / s)^2, or subtract it for a negative eps:
    torch's value, every square at most 1 (no float16 overflow, and small rows scaled up out of
    float16's subnormals)."""

    @functools.wraps(original)
    def convert(context, node):
        inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
        eps = _literal(context, inputs[3])
        if eps is None:
            expected = node.meta.get("val") if node.meta else None
            dtype = expected.dtype if isinstance(expected, torch.Tensor) else torch.float32
            eps = float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps)
        shape = _literal(context, inputs[1])
        x = context[inputs[0]]
        if not fixes.on("rms_norm_scaled_epsilon") or shape is None or not types.is_float(x.dtype):
            node.inputs = tuple(inputs[:3]) + (eps,)
            return original(context, node)
        axes = list(range(-len(np.atleast_1d(shape)), 0))
        root = types.nptype_from_builtin(x.dtype)(np.sqrt(abs(eps)))  # normal in float16 where eps is not
        scale = mb.maximum(x=mb.reduce_max(x=mb.abs(x=x), axes=axes, keep_dims=True), y=root)
        scaled = mb.real_div(x=x, y=scale)
        mean_square = mb.reduce_mean(x=mb.square(x=scaled), axes=axes, keep_dims=True)
        shift = mb.square(x=mb.real_div(x=root, y=scale))
        shifted = mb.add(x=mean_square, y=shift) if eps >= 0 else mb.sub(x=mean_square, y=shift)
        rms = mb.mul(x=mb.sqrt(x=shifted), y=scale)
        weight = context[inputs[2]] if inputs[2] is not None else None
        if weight is None:
            result = mb.real_div(x=x, y=rms, name=node.name)
        else:
            result = mb.mul(x=mb.real_div(x=x, y=rms), y=weight, name=node.name)
        context.add(result, torch_name=node.name)

    return convert


# --- var and std without a correction -----------------------------------------------


def _unbiased_without_a_correction(original: Converter) -> Converter:
    """torch's `var.correction` and `std.correction` without a correction (None: `torch.var(x)` and
    `torch.std(x)` over every dim) divide by n - 1; coremltools reads a missing correction as none
    and divides by n (OpInfo's `std(x)` of 125 elements: 0.4% low). We give it torch's 1."""

    @functools.wraps(original)
    def convert(context, node):
        inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
        if inputs[2] is None and "correction" not in (node.kwinputs or {}) and fixes.on("default_correction"):
            node.inputs = (*inputs[:2], 1, *inputs[3:])
        original(context, node)

    return convert


# --- clamp by bounds known at run time ------------------------------------------------


def _clamp_in_torch_order(original: Converter) -> Converter:
    """torch's clamp is min(max(x, low), high), so where low > high it gives high.
    coremltools converts a clamp whose bound is known only at run time (a tensor) as
    max(min(x, high), low), which gives low there (OpInfo's clamp sample: 17 off). We convert
    torch's order; a clamp by constant bounds (Core ML's clip, or a fill of high where low >=
    high) stays as coremltools converts it."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        result = _context_var(context, node.name)
        op = result.op if result is not None else None
        if op is None or op.op_type != "maximum" or op.x.op is None or op.x.op.op_type != "minimum":
            return
        if not fixes.on("clamp_order"):
            return
        x, high, low = op.x.op.x, op.x.op.y, op.y
        result.name = f"{node.name}_high_first"
        fixed = mb.minimum(x=mb.maximum(x=x, y=low), y=high, name=node.name)
        context.add(fixed, torch_name=node.name, override=True)

    return convert


# --- gelu ---------------------------------------------------------------------------


def _gelu_keyword_approximate(original: Converter) -> Converter:
    @functools.wraps(original)
    def convert(context, node):
        approximate = (node.kwinputs or {}).get("approximate")
        if approximate and approximate[0] == "tanh" and len(node.inputs) == 1 and fixes.on("tanh_gelu"):
            x = context[node.inputs[0]]
            context.add(mb.gelu(x=x, mode="TANH_APPROXIMATION", name=node.name))
            return
        original(context, node)

    return convert


# --- max pools without a stride ----------------------------------------------------

_MAX_POOLS = tuple(f"max_pool{n}d{suffix}" for n in (1, 2, 3) for suffix in ("", "_with_indices"))


def _max_pool_default_stride(original: Converter) -> Converter:
    """A max pool whose stride is left out (torch's default: the kernel size, as export
    records `F.max_pool1d(x, 2)` and decompositions make `max_pool2d_with_indices(x, k)`)
    gets the kernel size as its stride (stock: "got 2 input(s), expected minimum 3")."""

    @functools.wraps(original)
    def convert(context, node):
        if len(node.inputs) == 2:
            node.inputs = (*node.inputs, node.inputs[1])
        original(context, node)

    return convert


# --- where of 0-d tensors ----------------------------------------------------------


def _where_of_scalars(original: Converter) -> Converter:
    """coremltools broadcasts `where`'s operands to a shape it builds by concatenating
    their dims: of three 0-d tensors there are none ("Concat concat_0 got 0 values", stock
    too; the median of all elements, decomposed, ends in one). Core ML's select takes 0-d
    operands as they are."""

    @functools.wraps(original)
    def convert(context, node):
        operands = [_context_var(context, name) for name in node.inputs]
        if len(operands) != 3 or any(v is None or v.shape != () for v in operands):
            return original(context, node)
        cond, a, b = operands
        a, b = promote_input_dtypes([a, b])
        if not types.is_bool(cond.dtype):
            cond = mb.cast(x=cond, dtype="bool")
        context.add(mb.select(cond=cond, a=a, b=b, name=node.name))

    return convert


# --- where over a condition of a larger symbolic shape ----------------------------


def _covers(shape: tuple, cond_shape: tuple) -> bool:
    """Whether a result of `shape` has the shape its condition broadcasts to (dims compared
    as coremltools writes them: numbers or symbols)."""
    if len(shape) < len(cond_shape):
        return False
    return all(c == 1 or r == c for r, c in zip(reversed(shape), reversed(cond_shape)))


def _broadcast_against(x, cond):
    """`x` broadcast against the bool `cond` by one elementwise op, whose declared shape is the
    broadcast: x - 0 (-0.0 stays -0.0, as in torch's where), or x and True for bool."""
    if types.is_bool(x.dtype):
        return mb.logical_and(x=x, y=mb.logical_or(x=cond, y=True))
    zeros = mb.mul(x=mb.cast(x=cond, dtype=types.builtin_to_string(x.dtype)), y=_zero_like(x))
    return mb.sub(x=x, y=zeros)


def _where_shaped_by_its_condition(original: Converter) -> Converter:
    """Core ML's select declares its result's shape from `a` and `b` only (coremltools'
    `select.type_inference`; its spec: the broadcast of cond, a and b), and coremltools'
    `where` broadcasts the three first only when no shape is symbolic: `where(mask, 0-d, 0-d)`
    over a mask of u rows is declared 0-d, though it computes the mask's shape (what the
    program's next ops and outputs are sized by). `a` and `b` are broadcast against the
    condition first, so the declared shape is the computed one."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        result = _context_var(context, node.name)
        op = result.op if result is not None else None
        if op is None or op.op_type != "select" or not fixes.on("select_shape"):
            return
        if _covers(result.shape, op.cond.shape):
            return
        result.name = f"{node.name}_shaped_by_a_and_b"
        a, b = (_broadcast_against(x, op.cond) for x in (op.a, op.b))
        context.add(mb.select(cond=op.cond, a=a, b=b, name=node.name), torch_name=node.name, override=True)

    return convert


# --- unary ops without Core ML's default epsilon ----------------------------------


def _zero_like(x) -> np.generic:
    return types.nptype_from_builtin(x.dtype)(0)


def _without_default_epsilon(original: Converter) -> Converter:
    """coremltools converts `reciprocal` to MIL's `inverse`, `rsqrt` to `rsqrt` and `log`,
    `log2`, `log10` to `log` (times a constant) without an epsilon, so each gets the spec's
    default and computes 1/(x + 1e-4), 1/sqrt(x + 1e-12), log(x + 1e-45): `1 / x` (which
    becomes reciprocal) at x = 1e-3 is 909, not 1000; rsqrt(1e-6) is 5e-4 off; log(0) is
    -103, not -inf. reciprocal becomes real_div(1, x), exact; rsqrt and log keep their op
    with epsilon 0, so the layer-norm fusions that match an rsqrt still apply."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        if not fixes.on("unary_epsilon"):
            return
        result = _context_var(context, node.name)
        op = result.op if result is not None else None
        scale = None
        if op is not None and op.op_type == "mul" and op.x.op is not None and op.x.op.op_type == "log":
            scale, op = op.y, op.x.op  # log2, log10: log(x) * 1/log(base)
        if op is None or op.op_type not in ("inverse", "rsqrt", "log") or not types.is_float(op.x.dtype):
            return
        x = op.x
        result.name = f"{node.name}_with_epsilon"
        if op.op_type == "inverse":
            fixed = mb.real_div(x=types.nptype_from_builtin(x.dtype)(1), y=x, name=node.name)
        elif op.op_type == "rsqrt":
            fixed = mb.rsqrt(x=x, epsilon=_zero_like(x), name=node.name)
        elif scale is None:
            fixed = mb.log(x=x, epsilon=_zero_like(x), name=node.name)
        else:
            fixed = mb.mul(x=mb.log(x=x, epsilon=_zero_like(x)), y=scale, name=node.name)
        context.add(fixed, torch_name=node.name, override=True)

    return convert


# --- softplus's threshold -----------------------------------------------------------


def _literal(context, value):
    """A node input's value known at conversion time (a literal or a constant), else None."""
    if isinstance(value, str):
        var = _context_var(context, value)
        return None if var is None or var.val is None else var.val
    return value


def _softplus_threshold(original: Converter) -> Converter:
    """torch's softplus is x where beta * x > threshold, log1p(exp(beta * x)) / beta elsewhere;
    coremltools drops the threshold (softplus(x, beta=2, threshold=5) at 2.6 is 2.6028, not
    2.6). Where that changes nothing float32 can see (torch's default threshold 20 at beta 1)
    the program stays as stock converts it."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        if not fixes.on("softplus_threshold"):
            return
        beta = float(_literal(context, node.inputs[1])) if len(node.inputs) > 1 else 1.0
        threshold = float(_literal(context, node.inputs[2])) if len(node.inputs) > 2 else 20.0
        # Past the threshold torch gives x; stock log1p(exp(-threshold)) / beta more at most.
        gap = np.log1p(np.exp(-threshold)) / abs(beta)
        if gap <= np.spacing(np.float32(abs(threshold / beta))) / 2:
            return
        x, result = context[node.inputs[0]], _context_var(context, node.name)
        result.name = f"{node.name}_without_threshold"
        past = mb.greater(x=mb.mul(x=x, y=types.nptype_from_builtin(x.dtype)(beta)), y=types.nptype_from_builtin(x.dtype)(threshold))
        context.add(mb.select(cond=past, a=x, b=result, name=node.name), torch_name=node.name, override=True)

    return convert


# --- log_softmax ---------------------------------------------------------------------


def _stable_log_softmax(original: Converter) -> Converter:
    """coremltools converts log_softmax as log(softmax(x)): where softmax underflows, which
    takes a spread of ~17 in float16 and ~100 in float32, that is log(0) = -inf in float16
    and log's default epsilon, log(1e-45) = -103.3, in float32, where torch gives x - max -
    log(sum(exp(x - max))): log_softmax([0, -200]) is [0, -inf] (float16) or [0, -103.3]
    (float32), not [0, -200]. We convert torch's formula."""

    @functools.wraps(original)
    def convert(context, node):
        if not fixes.on("log_softmax") or len(node.inputs) < 2:
            return original(context, node)
        x, axis = context[node.inputs[0]], _literal(context, node.inputs[1])
        if axis is None or not types.is_float(x.dtype):
            return original(context, node)
        axes = [int(axis)]
        shifted = mb.sub(x=x, y=mb.reduce_max(x=x, axes=axes, keep_dims=True))
        log_sum = mb.log(x=mb.reduce_sum(x=mb.exp(x=shifted), axes=axes, keep_dims=True), epsilon=_zero_like(x))
        context.add(mb.sub(x=shifted, y=log_sum, name=node.name), torch_name=node.name)

    return convert


# --- index_put at one axis ----------------------------------------------------------


def _one_element(var) -> bool:
    return var.shape in ((), (1,))


def _consecutive(var) -> bool:
    """Whether the MIL program shows a 1-D integer index to hold consecutive positions k, k+1,
    ...: a constant run, one element, `range_1d` with step 1, or such an index plus one number
    (transformers' StaticCache writes at `arange(new tokens) + cumulative_length`)."""
    if var.val is not None:
        values = np.asarray(var.val).reshape(-1)
        return bool(np.all(np.diff(values) == 1))
    if var.shape == (1,):
        return True
    op = var.op
    if op is None:
        return False  # a model input: any positions
    if op.op_type == "range_1d":
        return op.step.val is not None and int(op.step.val) == 1
    if op.op_type == "add":
        return (_consecutive(op.x) and _one_element(op.y)) or (_consecutive(op.y) and _one_element(op.x))
    return False


def _as_written(values, x, positions, axis: int):
    """`values` broadcast to the shape index_put writes, x's with the positions' length at `axis`
    (`values - 0`: -0.0 stays -0.0)."""
    whole = mb.shape(x=x)
    parts = [mb.slice_by_index(x=whole, begin=[0], end=[axis])] if axis else []
    parts.append(mb.shape(x=positions))
    if axis + 1 < x.rank:
        parts.append(mb.slice_by_index(x=whole, begin=[axis + 1], end=[x.rank]))
    zeros = mb.fill(shape=mb.concat(values=parts, axis=0), value=_zero_like(values))
    return mb.sub(x=values, y=zeros)


def _index_put_at_one_axis(original: Converter) -> Converter:
    """`x[:, :, index] = values` (index_put with one 1-D integer index beside whole slices) is
    converted as one slice_update from the index's first position when the MIL program shows its
    positions consecutive (`_consecutive`) and the target has slice_update (iOS 18), else as a
    scatter along that axis, right for any positions (negative ones counted from the end, as
    torch does). Stock handles one position only (a KV cache written a token at a time) and
    fails on more ("Input squeeze_0 has rank 1 != other inputs rank 0"): the cache update of
    a prompt of any length. slice_update is what Core ML updates state with in place. Like
    torch's, the positions must lie in the axis (torch fails past its end; a run from -1 to 0,
    which torch wraps to both ends, would not be one slice: a cache has no negative position)."""

    @functools.wraps(original)
    def convert(context, node):
        accumulate = node.inputs[3] if len(node.inputs) > 3 else (node.kwinputs or {}).get("accumulate", [False])[0]
        indices = list(node.inputs[1])
        given = [(axis, name) for axis, name in enumerate(indices) if name is not None]
        if _literal(context, accumulate) or len(given) != 1 or len(given) == len(indices):
            return original(context, node)
        axis, index_name = given[0]
        x, positions, values = context[node.inputs[0]], context[index_name], context[node.inputs[2]]
        if positions.rank != 1 or not types.is_int(positions.dtype):
            return original(context, node)
        dtype = x.dtype
        if types.is_bool(dtype):  # neither slice_update nor scatter takes bool data
            x = mb.cast(x=x, dtype="int32")
        values = mb.cast(x=values, dtype=types.builtin_to_string(x.dtype)) if values.dtype != x.dtype else values
        if tuple(values.shape) != (*x.shape[:axis], *positions.shape, *x.shape[axis + 1 :]):
            values = _as_written(values, x, positions, axis)
        size = mb.slice_by_index(x=mb.shape(x=x), begin=[axis], end=[axis + 1])
        index = mb.select(cond=mb.less(x=positions, y=np.int32(0)), a=mb.add(x=positions, y=size), b=positions)
        result_name = f"{node.name}_as_int32" if types.is_bool(dtype) else node.name
        if is_current_opset_version_compatible_with(ct.target.iOS18) and _consecutive(positions):
            zeros = [np.zeros(1, np.int32)] * x.rank
            first = mb.slice_by_index(x=index, begin=[0], end=[1])
            begin = mb.concat(values=zeros[:axis] + [first] + zeros[axis + 1 :], axis=0)
            length = mb.concat(values=zeros[:axis] + [mb.shape(x=index)] + zeros[axis + 1 :], axis=0)
            masks = [i != axis for i in range(x.rank)]
            result = mb.slice_update(
                x=x, update=values, begin=begin, end=mb.add(x=begin, y=length),
                begin_mask=masks, end_mask=masks, name=result_name,
            )
        else:
            result = mb.scatter(data=x, indices=index, updates=values, axis=axis, mode="update", name=result_name)
        if types.is_bool(dtype):
            result = mb.cast(x=result, dtype="bool", name=node.name)
        context.add(result, torch_name=node.name)

    return convert


def _bool_data_stays_bool(original: Converter) -> Converter:
    """An index_put into bool data gives bool data. coremltools scatters bool data as int32 (its
    scatter_nd takes no bool) and never casts back: a mask written so, then indexed by, was
    read as integer positions (`a[:, mask]` came out (1, 8, 3) where torch's is (1, 6, 3))."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        result = context[node.name]
        if types.is_bool(context[node.inputs[0]].dtype) and not types.is_bool(result.dtype):
            context.add(mb.cast(x=result, dtype="bool", name=f"{node.name}_as_bool"), torch_name=node.name, override=True)

    return convert


# --- outputs that alias inputs ------------------------------------------------------


def _input_vars(context, inputs) -> list:
    """The MIL values of a node's inputs, those inside a list too (`atleast_2d` of a sequence)."""
    found = []
    for name in inputs:
        if isinstance(name, (list, tuple)):
            found += _input_vars(context, name)
        elif (var := _context_var(context, name)) is not None:
            found.append(var)
    return found


def _never_alias(original: Converter) -> Converter:
    """An output that is one of the node's inputs, alone or in a sequence of results
    (`atleast_2d` of tensors of rank 2 or more), gets a real identity."""

    @functools.wraps(original)
    def convert(context, node):
        original(context, node)
        if len(node.outputs) != 1 or not node.inputs or not fixes.on("never_alias"):
            return
        result = _context_var(context, node.outputs[0])
        sources = _input_vars(context, node.inputs)
        if any(result is source for source in sources):
            copy = mb.identity(x=result, name=node.outputs[0])
            context.add(copy, torch_name=node.outputs[0], override=True)
        elif isinstance(result, (list, tuple)) and any(r is source for r in result for source in sources):
            copies = [mb.identity(x=r) if any(r is source for source in sources) else r for r in result]
            context.add(copies, torch_name=node.outputs[0], override=True)

    return convert


# --- a converter that fails ----------------------------------------------------------


class CoreMLConversionError(CompileError):
    """coremltools could not convert an op of a Core ML partition."""


def _named_when_it_fails(fixed: Converter, original: Converter) -> Converter:
    """`fixed` (our fix of coremltools' `original` converter) giving our error when it raises,
    naming the node and its converter, not the library's own (`node aten_roll_default (roll) got
    2 input(s), expected [3]`, a `pop from empty list`), which reached the user as a failure of
    the lower stage. It wraps `original` as far as the registry can tell (`__wrapped__`)."""

    @functools.wraps(original)
    def convert(context, node):
        try:
            fixed(context, node)
        except CompileError:
            raise
        except Exception as error:
            lines = str(error).strip().splitlines()
            op = f"aten.{node.kind}" if node.name.startswith("aten_") else None
            raise CoreMLConversionError(
                f"coremltools could not convert {node.name} (its converter `{node.kind}` raised "
                f"{type(error).__name__}: {lines[0] if lines else ''})",
                nodes=[node.name],
                hint="keep the op off Core ML (it then runs on the CPU or decomposes), and report it",
                suggest={"skip_ops_for_coreml_delegation": [op]} if op else None,
            ) from error

    return convert


# --- clamp_min and clamp_max by an integer literal --------------------------------------


def _bound_in_the_inputs_dtype(original: Converter) -> Converter:
    """coremltools' clamp_min and clamp_max assert that x and the bound share a dtype, and a
    literal bound comes as written: `clamp_min(x, 0)` of float x (the triplet margin loss
    clamps so) failed its assertion. A literal bound of a float x is given as a float."""

    @functools.wraps(original)
    def convert(context, node):
        x, bound = context[node.inputs[0]], node.inputs[1]
        if isinstance(bound, (bool, int)) and types.is_float(x.dtype):
            node.inputs = (node.inputs[0], float(bound), *node.inputs[2:])
        original(context, node)

    return convert


# --- prelu by a weight known at run time -------------------------------------------------


def _prelu_of_a_run_time_weight(original: Converter) -> Converter:
    """coremltools converts prelu with a constant weight only (`alpha.val`, None for a weight
    that is a program input: "unsupported operand type(s) for *: 'float' and 'NoneType'"), and
    of an input of rank 1 or more ("Axis value 2 is out of bounds for expand_dims" for a 0-d
    one). Such a prelu becomes torch's formula, x where x >= 0 and weight * x elsewhere, the
    weight along dim 1 (one weight: every element)."""

    @functools.wraps(original)
    def convert(context, node):
        x, weight = context[node.inputs[0]], context[node.inputs[1]]
        if weight.val is not None and x.rank > 0:
            return original(context, node)
        if x.rank >= 2:
            weight = mb.reshape(x=weight, shape=[-1] + [1] * (x.rank - 2))
        elif x.rank == 0 and weight.rank:
            weight = mb.squeeze(x=weight)  # its one element: the result stays 0-d
        scaled = mb.mul(x=x, y=weight)
        context.add(mb.select(cond=mb.greater_equal(x=x, y=_zero_like(x)), a=x, b=scaled, name=node.name))

    return convert


def _fixes(registry: dict[str, Converter]) -> dict[str, Callable[[Converter], Converter]]:
    fixes: dict[str, Callable[[Converter], Converter]] = {name: _never_alias for name in registry}
    for name, index in _FILLS.items():
        if name in registry:
            fixes[name] = lambda f, i=index: _never_alias(_fill_with_torch_dtype(f, i))
    fixes["rms_norm"] = _rms_norm_default_eps
    fixes["clamp"] = lambda f: _never_alias(_clamp_in_torch_order(f))
    for name in ("var.correction", "std.correction"):
        fixes[name] = lambda f: _never_alias(_unbiased_without_a_correction(f))
    fixes["gelu"] = _gelu_keyword_approximate
    for name in _MAX_POOLS:
        if name in registry:
            fixes[name] = lambda f: _never_alias(_max_pool_default_stride(f))
    for name in ("where", "where.self"):
        fixes[name] = lambda f: _never_alias(_where_of_scalars(_where_shaped_by_its_condition(f)))
    fixes["softplus"] = lambda f: _never_alias(_softplus_threshold(f))
    for name in ("log_softmax", "_log_softmax"):
        if name in registry:
            fixes[name] = _stable_log_softmax
    for name in ("reciprocal", "rsqrt", "log", "log2", "log10"):
        fixes[name] = _without_default_epsilon
    fixes["index_put"] = lambda f: _bool_data_stays_bool(_index_put_at_one_axis(f))
    fixes["prelu"] = lambda f: _never_alias(_prelu_of_a_run_time_weight(f))
    for name in ("clamp_min", "clamp_max"):
        fixes[name] = lambda f: _never_alias(_bound_in_the_inputs_dtype(f))
    return fixes


# Guards the count and the swaps below: the blocks inside `installed()` in any thread.
_LOCK = threading.Lock()
_users = 0
_original: dict[str, Converter] = {}  # the registry before the first block was entered
_fixed: dict[str, Converter] = {}  # what the registry held once the fixes went in


def _install() -> None:
    global _original, _fixed
    original = coreml_converters()
    patched = dict(original)
    for name, fix in _fixes(original).items():
        patched[name] = _named_when_it_fails(fix(original[name]), original[name])
    _fixed = dict(patched)
    _original = swap_coreml_converters(patched)


def _restore() -> None:
    global _original, _fixed
    original, fixed = _original, _fixed
    _original, _fixed = {}, {}
    current = swap_coreml_converters(original)
    # A converter registered while the fixes were in (an import registering its own) stays.
    for name, converter in current.items():
        if fixed.get(name) is not converter:
            original[name] = converter


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Our conversion fixes in coremltools' torch-op registry, for the duration of the block.

    Safe to enter from several threads (and nested): the fixes go in when the first
    block is entered and come out when the last one is left."""
    global _users
    with _LOCK:
        if _users == 0:
            _install()
        _users += 1
    try:
        yield
    finally:
        with _LOCK:
            _users -= 1
            if _users == 0:
                _restore()
