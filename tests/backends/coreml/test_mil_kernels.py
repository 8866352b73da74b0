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
    for a, e in zip(both, expected, strict=True):
        _same(a, e)
    _same(both[0], torch.topk(torch.from_numpy(x), 3, dim=0, largest=False).values.numpy())


# --- pooling -------------------------------------------------------------------------


@pytest.mark.parametrize("kernel, stride, padding, include_pad, size", [
    (3, 2, 1, True, 8),    # the last window overhangs the padding: PyTorch divides by its clipped size
    (3, 2, 1, False, 8),
    (2, 3, 0, True, 8),
    (3, 3, 1, True, 7),
])
def test_avg_pool_ceil_mode_divides_as_pytorch(kernel, stride, padding, include_pad, size):
    """The spec's ceil_mode is "same as PyTorch's": a window's divisor counts the input and the
    padding (only the input when excluding padding), never the ceil-mode overhang past it."""
    x = torch.randn(1, 2, size, size, generator=torch.Generator().manual_seed(0))
    pad_type, pad = ("custom", [padding] * 4) if padding else ("valid", None)
    out = _run("avg_pool", x=x.numpy(), kernel_sizes=[kernel, kernel], strides=[stride, stride], pad_type=pad_type,
               pad=pad, exclude_padding_from_average=not include_pad, ceil_mode=True)
    expected = torch.nn.functional.avg_pool2d(x, kernel, stride, padding, ceil_mode=True, count_include_pad=include_pad)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size, kernel, stride, padding", [(6, 2, 3, 0), (6, 2, 3, 1), (7, 3, 2, 1), (4, 1, 4, 0)])
def test_max_pool_ceil_mode_output_size_is_the_specs(size, kernel, stride, padding):
    """The spec drops a last window that starts past the input only on a padded axis (PyTorch
    drops it always, so for (6, 2, 3, 0) and (4, 1, 4, 0) the program's shape is not eager's:
    the kernel gives the shape the program declares, and the windows both have agree)."""
    x = np.random.default_rng(0).standard_normal((1, 2, size, size)).astype(np.float32)
    pad_type, pad = ("custom", np.array([padding] * 4, np.int32)) if padding else ("valid", None)
    args = dict(kernel_sizes=[kernel, kernel], strides=[stride, stride], pad_type=pad_type, ceil_mode=True)
    if pad is not None:
        args["pad"] = pad
    with Function({"x": mb.placeholder(shape=x.shape)}) as f:
        declared = mb.max_pool(x=f.inputs["x"], **args).shape
    out = _run("max_pool", x=x, **args)
    assert out.shape == tuple(declared)
    windows = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel, stride, padding, ceil_mode=True)
    rows = min(out.shape[2], windows.shape[2])
    np.testing.assert_array_equal(out[:, :, :rows, :rows], windows.numpy()[:, :, :rows, :rows])


# --- convolution and normalization ----------------------------------------------------


@pytest.mark.parametrize("dims, groups, stride, padding, dilation, output_padding", [
    (2, 1, 2, 1, 1, 1),
    (2, 2, (2, 3), (1, 2), (2, 1), 0),
    (1, 2, 2, 1, 2, 0),
    (3, 1, 2, 1, 1, 0),
])
def test_conv_transpose_matches_torch(dims, groups, stride, padding, dilation, output_padding):
    """Weight [C_in, C_out / groups, *K]; custom pad crops the full output; output_shape (how
    coremltools converts output_padding) keeps the same start and sets the size."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((1, 4) + (5,) * dims, generator=gen)
    conv = [None, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d][dims](
        4, 6, 3, stride=stride, padding=padding, dilation=dilation, groups=groups, output_padding=output_padding)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        expected = conv(x).numpy()
    expand = lambda v: list(v) if isinstance(v, tuple) else [v] * dims
    pad = [p for p in expand(padding) for _ in range(2)]
    out = _run("conv_transpose", x=x.numpy(), weight=conv.weight.detach().numpy(), bias=conv.bias.detach().numpy(),
               pad=pad, pad_type="custom", strides=expand(stride), dilations=expand(dilation), groups=groups,
               output_shape=list(expected.shape) if output_padding else None)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_conv_transpose_same_padding_output_size():
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 4)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((2, 3, 3, 3)).astype(np.float32)
    with Function({"x": mb.placeholder(shape=x.shape)}) as f:
        declared = mb.conv_transpose(x=f.inputs["x"], weight=w, pad_type="same", strides=[2, 2]).shape
    assert _run("conv_transpose", x=x, weight=w, pad_type="same", strides=[2, 2]).shape == tuple(declared)


def test_instance_norm_and_l2_norm():
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2))
    gamma, beta = torch.rand(3) + 0.5, torch.randn(3)
    out = _run("instance_norm", x=x.numpy(), gamma=gamma.numpy(), beta=beta.numpy(), epsilon=1e-3)
    expected = torch.nn.functional.instance_norm(x, weight=gamma, bias=beta, eps=1e-3)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)
    x3 = x.numpy()[0]
    np.testing.assert_allclose(_run("l2_norm", x=x3, epsilon=1e-6), _spec("l2_norm", x=x3, epsilon=1e-6), rtol=1e-6)
    batched = _run("l2_norm", x=x.numpy())
    np.testing.assert_allclose(batched[1], x.numpy()[1] / np.sqrt((x.numpy()[1] ** 2).sum() + 1e-6), rtol=1e-6)


# --- activations ---------------------------------------------------------------------


def test_parametric_activations_follow_the_spec():
    x = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32) * 3
    alpha, beta = np.float32(0.3), np.float32(1.5)
    for op in ("clamped_relu", "scaled_tanh"):
        np.testing.assert_allclose(_run(op, x=x, alpha=alpha, beta=beta), _spec(op, x=x, alpha=alpha, beta=beta),
                                   rtol=1e-6)
    np.testing.assert_array_equal(_run("thresholded_relu", x=x, alpha=alpha), _spec("thresholded_relu", x=x, alpha=alpha))
    alphas, betas = np.array([0.5, 1.0, 2.0], np.float32), np.array([2.0, 1.0, 0.5], np.float32)
    np.testing.assert_allclose(_run("softplus_parametric", x=x, alpha=alphas, beta=betas),
                               _spec("softplus_parametric", x=x, alpha=alphas, beta=betas), rtol=1e-6)


# --- tensor operations -----------------------------------------------------------------


def test_reverse_argsort_band_part_follow_the_spec():
    x = np.random.default_rng(4).permutation(60).reshape(3, 4, 5).astype(np.float32)
    for axes in (None, [0], [-1, 1]):
        kwargs = {} if axes is None else {"axes": np.array(axes, np.int32)}
        _same(_run("reverse", x=x, **kwargs), _spec("reverse", x=x, **kwargs))
    for axis, ascending in ((-1, False), (0, True), (1, False)):
        _same(_run("argsort", x=x, axis=axis, ascending=ascending), _spec("argsort", x=x, axis=axis, ascending=ascending))
    ties = np.array([3, 1, 3, 2, 1], np.float32)
    _same(_run("argsort", x=ties), [0, 2, 3, 1, 4])  # descending; equal values keep their order
    for lower, upper in ((0, -1), (-1, 0), (1, 2), (0, 0)):
        _same(_run("band_part", x=x, lower=lower, upper=upper), _spec("band_part", x=x, lower=lower, upper=upper))


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_places_the_new_axis(axis):
    indices = np.array([[0, 3], [2, 5]], np.int32)  # 5 is out of range: all off
    out = _run("one_hot", indices=indices, one_hot_vector_size=4, axis=axis, on_value=np.float32(2), off_value=np.float32(-1))
    expected = torch.nn.functional.one_hot(torch.from_numpy(indices).long().clamp(max=4), 5)[..., :4].numpy() * 3 - 1
    _same(out, np.moveaxis(expected.astype(np.float32), -1, axis))


@pytest.mark.parametrize("mode", ["update", "add", "mul", "max"])
def test_scatter_along_axis_follows_the_spec(mode):
    data = np.random.default_rng(5).standard_normal((3, 5)).astype(np.float32)
    indices = np.array([[0, 4], [2, -2], [1, 1]], np.int32)  # a negative index counts from the end
    updates = np.random.default_rng(6).standard_normal((3, 2)).astype(np.float32)
    out = _run("scatter_along_axis", data=data, indices=indices, updates=updates, axis=1, mode=mode)
    if mode != "update":  # coremltools' value inference does only "update"
        torch_mode = {"add": "sum", "mul": "prod", "max": "amax"}[mode]
        expected = torch.from_numpy(data).scatter_reduce(
            1, torch.from_numpy(indices % 5).long(), torch.from_numpy(updates), torch_mode).numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-6)
    else:
        _same(out, _spec("scatter_along_axis", data=data, indices=indices, updates=updates, axis=1, mode=mode))


def test_pixel_shuffle_unshuffle_and_crop():
    x = torch.randn(1, 8, 3, 5, generator=torch.Generator().manual_seed(7))
    _same(_run("pixel_shuffle", x=x.numpy(), upscale_factor=2), torch.nn.functional.pixel_shuffle(x, 2).numpy())
    y = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(8))
    _same(_run("pixel_unshuffle", x=y.numpy(), downscale_factor=2), torch.nn.functional.pixel_unshuffle(y, 2).numpy())
    _same(_run("crop", x=y.numpy(), crop_height=[1, 2], crop_width=[0, 1]), y.numpy()[..., 1:4, 0:3])


@pytest.mark.parametrize("scale", [2.0, 1.5, 0.5])
def test_upsample_nearest_neighbor_matches_torch(scale):
    x = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(9))
    expected = torch.nn.functional.interpolate(x, scale_factor=scale, mode="nearest")
    _same(_run("upsample_nearest_neighbor", x=x.numpy(), scale_factor_height=scale, scale_factor_width=scale),
          expected.numpy())


@pytest.mark.parametrize("scale, align_corners", [(2.0, False), (2.0, True), (1.75, False), (1.75, True), (0.5, False)])
def test_upsample_bilinear_follows_the_spec_grid(scale, align_corners):
    """The spec's grid is PyTorch's with recompute_scale_factor=True (the scale from the sizes)."""
    x = torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(10))
    out = _run("upsample_bilinear", x=x.numpy(), scale_factor_height=scale, scale_factor_width=scale,
               align_corners=align_corners)
    expected = torch.nn.functional.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=align_corners,
                                               recompute_scale_factor=True)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-6)
    # The spec's example: Xin = 2, Xout = 5.
    line = np.array([[[0.0, 1.0]]], np.float32)
    grid = _run("upsample_bilinear", x=line, scale_factor_height=1, scale_factor_width=2.5, align_corners=False)
    np.testing.assert_allclose(grid[0, 0], [0, 0.1, 0.5, 0.9, 1], atol=1e-6)


# --- real_div of integers, non_zero ---------------------------------------------------


def test_real_div_of_int32_is_int32_truncated_as_the_definition_casts():
    x, y = np.array([7, -7, 9], dtype=np.int32), np.array([2, 2, 3], dtype=np.int32)
    got = _run("real_div", x=x, y=y)
    assert got.dtype == np.int32
    _same(got, _spec("real_div", x=x, y=y).astype(np.int32))
    _same(got, np.array([3, -3, 3], dtype=np.int32))


def test_non_zero_gives_one_index_row_per_nonzero_element():
    x = np.array([[0, 1.5, 0], [2, 0, -1]], dtype=np.float32)
    got = _run("non_zero", x=x)
    assert got.dtype == np.int32
    _same(got, _spec("non_zero", x=x).astype(np.int32))
