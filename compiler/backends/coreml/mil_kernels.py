"""numpy kernels of MIL ops, written from coremltools' MIL op specification (`mil/ops/defs`).

One function per op type, called with the op's inputs by their MIL names (a tuple input
as a list); it returns the output value, or a tuple for ops with several outputs. The
interpreter casts each result to the dtype the MIL program declares for it, so a float16
op's result is rounded to float16 as the device stores it. Elementwise ops compute in
their inputs' dtype (numpy rounds each float16 operation); ops that accumulate (matmul,
linear, conv, reductions, softmax, normalizations, attention) compute from their float16
inputs in float32 and round once: how a device accumulates inside one op is its own
choice, what it stores between ops is the program's.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# MIL dtype names (cast's `dtype`) -> numpy dtypes.
DTYPES = {
    "fp16": np.float16, "fp32": np.float32, "fp64": np.float64, "bool": np.bool_,
    "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
    "int32": np.int32, "int64": np.int64, "uint32": np.uint32,
}

KERNELS: dict[str, Callable] = {}


def kernel(*names: str):
    def register(fn):
        for name in names:
            KERNELS[name] = fn
        return fn

    return register


def _f32(x):
    """A float value widened to float32 for an accumulating op (integers kept)."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.kind == "f" and x.itemsize < 4 else x


_ERF = np.vectorize(math.erf, otypes=[np.float64])


def _erf(x):
    """erf rounded to x's dtype (numpy has no erf; math.erf is correctly rounded in float64)."""
    x = np.asarray(x)
    return _ERF(x).astype(x.dtype)


def _logsumexp(x, axis, keepdims):
    top = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis)


def _axes(axes, rank):
    return None if axes is None else tuple(int(a) % rank if rank else 0 for a in np.atleast_1d(axes))


# --- elementwise binary (iOS15/elementwise_binary.py) -------------------------------

_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.true_divide,
    "floor_div": np.floor_divide, "mod": np.mod, "pow": np.power, "maximum": np.maximum,
    "minimum": np.minimum, "equal": np.equal, "not_equal": np.not_equal,
    "greater": np.greater, "greater_equal": np.greater_equal, "less": np.less,
    "less_equal": np.less_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}
for _name, _fn in _BINARY.items():
    KERNELS[_name] = lambda x, y, _fn=_fn: _fn(np.asarray(x), np.asarray(y))


@kernel("real_div")
def _real_div(x, y):
    """Of int32 operands an int32 result (the spec's T), the quotient cast as coremltools'
    value inference casts it: truncated toward zero."""
    x, y = np.asarray(x), np.asarray(y)
    quotient = np.true_divide(x, y)
    if x.dtype.kind in "iu" and y.dtype.kind in "iu":
        return np.trunc(quotient).astype(np.result_type(x, y))
    return quotient


@kernel("non_zero")
def _non_zero(x):
    """The indices of the non-zero elements, one row each: [N, rank] int32 (iOS15 tensor_operation)."""
    return np.argwhere(np.asarray(x)).astype(np.int32)


# --- elementwise unary (iOS15/elementwise_unary.py, iOS17/elementwise_unary.py) ------

_UNARY = {
    "abs": np.abs, "acos": np.arccos, "asin": np.arcsin, "atan": np.arctan,
    "atanh": np.arctanh, "acosh": np.arccosh, "asinh": np.arcsinh, "ceil": np.ceil,
    "cos": np.cos, "cosh": np.cosh, "exp": np.exp, "exp2": np.exp2, "floor": np.floor,
    "logical_not": np.logical_not, "round": np.round, "sign": np.sign, "sin": np.sin,
    "sinh": np.sinh, "sqrt": np.sqrt, "square": np.square, "tan": np.tan, "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "softsign": lambda x: x / (1 + np.abs(x)),
    "softplus": lambda x: np.logaddexp(np.zeros((), x.dtype), x),
    "erf": lambda x: _erf(x),
    "identity": lambda x: x,
}
for _name, _fn in _UNARY.items():
    KERNELS[_name] = lambda x, _fn=_fn: _fn(np.asarray(x))


@kernel("inverse")
def inverse(x, epsilon=1e-4):
    return 1 / (x + np.asarray(epsilon, x.dtype))


@kernel("log")
def log(x, epsilon=1e-45):
    return np.log(x + np.asarray(epsilon, x.dtype))


@kernel("rsqrt")
def rsqrt(x, epsilon=1e-12):
    return 1 / np.sqrt(x + np.asarray(epsilon, x.dtype))


@kernel("clip")
def clip(x, alpha, beta):
    return np.minimum(np.maximum(x, alpha), beta)


@kernel("threshold")
def threshold(x, alpha):
    return np.maximum(x, alpha)


@kernel("cast")
def cast(x, dtype):
    # Float to integer truncates toward zero, as numpy's astype.
    return np.asarray(x).astype(DTYPES[str(dtype)])


# --- activations (iOS15/activation.py) ---------------------------------------------


@kernel("gelu")
def gelu(x, mode="EXACT"):
    half = np.asarray(0.5, x.dtype)
    if mode == "EXACT":
        return half * x * (1 + _erf(x / np.asarray(math.sqrt(2), x.dtype)))
    if mode == "TANH_APPROXIMATION":
        inner = np.asarray(math.sqrt(2 / math.pi), x.dtype) * (x + np.asarray(0.044715, x.dtype) * x**3)
        return half * x * (1 + np.tanh(inner))
    if mode == "SIGMOID_APPROXIMATION":
        return x / (1 + np.exp(np.asarray(-1.702, x.dtype) * x))
    raise ValueError(f"gelu mode {mode!r}")


@kernel("relu6")
def relu6(x):
    return np.minimum(np.maximum(x, 0), 6)


@kernel("leaky_relu")
def leaky_relu(x, alpha=0.01):
    return np.where(x >= 0, x, x * alpha)


@kernel("elu")
def elu(x, alpha=1.0):
    return np.where(x > 0, x, alpha * (np.exp(x) - 1))


@kernel("sigmoid_hard")
def sigmoid_hard(x, alpha=0.2, beta=0.5):
    return np.minimum(np.maximum(alpha * x + beta, 0), 1)


@kernel("linear_activation")
def linear_activation(x, alpha, beta=0.0):
    return alpha * x + beta


@kernel("prelu")
def prelu(x, alpha):
    alpha = np.asarray(alpha).reshape((1, -1) + (1,) * (x.ndim - 2))
    return np.where(x >= 0, x, x * alpha)


@kernel("thresholded_relu")
def thresholded_relu(x, alpha=1.0):
    """x where x >= alpha, else 0."""
    return np.where(x >= alpha, x, np.zeros((), np.asarray(x).dtype))


@kernel("clamped_relu")
def clamped_relu(x, alpha, beta):
    """min(beta, x) for x >= 0, min(beta, alpha * x) below."""
    return np.minimum(np.where(x >= 0, x, alpha * x), beta)


@kernel("scaled_tanh")
def scaled_tanh(x, alpha, beta):
    return alpha * np.tanh(beta * x)


@kernel("softplus_parametric")
def softplus_parametric(x, alpha, beta):
    """alpha_c * log(1 + exp(beta_c * x)), alpha and beta per channel (axis 1)."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    alpha, beta = np.asarray(alpha).reshape(shape), np.asarray(beta).reshape(shape)
    return alpha * np.logaddexp(np.zeros((), x.dtype), beta * x)


@kernel("softmax")
def softmax(x, axis=-1):
    x = _f32(x)
    e = np.exp(x - np.max(x, axis=int(axis), keepdims=True))
    return e / np.sum(e, axis=int(axis), keepdims=True)


# --- linear algebra (iOS15/linear.py, iOS17/linear.py) ------------------------------


@kernel("linear")
def linear(x, weight, bias=None):
    out = np.matmul(_f32(x), _f32(weight).T)
    return out if bias is None else out + _f32(bias)


@kernel("matmul")
def matmul(x, y, transpose_x=False, transpose_y=False):
    x, y = _f32(x), _f32(y)
    if transpose_x and x.ndim > 1:
        x = np.swapaxes(x, -1, -2)
    if transpose_y and y.ndim > 1:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


@kernel("scaled_dot_product_attention")
def scaled_dot_product_attention(query, key, value, attn_mask=None):
    q, k, v = _f32(query), _f32(key), _f32(value)
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) / np.float32(math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + _f32(mask)
    return np.matmul(softmax(scores, -1), v)


# --- convolution and pooling (iOS15/conv.py, iOS15/pool.py) -------------------------


def _pads(pad_type, pad, spatial, kernel_sizes, strides, dilations):
    """(before, after) per spatial axis, from the spec's pad_type rules."""
    n = len(spatial)
    if pad_type == "valid":
        return [(0, 0)] * n
    if pad_type == "custom":
        pad = [int(p) for p in (pad if pad is not None else [0] * 2 * n)]
        return [(pad[2 * i], pad[2 * i + 1]) for i in range(n)]
    pads = []
    for size, k, s, d in zip(spatial, kernel_sizes, strides, dilations):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        before = total // 2 if pad_type == "same" else (total + 1) // 2
        pads.append((before, total - before))
    return pads


def _windows(x, kernel_sizes, strides, dilations, pads, fill):
    """x (N, C, *D) -> windows (N, C, *D_out, *K) after padding with `fill`."""
    n = len(kernel_sizes)
    xp = np.pad(x, [(0, 0), (0, 0)] + list(pads), constant_values=fill)
    dilated = tuple((k - 1) * d + 1 for k, d in zip(kernel_sizes, dilations))
    w = sliding_window_view(xp, dilated, axis=tuple(range(2, 2 + n)))
    index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides) + tuple(
        slice(None, None, d) for d in dilations)
    return w[index]


@kernel("conv")
def conv(x, weight, bias=None, strides=None, pad_type="valid", pad=None, dilations=None, groups=1):
    x, weight = _f32(x), _f32(weight)
    n, groups = x.ndim - 2, int(groups)
    ks = weight.shape[2:]
    strides = [int(s) for s in (strides if strides is not None else [1] * n)]
    dilations = [int(d) for d in (dilations if dilations is not None else [1] * n)]
    pads = _pads(pad_type, pad, x.shape[2:], ks, strides, dilations)
    w = _windows(x, ks, strides, dilations, pads, 0)  # (N, C, *Do, *K)
    batch, channels = w.shape[:2]
    w = w.reshape((batch, groups, channels // groups) + w.shape[2:])
    kernel_weight = weight.reshape((groups, weight.shape[0] // groups) + weight.shape[1:])
    letters = "hijklm"[:n]
    kl = "pqrstu"[:n]
    out = np.einsum(f"ngc{letters}{kl},goc{kl}->ngo{letters}", w, kernel_weight)
    out = out.reshape((batch, weight.shape[0]) + out.shape[3:])
    if bias is not None:
        out = out + _f32(bias).reshape((1, -1) + (1,) * n)
    return out


@kernel("conv_transpose")
def conv_transpose(x, weight, bias=None, pad=None, output_shape=None, pad_type="valid", strides=None,
                   dilations=None, groups=1):
    """The transposed convolution: input element i, kernel tap k add x * w at output s * i + d * k
    (weight [C_in, C_out / groups, *K]), on the full output (D_in - 1) * s + (K - 1) * d + 1,
    which the padding then crops: "custom" drops pad[2i] before and pad[2i+1] after; "same"
    gives D_in * s (TensorFlow's split: the odd one after). With output_shape, the output is
    that size, from the same start (any part past the full output is 0)."""
    x, weight = _f32(x), _f32(weight)
    n, groups = x.ndim - 2, int(groups)
    strides = [int(s) for s in (strides if strides is not None else [1] * n)]
    dilations = [int(d) for d in (dilations if dilations is not None else [1] * n)]
    batch, c_in = x.shape[:2]
    ks = weight.shape[2:]
    per_group = weight.shape[1]
    full_sizes = [(d_in - 1) * s + (k - 1) * d + 1 for d_in, k, s, d in zip(x.shape[2:], ks, strides, dilations)]
    full = np.zeros((batch, groups, per_group) + tuple(full_sizes), np.float32)
    xg = x.reshape((batch, groups, c_in // groups) + x.shape[2:])
    wg = weight.reshape((groups, c_in // groups, per_group) + tuple(ks))
    letters = "hijklm"[:n]
    for tap in np.ndindex(*ks):
        contribution = np.einsum(f"ngc{letters},gco->ngo{letters}", xg, wg[(Ellipsis,) + tap])
        index = tuple(slice(d * k, d * k + s * (size - 1) + 1, s)
                      for k, s, d, size in zip(tap, strides, dilations, x.shape[2:]))
        full[(slice(None),) * 3 + index] += contribution
    full = full.reshape((batch, groups * per_group) + tuple(full_sizes))
    if str(pad_type) == "custom":
        pad = [int(p) for p in (pad if pad is not None else [0] * 2 * n)]
        begins = pad[0::2]
        sizes = [f - pad[2 * i] - pad[2 * i + 1] for i, f in enumerate(full_sizes)]
    elif str(pad_type) == "same":
        sizes = [d_in * s for d_in, s in zip(x.shape[2:], strides)]
        begins = [max(f - size, 0) // 2 for f, size in zip(full_sizes, sizes)]
    else:
        begins, sizes = [0] * n, list(full_sizes)
    if output_shape is not None:
        sizes = [int(o) for o in np.atleast_1d(output_shape)[2:]]
    out = np.zeros((batch, full.shape[1]) + tuple(sizes), np.float32)
    source = tuple(slice(b, min(b + size, f)) for b, size, f in zip(begins, sizes, full_sizes))
    target = tuple(slice(0, min(b + size, f) - b) for b, size, f in zip(begins, sizes, full_sizes))
    out[(slice(None),) * 2 + target] = full[(slice(None),) * 2 + source]
    if bias is not None:
        out = out + _f32(bias).reshape((1, -1) + (1,) * n)
    return out


def _pool(x, kernel_sizes, strides, pad_type, pad, ceil_mode, fill):
    """x's pooling windows (N, C, *D_out, *K), padded with `fill`, and the pads (before, after)
    per spatial axis that the spec's padding gives (the ceil-mode overhang not counted)."""
    n = x.ndim - 2
    ks = [int(k) for k in kernel_sizes]
    strides = [int(s) for s in (strides if strides is not None else [1] * n)]
    pads = _pads(pad_type, pad, x.shape[2:], ks, strides, [1] * n)
    windowed = pads
    if ceil_mode:  # the last window may start inside the input and end past its padding
        windowed = []
        for size, k, s, (b, a) in zip(x.shape[2:], ks, strides, pads):
            out = math.ceil((size + b + a - k) / s) + 1
            # The spec's (and PyTorch's) rule: a window must start inside the input or its left
            # padding; the spec applies it only to a padded axis.
            if (out - 1) * s >= size + b and b + a > 0:
                out -= 1
            windowed.append((b, max(a, (out - 1) * s + k - size - b)))
    return _windows(x, ks, strides, [1] * n, windowed, fill), n, pads


@kernel("max_pool")
def max_pool(x, kernel_sizes, strides=None, pad_type="valid", pad=None, ceil_mode=False):
    w, n, _ = _pool(np.asarray(x), kernel_sizes, strides, pad_type, pad, ceil_mode, -np.inf)
    return w.max(axis=tuple(range(-n, 0)))


@kernel("avg_pool")
def avg_pool(x, kernel_sizes, strides=None, pad_type="valid", pad=None,
             exclude_padding_from_average=False, ceil_mode=False):
    """The window's sum over its size. The size counts the input and the padding (only the
    input with exclude_padding_from_average), never the part of a ceil-mode window past the
    padding: the spec's ceil_mode is "same as PyTorch's", whose divisor clips the window to
    the padded input."""
    x = _f32(x)
    w, n, pads = _pool(x, kernel_sizes, strides, pad_type, pad, ceil_mode, 0)
    total = w.sum(axis=tuple(range(-n, 0)))
    strides = [int(s) for s in (strides if strides is not None else [1] * n)]
    count = np.ones((), np.float32)
    for axis, (size, k, s, (b, a)) in enumerate(zip(x.shape[2:], kernel_sizes, strides, pads)):
        start = np.arange(total.shape[2 + axis]) * s - b  # in input coordinates
        low, high = (0, size) if exclude_padding_from_average else (-b, size + a)
        inside = np.minimum(start + int(k), high) - np.maximum(start, low)
        count = np.multiply.outer(count, np.maximum(inside, 0).astype(np.float32))
    return total / count


# --- normalization (iOS15/normalization.py) -----------------------------------------


def _normalized(x, axes, epsilon):
    """x less its mean over `axes`, over the square root of its biased variance plus epsilon."""
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(epsilon))


def _affine(out, gamma, beta, shape):
    """`out * gamma + beta`, each (when given) reshaped to broadcast as `shape`."""
    if gamma is not None:
        out = out * _f32(gamma).reshape(shape)
    if beta is not None:
        out = out + _f32(beta).reshape(shape)
    return out


@kernel("layer_norm")
def layer_norm(x, axes=None, gamma=None, beta=None, epsilon=1e-5):
    x = _f32(x)
    axes = _axes(axes, x.ndim) or tuple(range(x.ndim))
    shape = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    return _affine(_normalized(x, axes, epsilon), gamma, beta, shape)


@kernel("batch_norm")
def batch_norm(x, mean, variance, gamma=None, beta=None, epsilon=1e-5):
    x = _f32(x)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    out = (x - _f32(mean).reshape(shape)) / np.sqrt(_f32(variance).reshape(shape) + np.float32(epsilon))
    return _affine(out, gamma, beta, shape)


@kernel("instance_norm")
def instance_norm(x, gamma=None, beta=None, epsilon=1e-5):
    """Each (n, c) normalized over its spatial axes (biased variance), then gamma_c and beta_c."""
    x = _f32(x)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return _affine(_normalized(x, tuple(range(2, x.ndim)), epsilon), gamma, beta, shape)


@kernel("l2_norm")
def l2_norm(x, epsilon=1e-6):
    """x / sqrt(sum of squares + epsilon), the sum over the last three axes (the rest is batch)."""
    x = _f32(x)
    squares = np.sum(x * x, axis=(-3, -2, -1), keepdims=True)
    return x / np.sqrt(squares + np.float32(epsilon))


# --- reductions (iOS15/reduction.py) ------------------------------------------------

_REDUCE = {
    "reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max, "reduce_min": np.min,
    "reduce_prod": np.prod,
    "reduce_sum_square": lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims),
    "reduce_l1_norm": lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims),
    "reduce_l2_norm": lambda x, axis, keepdims: np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims)),
    "reduce_log_sum": lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims)),
    "reduce_log_sum_exp": lambda x, axis, keepdims: _logsumexp(x, axis, keepdims),
}
for _name, _fn in _REDUCE.items():
    KERNELS[_name] = lambda x, axes=None, keep_dims=False, _fn=_fn: _fn(
        _f32(x), axis=_axes(axes, np.ndim(x)), keepdims=bool(keep_dims))


def _arg(fn):
    def run(x, axis=-1, keep_dims=False, output_dtype="int32"):
        out = fn(np.asarray(x), axis=int(axis))
        return np.expand_dims(out, int(axis)) if keep_dims else out

    return run


KERNELS["reduce_argmax"] = _arg(np.argmax)
KERNELS["reduce_argmin"] = _arg(np.argmin)


# --- tensor transformation and operation (iOS15-18 tensor_*.py, scatter_gather.py) --


@kernel("reshape")
def reshape(x, shape):
    """x in `shape`; -1 is inferred. A 0 takes the input's size along the axis matched from the
    right (iOS17: shape[i] matches x.shape[j] where len(shape) - i == rank(x) - j), 1 if there is
    none; iOS15/16 allow 0 only when len(shape) == rank(x), where that is the same axis."""
    x = np.asarray(x)
    shape = [int(s) for s in np.atleast_1d(shape)]
    offset = x.ndim - len(shape)
    shape = [(x.shape[i + offset] if 0 <= i + offset < x.ndim else 1) if s == 0 else s
             for i, s in enumerate(shape)]
    return x.reshape(shape)


@kernel("transpose")
def transpose(x, perm):
    return np.transpose(x, [int(p) for p in perm])


@kernel("squeeze")
def squeeze(x, axes=None):
    x = np.asarray(x)
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=_axes(axes, x.ndim))


@kernel("expand_dims")
def expand_dims(x, axes):
    x = np.asarray(x)
    rank = x.ndim + len(np.atleast_1d(axes))
    for axis in sorted(int(a) % rank for a in np.atleast_1d(axes)):
        x = np.expand_dims(x, axis)
    return x


@kernel("slice_by_index")
def slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    """x[begin[0]:end[0]:stride[0], ...]; begin_mask / end_mask drop begin / end; squeeze_mask[i]
    ignores end[i] and takes the one element at begin[i], its axis removed."""
    x = np.asarray(x)
    index, squeezed = _slice_index(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    out = x[index]
    return np.squeeze(out, axis=squeezed) if squeezed else out


@kernel("slice_by_size")
def slice_by_size(x, begin, size):
    """x[begin[i] : begin[i] + size[i]] per axis; size -1 runs to the end; a negative begin
    counts from the end of its axis."""
    x = np.asarray(x)
    index = []
    for n, b, s in zip(x.shape, np.atleast_1d(begin), np.atleast_1d(size)):
        b = int(b) + n if int(b) < 0 else int(b)
        index.append(slice(b, None) if int(s) == -1 else slice(b, b + int(s)))
    return x[tuple(index)]


@kernel("concat")
def concat(values, axis, interleave=False):
    """values joined along `axis`; rank-0 values count as length 1 there (the spec's type
    inference: scalars concatenate to a vector). `interleave`: out[i::n] = values[i] along axis."""
    values = [np.asarray(v) for v in values]
    if values and values[0].ndim == 0:
        values = [v.reshape(1) for v in values]
    axis = int(axis) % values[0].ndim
    if not interleave:
        return np.concatenate(values, axis=axis)
    # All the same shape: stack after `axis` and merge the two axes (v0[0], v1[0], v0[1], ...).
    stacked = np.stack(values, axis=axis + 1)
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


@kernel("split")
def split(x, num_splits=None, split_sizes=None, axis=0):
    x = np.asarray(x)
    axis = int(axis)
    if split_sizes is None:
        return tuple(np.split(x, int(num_splits), axis=axis))
    return tuple(np.split(x, np.cumsum([int(s) for s in split_sizes])[:-1], axis=axis))


@kernel("stack")
def stack(values, axis):
    return np.stack([np.asarray(v) for v in values], axis=int(axis))


@kernel("tile")
def tile(x, reps):
    return np.tile(x, [int(r) for r in reps])


def _take(x, indices, axis, batch_dims):
    if batch_dims == 0:
        return np.take(x, indices, axis=axis)
    return np.stack([_take(a, i, axis - 1, batch_dims - 1) for a, i in zip(x, indices)])


@kernel("gather")
def gather(x, indices, axis=0, batch_dims=0, validate_indices=False):
    x = np.asarray(x)
    return _take(x, np.asarray(indices).astype(np.int64), int(axis) % x.ndim, int(batch_dims))


@kernel("gather_along_axis")
def gather_along_axis(x, indices, axis=0, validate_indices=False):
    x = np.asarray(x)
    indices = np.asarray(indices).astype(np.int64)
    indices = np.where(indices < 0, indices + x.shape[int(axis)], indices)
    return np.take_along_axis(x, indices, axis=int(axis))


@kernel("select")
def select(cond, a, b):
    return np.where(np.asarray(cond).astype(bool), a, b)


@kernel("fill")
def fill(shape, value=0.0):
    return np.full([int(s) for s in np.atleast_1d(shape)], value)


@kernel("fill_like")
def fill_like(ref_tensor, value=0.0):
    return np.full(np.shape(ref_tensor), value)


@kernel("range_1d")
def range_1d(end, start, step):
    return np.arange(start, end, step)


@kernel("shape")
def shape(x):
    return np.asarray(np.shape(x), np.int32)


@kernel("cumsum")
def cumsum(x, axis=0, exclusive=False, reverse=False):
    x = np.asarray(x)
    axis = int(axis)
    if reverse:
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=x.dtype)
    if exclusive:
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=axis)),
                              np.take(out, range(out.shape[axis] - 1), axis=axis)], axis=axis)
    return np.flip(out, axis) if reverse else out


@kernel("pad")
def pad(x, pad, mode="constant", constant_val=0.0):
    x = np.asarray(x)
    pad = [int(p) for p in pad]
    widths = [(0, 0)] * (x.ndim - len(pad) // 2) + [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    if mode == "constant":
        return np.pad(x, widths, constant_values=constant_val)
    return np.pad(x, widths, mode={"reflect": "reflect", "replicate": "edge"}[str(mode)])


@kernel("topk")
def topk(x, k=1, axis=-1, ascending=False, sort=True, return_indices=True, output_indices_dtype="int32"):
    """The k largest (smallest if ascending) values along axis, sorted, and their indices; iOS16:
    only the values when return_indices is False (sort=False allows any order: sorted is one)."""
    x = np.asarray(x)
    axis = int(axis)
    order = np.argsort(x if ascending else -x, axis=axis, kind="stable")
    indices = np.take(order, range(int(k)), axis=axis)
    values = np.take_along_axis(x, indices, axis=axis)
    return (values, indices) if return_indices else values


@kernel("gather_nd")
def gather_nd(x, indices, batch_dims=0, validate_indices=False):
    """out[b..., i...] = x[b..., *indices[b..., i..., :]] (iOS16: `batch_dims` leading axes shared)."""
    x, indices = np.asarray(x), np.asarray(indices).astype(np.int64)
    batch_dims = int(batch_dims)
    depth = indices.shape[-1]
    batch = x.shape[:batch_dims]
    xs = x.reshape((-1,) + x.shape[batch_dims:])
    ids = indices.reshape((-1,) + indices.shape[batch_dims:])
    parts = [a[tuple(np.moveaxis(i, -1, 0))] for a, i in zip(xs, ids)]
    return np.stack(parts).reshape(batch + indices.shape[batch_dims:-1] + x.shape[batch_dims + depth:])


_SCATTER = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "max": np.maximum, "min": np.minimum,
}


@kernel("scatter")
def scatter(data, indices, updates, axis=0, mode="add", validate_indices=False):
    """data with data[..., indices[i], ...] (at `axis`) = or op= updates[..., i, ...].

    The spec's default mode is "add" (`default_inputs`; its docstring says "update").
    Repeated indices: "update" keeps the last, the other modes apply every update in turn.
    """
    out = np.array(data, copy=True)
    axis = int(axis) % out.ndim
    indices = np.asarray(indices).astype(np.int64).reshape(-1)
    indices = np.where(indices < 0, indices + out.shape[axis], indices)  # iOS15 allows negatives
    return _scatter_into(out, (slice(None),) * axis + (indices,), updates, mode)


def _scatter_into(out, index, updates, mode):
    """out[index] = updates ("update": a repeated index keeps the last) or op= them in turn."""
    updates = np.asarray(updates).astype(out.dtype, copy=False)
    mode = str(mode)
    if mode == "update":
        out[index] = updates
    elif mode in _SCATTER:
        _SCATTER[mode].at(out, index, updates)
    else:
        raise ValueError(f"scatter mode {mode!r}")
    return out


def _slice_index(shape, begin, end, stride, begin_mask, end_mask, squeeze_mask):
    """slice_by_index's index (a slice per axis, every axis kept) and the axes squeeze_mask
    removes. As the spec's own slicing (`solve_slice_by_index_slice`): a masked begin or end is
    open; a squeezed axis ignores end and stride and steps past the axis, so it keeps the one
    element at begin (the first one if begin is masked)."""
    rank = len(shape)
    stride = [1] * rank if stride is None else [int(s) for s in np.atleast_1d(stride)]
    begin_mask = [False] * rank if begin_mask is None else [bool(m) for m in np.atleast_1d(begin_mask)]
    end_mask = [False] * rank if end_mask is None else [bool(m) for m in np.atleast_1d(end_mask)]
    squeeze_mask = [False] * rank if squeeze_mask is None else [bool(m) for m in np.atleast_1d(squeeze_mask)]
    index = []
    for n, b, e, s, bm, em, sq in zip(shape, np.atleast_1d(begin), np.atleast_1d(end), stride,
                                      begin_mask, end_mask, squeeze_mask):
        start = None if bm else int(b)
        if sq:
            index.append(slice(start, None, n + 1))
        else:
            index.append(slice(start, None if em else int(e), s))
    return tuple(index), tuple(i for i, sq in enumerate(squeeze_mask) if sq)


@kernel("slice_update")
def slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    """x with x[slice_by_index(begin, end, stride, masks)] = update (iOS18)."""
    out = np.array(x, copy=True)
    index, squeezed = _slice_index(out.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    target = out[index].shape
    expected = tuple(n for i, n in enumerate(target) if i not in squeezed)
    update = np.asarray(update)
    if tuple(update.shape) != expected:
        raise ValueError(f"slice_update: update shape {update.shape}, slice shape {expected}")
    out[index] = update.astype(out.dtype, copy=False).reshape(target)
    return out


@kernel("scatter_nd")
def scatter_nd(data, indices, updates, mode="add", validate_indices=False):
    """data with data[*indices[i..., :]] = or op= updates[i...] (default mode "add", as the spec)."""
    out = np.array(data, copy=True)
    indices = np.asarray(indices).astype(np.int64)
    return _scatter_into(out, tuple(np.moveaxis(indices, -1, 0)), updates, mode)


# --- more tensor operations (iOS15/tensor_operation.py, tensor_transformation.py,
# scatter_gather.py, image_resizing.py; iOS16 pixel_unshuffle) ------------------------


@kernel("reverse")
def reverse(x, axes=None):
    """x reversed along `axes` (every axis if None)."""
    x = np.asarray(x)
    return np.flip(x, axis=None if axes is None else _axes(axes, x.ndim))


@kernel("argsort")
def argsort(x, axis=-1, ascending=False):
    """The indices that sort x along axis, descending unless ascending (ties: first index first)."""
    x = np.asarray(x)
    key = x if ascending else -x.astype(np.float64) if x.dtype.kind in "iu" else -x
    return np.argsort(key, axis=int(axis), kind="stable")


@kernel("one_hot")
def one_hot(indices, one_hot_vector_size, axis=-1, on_value=1, off_value=0):
    """A new axis (at `axis` of the output) of length one_hot_vector_size: on_value where its
    position equals the index, off_value elsewhere (an index out of range has none)."""
    indices = np.asarray(indices).astype(np.int64)
    depth = int(np.asarray(one_hot_vector_size).reshape(-1)[0])
    axis = int(axis) % (indices.ndim + 1)
    positions = np.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    hit = np.expand_dims(indices, axis) == positions
    return np.where(hit, on_value, off_value)


@kernel("band_part")
def band_part(x, lower=-1, upper=-1):
    """x where (lower < 0 or m - n <= lower) and (upper < 0 or n - m <= upper) on the last two
    axes (m the row, n the column), 0 elsewhere."""
    x = np.asarray(x)
    m = np.arange(x.shape[-2])[:, None]
    n = np.arange(x.shape[-1])[None, :]
    lower, upper = int(lower), int(upper)
    keep = ((lower < 0) | (m - n <= lower)) & ((upper < 0) | (n - m <= upper))
    return np.where(keep, x, np.zeros((), x.dtype))


@kernel("scatter_along_axis")
def scatter_along_axis(data, indices, updates, axis=0, mode="add", validate_indices=False):
    """data with data[p_0, .., indices[p], .., p_D] (the index replacing position `axis`) = or
    op= updates[p], for every position p of indices (default mode "add", as the spec)."""
    out = np.array(data, copy=True)
    axis = int(axis) % out.ndim
    indices = np.asarray(indices).astype(np.int64)
    indices = np.where(indices < 0, indices + out.shape[axis], indices)
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = indices
    return _scatter_into(out, tuple(grid), updates, mode)


@kernel("pixel_shuffle")
def pixel_shuffle(x, upscale_factor):
    """[n, C * f * f, H, W] -> [n, C, H * f, W * f], as PyTorch's PixelShuffle."""
    x = np.asarray(x)
    f = int(upscale_factor)
    n, c, h, w = x.shape
    out = x.reshape(n, c // (f * f), f, f, h, w).transpose(0, 1, 4, 2, 5, 3)
    return out.reshape(n, c // (f * f), h * f, w * f)


@kernel("pixel_unshuffle")
def pixel_unshuffle(x, downscale_factor):
    """[n, C, H * f, W * f] -> [n, C * f * f, H, W], as PyTorch's PixelUnshuffle (iOS16)."""
    x = np.asarray(x)
    f = int(downscale_factor)
    n, c, h, w = x.shape
    out = x.reshape(n, c, h // f, f, w // f, f).transpose(0, 1, 3, 5, 2, 4)
    return out.reshape(n, c * f * f, h // f, w // f)


@kernel("upsample_nearest_neighbor")
def upsample_nearest_neighbor(x, scale_factor_height=1, scale_factor_width=1):
    """The last two axes scaled to floor(size * scale); output i takes input floor(i / scale)."""
    x = np.asarray(x)
    for axis, scale in ((-2, scale_factor_height), (-1, scale_factor_width)):
        size = x.shape[axis]
        out = int(np.floor(size * float(scale)))
        source = np.minimum(np.floor(np.arange(out) / np.float64(scale)).astype(np.int64), size - 1)
        x = np.take(x, source, axis=axis)
    return x


def _linear_weights(size_in, size_out, align_corners):
    """The spec's bilinear grid for one axis: (lower index, upper index, upper weight)."""
    i = np.arange(size_out, dtype=np.float64)
    if align_corners:
        spacing = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
        grid = i * spacing
    else:
        spacing = size_in / size_out
        grid = i * spacing + 0.5 * spacing - 0.5
    grid = np.clip(grid, 0, size_in - 1)
    low = np.floor(grid).astype(np.int64)
    high = np.minimum(low + 1, size_in - 1)
    return low, high, grid - low


@kernel("upsample_bilinear")
def upsample_bilinear(x, scale_factor_height=1, scale_factor_width=1, align_corners=True):
    """The last two axes scaled to floor(size * scale), each output the linear interpolation
    of the input at the spec's grid point (align_corners: i * (in - 1) / (out - 1); else
    i * in / out + 0.5 * in / out - 0.5), clipped to [0, in - 1]."""
    x = _f32(x)
    for axis, scale in ((-2, scale_factor_height), (-1, scale_factor_width)):
        size = x.shape[axis]
        low, high, weight = _linear_weights(size, int(np.floor(size * float(scale))), bool(align_corners))
        shape = [1] * x.ndim
        shape[axis] = -1
        weight = weight.reshape(shape).astype(np.float32)
        x = np.take(x, low, axis=axis) * (1 - weight) + np.take(x, high, axis=axis) * weight
    return x


@kernel("crop")
def crop(x, crop_height, crop_width):
    """The last two axes cropped: crop_height = (top, bottom), crop_width = (left, right)."""
    x = np.asarray(x)
    (top, bottom), (left, right) = [int(c) for c in crop_height], [int(c) for c in crop_width]
    return x[..., top:x.shape[-2] - bottom, left:x.shape[-1] - right]


# --- compression and quantization (iOS16/constexpr_ops.py, iOS17/quantization_ops.py,
# iOS18/compression.py): the weights of quantized models, the activations of PT2E's -----


def _along(param, rank: int, axis) -> np.ndarray:
    """A scale or zero point given as a scalar, or per element of `axis`, shaped to broadcast
    against a rank-`rank` tensor."""
    param = np.asarray(param)
    if param.ndim in (0, rank):
        return param
    shape = [1] * rank
    shape[int(axis) % rank] = param.size
    return param.reshape(shape)


def _blocks(param, shape) -> np.ndarray:
    """`param` with each entry repeated over its block, to `shape` (block size per axis:
    shape // param.shape)."""
    for axis, (size, count) in enumerate(zip(shape, np.shape(param))):
        param = np.repeat(param, size // count, axis=axis)
    return param


@kernel("constexpr_affine_dequantize")
def constexpr_affine_dequantize(quantized_data, zero_point, scale, axis):
    """scale * (quantized_data - zero_point), the two per element of `axis` or scalars; the
    definition computes in float32 and rounds once to scale's dtype (iOS16)."""
    data = np.asarray(quantized_data)
    zero = _along(zero_point, data.ndim, axis).astype(np.float32)
    scale = np.asarray(scale)
    out = (data.astype(np.float32) - zero) * _along(scale, data.ndim, axis)
    return out.astype(scale.dtype)


@kernel("constexpr_blockwise_shift_scale")
def constexpr_blockwise_shift_scale(data, scale, offset=None):
    """scale * (data - offset), scale and offset of data's rank with one entry per block
    (block size data.shape // scale.shape), in scale's dtype (iOS18)."""
    scale = np.asarray(scale)
    data = np.asarray(data).astype(scale.dtype)
    if offset is not None:
        data = data - _blocks(np.asarray(offset).astype(scale.dtype), data.shape)
    return _blocks(scale, data.shape) * data


@kernel("constexpr_lut_to_dense")
def constexpr_lut_to_dense(indices, lut, vector_axis=None):
    """Each index replaced by its entry of the table of its block (iOS18): lut is
    [tables along each axis of indices..., 2**nbits, VECTOR_SIZE]; a vector entry fills
    VECTOR_SIZE consecutive positions along vector_axis."""
    indices, lut = np.asarray(indices).astype(np.intp), np.asarray(lut)
    rank = indices.ndim
    tables = tuple(
        (np.arange(size) // (size // count)).reshape([-1 if a == axis else 1 for a in range(rank)])
        for axis, (size, count) in enumerate(zip(indices.shape, lut.shape[:rank]))
    )
    entries = lut[(*tables, indices)]  # indices.shape + [VECTOR_SIZE]
    if lut.shape[-1] == 1:
        return entries[..., 0]
    axis = int(vector_axis) % rank
    shape = list(indices.shape)
    shape[axis] *= lut.shape[-1]
    return np.moveaxis(entries, -1, axis + 1).reshape(shape)


@kernel("quantize")
def quantize(input, scale, output_dtype, zero_point=None, axis=None):
    """clip(round(input / scale) + zero_point) to output_dtype's range; input / scale in the
    input's dtype, rounded half to even (iOS17)."""
    x = np.asarray(input)
    dtype = DTYPES[str(output_dtype)]
    q = np.rint(x / _along(np.asarray(scale).astype(x.dtype), x.ndim, axis)).astype(np.float32)
    if zero_point is not None:
        q = q + _along(zero_point, x.ndim, axis).astype(np.float32)
    limits = np.iinfo(dtype)
    return np.clip(q, limits.min, limits.max).astype(dtype)


@kernel("dequantize")
def dequantize(input, scale, zero_point=None, axis=None):
    """scale * (input - zero_point), computed in float32 and rounded once to scale's dtype (iOS17)."""
    x = np.asarray(input)
    scale = np.asarray(scale)
    out = x.astype(np.float32)
    if zero_point is not None:
        out = out - _along(zero_point, x.ndim, axis).astype(np.float32)
    return (out * _along(scale, x.ndim, axis)).astype(scale.dtype)
