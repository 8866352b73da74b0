"""The MIL kernels (`compiler/backends/coreml/mil_kernels.py`) against the MIL op specification.

Each case builds the op with coremltools' MIL Builder on constant inputs, so coremltools
computes the op's value from its own definition (`value_inference` in `mil/ops/defs`), and
compares it with the kernel run on the same inputs; where the definition computes no value
(or does not implement the case), the test states the spec's rule and checks it with numpy
or torch. Fast: no compile, no model.
"""

import numpy as np
import pytest
import torch

import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function

from compiler.backends.coreml.mil_kernels import KERNELS


def _spec(op_type, target=ct.target.iOS15, **inputs):
    """The value coremltools' definition of `op_type` (at opset `target`) gives these const inputs."""
    with Function({}, opset_version=target):
        out = getattr(mb, op_type)(**inputs)
    values = tuple(v.val for v in out) if isinstance(out, (list, tuple)) else out.val
    assert values is not None, f"coremltools computes no value for {op_type} here"
    return values


def _run(op_type, **inputs):
    return KERNELS[op_type](**inputs)


def _same(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_array_equal(actual, expected)


# --- concat ------------------------------------------------------------------------


def test_concat_of_scalars_is_a_vector():
    """Rank-0 values count as length 1 along the axis (found in the Llama static-cache step:
    the cache update's slice begin is a concat of four int32 scalars)."""
    values = [np.int32(0), np.int32(3), np.int32(0), np.int32(7)]
    _same(_run("concat", values=values, axis=0), _spec("concat", values=values, axis=0))
    _same(_run("concat", values=values, axis=0), [0, 3, 0, 7])


def test_concat_interleave_follows_the_spec_example():
    in1 = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    in2 = np.array([[7, 8], [9, 10], [11, 12]], np.int32)
    _same(_run("concat", values=[in1, in2], axis=0, interleave=True),
          [[1, 2], [7, 8], [3, 4], [9, 10], [5, 6], [11, 12]])
    _same(_run("concat", values=[in1, in2], axis=0), _spec("concat", values=[in1, in2], axis=0))
    # Along the last axis, three inputs: out[..., i::3] = values[i].
    a, b, c = (np.random.default_rng(i).standard_normal((2, 4)).astype(np.float32) for i in range(3))
    out = _run("concat", values=[a, b, c], axis=-1, interleave=True)
    assert out.shape == (2, 12)
    for i, v in enumerate((a, b, c)):
        _same(out[:, i::3], v)


# --- reshape -------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape, shape", [
    ((2, 3, 4), (0, -1)),        # iOS17: shape[0] matches x.shape[1] (from the right): (3, 8)
    ((2, 50), (1, 0, -1, 0)),    # the spec's example: [1, 1, 2, 50]
    ((2, 3, 4), (0, 0, 4)),      # same rank: 0 keeps that axis (iOS15 too)
    ((6, 4), (-1, 2, 0)),
])
def test_reshape_zero_matches_from_the_right(x_shape, shape):
    x = np.arange(np.prod(x_shape), dtype=np.float32).reshape(x_shape)
    shape = np.array(shape, np.int32)
    expected = _spec("reshape", target=ct.target.iOS17, x=x, shape=shape)
    _same(_run("reshape", x=x, shape=shape), expected)


def test_reshape_spec_example():
    x = np.zeros((2, 50), np.float32)
    assert _run("reshape", x=x, shape=np.array([1, 0, -1, 0], np.int32)).shape == (1, 1, 2, 50)


# --- slicing -------------------------------------------------------------------------

_X = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)


@pytest.mark.parametrize("args", [
    dict(begin=[1, 0, 2], end=[3, 5, 6]),
    dict(begin=[-3, 0, 0], end=[-1, 5, 6], stride=[1, 2, 3]),
    dict(begin=[3, 4, 5], end=[0, 0, 0], stride=[-1, -2, -1], begin_mask=[False, False, True],
         end_mask=[True, True, False]),
    # squeeze_mask ignores end: the element at begin (end here would give an empty or longer slice)
    dict(begin=[2, 1, 0], end=[0, 4, 6], squeeze_mask=[True, False, False]),
    dict(begin=[-1, 0, 3], end=[0, 0, 1], end_mask=[False, True, False], squeeze_mask=[True, False, True]),
    dict(begin=[0, 0, 0], end=[0, 0, 0], begin_mask=[True, True, True], end_mask=[True, True, False],
         squeeze_mask=[False, False, True]),
])
def test_slice_by_index_follows_the_spec(args):
    args = {k: np.array(v, np.int32 if k in ("begin", "end", "stride") else bool) for k, v in args.items()}
    _same(_run("slice_by_index", x=_X, **args), _spec("slice_by_index", x=_X, **args))


@pytest.mark.parametrize("begin, size", [([1, 0, 2], [2, -1, 3]), ([-3, -5, -1], [2, 5, 1]), ([-2, 1, -4], [-1, 3, -1])])
def test_slice_by_size_counts_a_negative_begin_from_the_end(begin, size):
    begin, size = np.array(begin, np.int32), np.array(size, np.int32)
    _same(_run("slice_by_size", x=_X, begin=begin, size=size), _spec("slice_by_size", x=_X, begin=begin, size=size))


def test_slice_update_with_squeeze_mask_writes_the_element_at_begin():
    """iOS18 slice_update takes slice_by_index's slice: a squeezed axis is the one index at begin."""
    begin, end = np.array([2, 1, 0], np.int32), np.array([0, 4, 6], np.int32)
    masks = dict(squeeze_mask=np.array([True, False, False]))
    update = -np.ones((3, 6), np.float32)
    out = _run("slice_update", x=_X, update=update, begin=begin, end=end, **masks)
    expected = _X.copy()
    expected[2, 1:4, :] = update
    _same(out, expected)
    _same(out, _spec("slice_update", target=ct.target.iOS18, x=_X, update=update, begin=begin, end=end, **masks))


# --- topk ----------------------------------------------------------------------------


def test_topk_without_indices_returns_the_values_only():
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    values = _run("topk", x=x, k=3, axis=-1, return_indices=False)
    assert isinstance(values, np.ndarray)
    _same(values, _spec("topk", target=ct.target.iOS16, x=x, k=3, axis=-1, return_indices=False))
    both = _run("topk", x=x, k=3, axis=0, ascending=True)
    expected = _spec("topk", target=ct.target.iOS16, x=x, k=3, axis=0, ascending=True)
    for a, e in zip(both, expected):
        _same(a, e)
    _same(both[0], torch.topk(torch.from_numpy(x), 3, dim=0, largest=False).values.numpy())
