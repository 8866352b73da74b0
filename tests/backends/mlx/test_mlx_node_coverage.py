"""The MLX reference runner runs every node type of the MLX delegate's schema, each as
the C++ runtime (backends/mlx/runtime/MLXInterpreter.h) does it.

Node types that this ExecuTorch's handlers emit are tested end to end: a small torch
module compiled for MLX, run by the reference executor, compared with eager torch,
and the payload checked to hold the node type under test. Node types no handler of
this version emits for a plain torch op (or that the pipeline decomposes away) are
tested by calling their function on a bare interpreter, against numpy or torch.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch

import compiler
from compiler.backends.mlx.generated import ensure_generated
from compiler.backends.mlx.interpreter import (
    NODE_FUNCTIONS,
    UNSUPPORTED_NODES,
    Interpreter,
    MLXGraph,
    MLXNodeFailure,
    Node,
    Tid,
    UnsupportedMLXNode,
    Vid,
)
from compiler.backends.mlx.nodes_core import random_bits
from compiler.running.reference import ReferenceExecutor

TOLERANCE = 1e-4


# --- helpers ----------------------------------------------------------------------------


def _payload_kinds(artifact) -> set[str]:
    program = ReferenceExecutor(artifact.pte).program
    kinds: set[str] = set()
    for data in program.backend_delegate_data:
        kinds |= MLXGraph(bytes(data.data)).node_kinds()
    return kinds


def _compile_and_compare(model, inputs, kinds: set[str], tolerance: float = TOLERANCE):
    """Compile for MLX, check the payload holds `kinds`, run it here and compare with eager."""
    artifact = compiler.compile(copy.deepcopy(model), inputs, backend="mlx")
    assert kinds <= _payload_kinds(artifact), _payload_kinds(artifact)
    got = compiler.run(artifact, inputs)
    with torch.no_grad():
        expected = model(*inputs)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
        torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=tolerance)
    return artifact


class _Fn(torch.nn.Module):
    def __init__(self, fn, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)
        self.fn = fn

    def forward(self, *args):
        return self.fn(self, *args)


def _bare(chains=()) -> Interpreter:
    """An interpreter with no payload: slots are set by hand, chains are lists of Nodes."""
    it = Interpreter.__new__(Interpreter)
    it.graph = SimpleNamespace(chains=list(chains))
    it.tensors, it.values, it.kv_cache = {}, {}, None
    return it


def _run(kind: str, fields: dict, tensors: dict[int, np.ndarray | mx.array], values=None, chains=()):
    it = _bare(chains)
    for idx, array in tensors.items():
        it.tensors[idx] = mx.array(array)
    it.values.update(values or {})
    NODE_FUNCTIONS[kind](it, fields)
    return it


def _np(array: mx.array) -> np.ndarray:
    return np.array(array)


# --- schema coverage --------------------------------------------------------------------


def test_every_schema_node_type_has_a_function_or_a_named_reason():
    ensure_generated()
    from executorch.backends.mlx._generated_inspector import OP_NODE_FIELDS
    from executorch.backends.mlx.serialization._generated.mlx_delegate.OpNode import OpNode

    schema = set(OP_NODE_FIELDS)
    enum = {name for name, value in vars(OpNode).items() if isinstance(value, int) and name != "NONE"}
    assert schema == enum  # the inspector and the FlatBuffer union agree

    runs = schema & set(NODE_FUNCTIONS)
    refused = schema & set(UNSUPPORTED_NODES)
    missing = sorted(schema - runs - refused)
    assert not missing, f"node types without a function or a reason: {missing}"
    assert not runs & refused
    assert set(NODE_FUNCTIONS) <= schema, sorted(set(NODE_FUNCTIONS) - schema)
    assert set(UNSUPPORTED_NODES) <= schema
    assert all(reason.strip() for reason in UNSUPPORTED_NODES.values())
    coverage = f"{len(runs) + len(refused)} of {len(schema)} node types"
    print(f"MLX reference runner: {coverage} ({len(runs)} run, {len(refused)} refused with a reason)")
    assert coverage == f"{len(schema)} of {len(schema)} node types"
    assert set(UNSUPPORTED_NODES) == {"MetalKernelNode"}  # everything else really runs


def test_metal_kernel_node_is_refused_as_a_limit_of_the_runner():
    it = _bare([[Node("MetalKernelNode", {"name": "k", "source": "..."})]])
    with pytest.raises(UnsupportedMLXNode) as err:
        it.run_chain(0)
    assert err.value.nodes == ("MetalKernelNode",)
    assert "limit of the reference executor, not a fault of the program" in str(err.value)
    assert "Metal" in str(err.value)


# --- convolutions (channels-last nodes; the handlers transpose around them) -------------

_CONVS = {
    "conv1d": (torch.nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (2, 4, 11), "Conv1DNode"),
    "conv2d": (
        torch.nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
        (2, 4, 9, 8),
        "Conv2DNode",
    ),
    "conv3d": (
        torch.nn.Conv3d(3, 4, 3, stride=(1, 2, 1), padding=(1, 0, 2), dilation=(2, 1, 1)),
        (1, 3, 6, 7, 5),
        "Conv3DNode",
    ),
    "conv_transpose1d": (
        torch.nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        (2, 4, 7),
        "ConvTranspose1DNode",
    ),
    "conv_transpose2d": (
        torch.nn.ConvTranspose2d(4, 3, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0), dilation=(1, 2)),
        (1, 4, 5, 6),
        "ConvTranspose2DNode",
    ),
    "conv_transpose3d": (torch.nn.ConvTranspose3d(2, 3, 2, stride=2, padding=1), (1, 2, 3, 4, 3), "ConvTranspose3DNode"),
}


@pytest.mark.parametrize("name", sorted(_CONVS))
def test_convolutions_match_eager(name):
    torch.manual_seed(0)
    conv, shape, kind = _CONVS[name]
    model = _Fn(lambda m, x: m.conv(x), conv=conv).eval()
    _compile_and_compare(model, (torch.randn(*shape),), {kind, "TransposeNode"})


def test_convnet_example_matches_eager():
    from compiler.models.examples import convnet

    model, inputs = convnet(channels=4, size=8)
    _compile_and_compare(model, inputs, {"Conv2DNode"})


# --- sorting and selection ---------------------------------------------------------------


def test_sort_values_and_indices_match_eager():
    torch.manual_seed(0)
    model = _Fn(lambda m, x: tuple(torch.sort(x, dim=1)))
    _compile_and_compare(model, (torch.randn(3, 7),), {"SortNode", "ArgsortNode"})


def test_argsort_matches_eager():
    torch.manual_seed(0)
    model = _Fn(lambda m, x: torch.argsort(x, dim=0))
    _compile_and_compare(model, (torch.randn(5, 4),), {"ArgsortNode"})


def test_topk_matches_eager():
    """topk lowers to (arg)partition, a slice of the last k, (arg)sort and a reversing
    slice with step -1 whose stop is -(k + 1): MLX's slice bounds, not Python's."""
    torch.manual_seed(0)
    model = _Fn(lambda m, x: tuple(torch.topk(x, 3, dim=-1)))
    _compile_and_compare(
        model, (torch.randn(4, 9),), {"PartitionNode", "ArgPartitionNode", "SortNode", "ArgsortNode", "SliceNode"}
    )


def test_sort_descending_comes_out_as_the_device_would(monkeypatch):
    """ExecuTorch 1.5.1's aten.sort handler reads only `dim`: a descending sort taken into
    the payload as stock lowers it sorts ascending on the device, and so it does here
    (our MLX backend rewrites such a sort first; that is switched off to see stock's payload)."""
    from compiler.backends.mlx import rewrites, support

    monkeypatch.setattr(
        rewrites, "REWRITES", tuple(r for r in rewrites.REWRITES if r is not rewrites.ignored_arguments_made_explicit)
    )
    monkeypatch.setattr(support, "RULES", support.RULES.without("ignored_argument"))
    torch.manual_seed(0)
    x = torch.randn(3, 7)
    model = _Fn(lambda m, x: tuple(torch.sort(x, dim=-1, descending=True)))
    artifact = compiler.compile(model, (x,), backend="mlx")
    assert [row.where for row in artifact.report.placement if row.op == "aten.sort.default"] == ["MLXBackend"]
    values, indices = compiler.run(artifact, (x,))
    expected = torch.sort(x, dim=-1)  # ascending
    torch.testing.assert_close(values, expected.values)
    torch.testing.assert_close(indices, expected.indices)


def test_partition_nodes_put_the_kth_element_in_place():
    x = np.random.default_rng(0).permutation(20).astype(np.float32).reshape(2, 10)
    fields = {"x": Tid(0), "out": Tid(1), "kth": Vid(0), "axis": -1}
    values = _np(_run("PartitionNode", fields, {0: x}, {0: 6}).tensors[1])
    indices = _np(_run("ArgPartitionNode", fields, {0: x}, {0: 6}).tensors[1])
    for row in range(2):
        ordered = np.sort(x[row])
        assert values[row, 6] == ordered[6]
        assert (values[row, :6] <= ordered[6]).all() and (values[row, 7:] >= ordered[6]).all()
        np.testing.assert_array_equal(np.sort(values[row]), ordered)
        np.testing.assert_array_equal(x[row][indices[row]], values[row])


def test_median_node_is_mlx_median():
    """mlx::median averages the two middle values of an even count (torch.median
    would take the lower one); no handler of this version emits it."""
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    out = _run("MedianNode", {"x": Tid(0), "out": Tid(1), "axes": [1], "keepdims": True}, {0: x}).tensors[1]
    np.testing.assert_allclose(_np(out), np.median(x, axis=1, keepdims=True), rtol=1e-6)
    whole = _run("MedianNode", {"x": Tid(0), "out": Tid(1), "axes": [], "keepdims": False}, {0: x}).tensors[1]
    np.testing.assert_allclose(_np(whole), np.median(x), rtol=1e-6)


# --- element-wise and making --------------------------------------------------------------


def test_round_matches_eager():
    torch.manual_seed(0)
    model = _Fn(lambda m, x: torch.round(x))
    _compile_and_compare(model, (torch.randn(4, 9) * 5,), {"RoundNode"})


def test_round_node_with_decimals():
    x = np.array([1.234, -5.678, 0.015, 12.3456], dtype=np.float32)
    out = _run("RoundNode", {"x": Tid(0), "out": Tid(1), "decimals": 2}, {0: x}).tensors[1]
    np.testing.assert_allclose(_np(out), [1.23, -5.68, 0.02, 12.35], atol=1e-6)


@pytest.mark.parametrize("n, m, k", [(4, 4, 0), (3, 5, 1), (5, 3, -2)])
def test_tri_node(n, m, k):
    """TriNode makes the ones-below-the-k-th-diagonal matrix (no torch op of this
    version lowers to it: tril/triu emit TrilNode/TriuNode)."""
    fields = {"out": Tid(0), "n": Vid(0), "m": m, "k": k, "scalar_type": 6}
    out = _run("TriNode", fields, {}, {0: n}).tensors[0]
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(_np(out), np.tri(n, m, k, dtype=np.float32))


# --- views and in-place copies ----------------------------------------------------------


def test_pooling_through_as_strided_matches_eager():
    """A pooling window that is not its stride lowers to AsStridedNode over the
    transposed (and padded) activation."""
    torch.manual_seed(0)
    model = _Fn(lambda m, x: (torch.nn.functional.max_pool2d(x, 3, 2), torch.nn.functional.avg_pool2d(x, 3, 2, 1)))
    _compile_and_compare(model, (torch.randn(1, 3, 9, 9),), {"AsStridedNode", "MaxNode", "MeanNode", "PadNode"})


def test_as_strided_reads_row_major_order_of_a_transposed_input():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    it = _bare()
    it.tensors[0] = mx.transpose(mx.array(x))  # a strided view: mlx flattens it in logical order
    NODE_FUNCTIONS["AsStridedNode"](it, {"x": Tid(0), "out": Tid(1), "shape": [2, 3], "strides": [1, 2], "offset": 1})
    flat = x.T.reshape(-1)
    np.testing.assert_array_equal(_np(it.tensors[1]), np.lib.stride_tricks.as_strided(flat[1:], (2, 3), (4, 8)))


def test_index_copy_node_matches_torch():
    """IndexCopyNode on its own (compiled, it is our index_put handler's: test_mlx_cache_update.py):
    later indices win, negatives wrap."""
    rng = np.random.default_rng(2)
    dst = rng.standard_normal((2, 6, 3)).astype(np.float32)
    update = rng.standard_normal((2, 4, 3)).astype(np.float32)
    indices = np.array([4, 0, 1, -1], dtype=np.int64)
    fields = {"dst": Tid(0), "update": Tid(1), "indices": Tid(2), "out": Tid(0), "axis": 1}
    out = _run("IndexCopyNode", fields, {0: dst, 1: update, 2: indices}).tensors[0]
    expected = torch.from_numpy(dst).index_copy(1, torch.tensor([4, 0, 1, 5]), torch.from_numpy(update))
    np.testing.assert_array_equal(_np(out), expected.numpy())


@pytest.mark.parametrize(
    "indices, message", [(np.array([6], np.int64), "out of range"), (np.array([1], np.int32), "int64")]
)
def test_index_copy_node_refuses_what_the_runtime_refuses(indices, message):
    fields = {"dst": Tid(0), "update": Tid(1), "indices": Tid(2), "out": Tid(3), "axis": 0}
    with pytest.raises(MLXNodeFailure, match=message):
        _run("IndexCopyNode", fields, {0: np.zeros((6, 2), np.float32), 1: np.ones((1, 2), np.float32), 2: indices})


@pytest.mark.parametrize(
    "start, stop, step", [(4, -7, -1), (2, -4, -1), (-1, 0, -2), (9, 1, -3), (1, -1, 2), (-3, 100, 1), (5, 2, 1)]
)
def test_slice_node_uses_mlx_bounds(start, stop, step):
    """MLX (like numpy) reads a negative stop after wrapping as "before index 0" when
    the step is negative: x[4:-7:-1] on 6 elements is [4, 3, 2, 1, 0]."""
    x = np.arange(6, dtype=np.float32)
    fields = {"x": Tid(0), "out": Tid(1), "axis": 0, "start": start, "stop": stop, "step": step}
    out = _run("SliceNode", fields, {0: x}).tensors[1]
    np.testing.assert_array_equal(_np(out), x[start:stop:step])


# --- attention ----------------------------------------------------------------------------


class _Rope(torch.nn.Module):
    def forward(self, x, pos):
        return torch.ops.mlx.rope(x, 8, pos.item(), False, 10000.0, 1.0, None)


def test_rope_matches_eager():
    """mlx::rope (ExecuTorch's custom op) lowers to RopeNode with a Vid offset."""
    import executorch.backends.mlx.custom_ops  # noqa: F401  (registers torch.ops.mlx)

    torch.manual_seed(0)
    _compile_and_compare(_Rope(), (torch.randn(1, 2, 5, 12), torch.tensor(3)), {"RopeNode"})


def test_rope_node_with_a_tensor_offset_and_traditional_pairs():
    x = np.random.default_rng(3).standard_normal((1, 2, 4, 8)).astype(np.float32)
    fields = {
        "x": Tid(0),
        "out": Tid(1),
        "dims": 8,
        "offset": Tid(2),
        "freqs": None,
        "traditional": True,
        "base": 10000.0,
        "scale": 1.0,
    }
    out = _np(_run("RopeNode", fields, {0: x, 2: np.array(5, np.int32)}).tensors[1])
    angles = (5 + np.arange(4))[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    even, odd = x[..., 0::2], x[..., 1::2]
    expected = np.stack([even * np.cos(angles) - odd * np.sin(angles), even * np.sin(angles) + odd * np.cos(angles)], -1)
    np.testing.assert_allclose(out, expected.reshape(x.shape), atol=1e-5)


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, position):
        return torch.ops.kvcache.update_and_attend(q, k, v, position, 0, 0.5, torch.float32)


def test_update_and_attend_matches_eager_over_two_steps():
    """The off-graph KV cache: on a device the runner installs it; here it is passed to
    the executor. A prefill of 3 tokens, then one decode step that sees all 4."""
    import warnings

    from executorch.extension.llm.cache.reference_cache import CacheConfig, ContiguousReferenceCache
    from executorch.extension.llm.cache.update_and_attend import REGISTRY

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CacheConfig(n_layers=1, n_kv_heads=2, head_dim=8, capacity=16)
        REGISTRY.install("eager-test", ContiguousReferenceCache(config))
        cache = ContiguousReferenceCache(config)
    steps = [
        (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.arange(3).unsqueeze(-1)),
        (torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[3]])),
    ]
    try:
        with REGISTRY.active("eager-test"):
            artifact = compiler.compile(_Attend(), steps[0], backend="mlx")
            assert "UpdateAndAttendNode" in _payload_kinds(artifact)
            executor = ReferenceExecutor(artifact.pte, kv_cache=cache)
            for step in steps:
                (ours,) = executor.run(list(step))
                torch.testing.assert_close(ours, _Attend()(*step), atol=1e-5, rtol=1e-5)
    finally:
        REGISTRY.uninstall("eager-test")
    assert cache.used(0) == 4


def test_update_and_attend_without_a_cache_fails_like_the_runtime():
    fields = {"q": Tid(0), "k": Tid(1), "v": Tid(2), "position": Tid(3), "out": Tid(4)}
    fields.update(layer_id=0, scale=1.0, out_dtype=None)
    with pytest.raises(MLXNodeFailure, match="no cache installed"):
        _run("UpdateAndAttendNode", fields, {i: np.zeros((1, 1, 1, 4), np.float32) for i in range(4)})


# --- quantized and gathered products ----------------------------------------------------


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: each uint32 word holds 32 / bits values, lowest bits first."""
    per_word = 32 // bits
    shifts = bits * np.arange(per_word, dtype=np.uint32)
    values = (packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word).astype(np.float32)


def _quantized(shape, group_size, bits, seed=4):
    w = mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    dense = _unpack(_np(packed), bits) * np.repeat(_np(scales), group_size, -1) + np.repeat(_np(biases), group_size, -1)
    return packed, scales, biases, dense


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_node(bits):
    packed, scales, biases, dense = _quantized((6, 64), 32, bits)
    fields = {"w": Tid(0), "scales": Tid(1), "biases": Tid(2), "out": Tid(3), "group_size": 32, "bits": bits}
    fields.update(mode="affine", global_scale=None, dtype=5)  # ExecuTorch Half
    out = _run("DequantizeNode", fields, {0: packed, 1: scales, 2: biases}).tensors[3]
    assert out.dtype == mx.float16
    np.testing.assert_allclose(_np(out.astype(mx.float32)), dense, atol=2e-3, rtol=2e-3)


def test_quantized_matmul_node():
    packed, scales, biases, dense = _quantized((16, 64), 32, 4)
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    fields = {"x": Tid(0), "w": Tid(1), "scales": Tid(2), "biases": Tid(3), "out": Tid(4)}
    fields.update(group_size=32, bits=4, mode="affine", transpose=True)
    out = _run("QuantizedMatmulNode", fields, {0: x, 1: packed, 2: scales, 3: biases}).tensors[4]
    np.testing.assert_allclose(_np(out), x @ dense.T, atol=1e-4, rtol=1e-4)


class _GatherMm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 5))

    def forward(self, x, experts):
        return torch.ops.mlx.gather_mm(x, self.w, experts)


class _GatherQmm(torch.nn.Module):
    """TorchAO-style int8 codes in [-8, 8) with a scale per group of 32 (no zero point)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randint(-8, 8, (3, 8, 64), dtype=torch.int8))
        self.register_buffer("scales", torch.rand(3, 8, 2) * 0.1 + 0.01)

    def forward(self, x, experts):
        return torch.ops.mlx.gather_qmm(x, self.w, self.scales, None, experts, None, True, 32, 4, "affine")


def test_gather_mm_matches_eager():
    import executorch.backends.mlx.custom_ops  # noqa: F401

    torch.manual_seed(0)
    _compile_and_compare(_GatherMm().eval(), (torch.randn(3, 1, 8), torch.tensor([2, 0, 3])), {"GatherMmNode"})


def test_gather_qmm_matches_eager():
    """The handler repacks the int8 codes into MLX's unsigned format with biases."""
    import executorch.backends.mlx.custom_ops  # noqa: F401

    torch.manual_seed(0)
    _compile_and_compare(_GatherQmm(), (torch.randn(2, 1, 64), torch.tensor([2, 0])), {"GatherQmmNode"})


# --- random bits ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
def test_random_bits_follow_mlx_threefry(seed):
    """mx.random.split(key, n) is mlx::random::bits({n, 2}, 4, key): bit for bit. An odd
    number of words (the middle one hashed on its own) is checked against mx.random.uniform,
    which divides 32-bit words by 2**32."""
    key = mx.random.key(seed)
    words = tuple(int(v) for v in _np(key).tolist())
    for n in (1, 2, 5):
        np.testing.assert_array_equal(random_bits([n, 2], 4, words), _np(mx.random.split(key, n)))
    for shape in ([1], [3], [5, 3]):
        uniform = _np(mx.random.uniform(shape=shape, key=key))
        np.testing.assert_allclose(random_bits(shape, 4, words) / 2.0**32, uniform, atol=1e-6)


def test_random_bits_node_with_a_seed():
    fields = {"out": Tid(0), "shape": [Vid(1), 3], "seed": Vid(0), "width": 4}
    first = _run("RandomBitsNode", fields, {}, {0: 11, 1: 2}).tensors[0]
    again = _run("RandomBitsNode", fields, {}, {0: 11, 1: 2}).tensors[0]
    other = _run("RandomBitsNode", fields, {}, {0: 12, 1: 2}).tensors[0]
    assert first.dtype == mx.uint32 and first.shape == (2, 3)
    np.testing.assert_array_equal(_np(first), _np(again))
    assert (_np(first) != _np(other)).any()
    expected = random_bits([2, 3], 4, tuple(int(v) for v in _np(mx.random.key(11)).tolist()))
    np.testing.assert_array_equal(_np(first), expected)
    narrow = _run("RandomBitsNode", {**fields, "width": 1}, {}, {0: 11, 1: 2}).tensors[0]
    assert narrow.dtype == mx.uint8 and narrow.shape == (2, 3)
    # The layout depends on the byte count only: 6 bytes are the first 6 of the two
    # 32-bit words mlx makes for 8 bytes, which are mx.random.split(key, 1).
    two_words = _np(mx.random.split(mx.random.key(11), 1)).reshape(-1)
    np.testing.assert_array_equal(_np(narrow).reshape(-1), two_words.view(np.uint8)[:6])


def test_random_bits_node_refuses_a_width_the_runtime_refuses():
    with pytest.raises(MLXNodeFailure, match="width"):
        _run("RandomBitsNode", {"out": Tid(0), "shape": [2], "seed": None, "width": 3}, {})


# --- control flow ----------------------------------------------------------------------------


def test_scan_node_runs_its_body_per_step_with_a_carry():
    """A running sum along axis 1: the body adds the step's slice to the carry and
    copies the carry to the output; the runtime stacks the outputs along the axis."""
    body = [
        Node("AddNode", {"a": Tid(3), "b": Tid(1), "out": Tid(3)}),
        Node("IdCopyNode", {"x": Tid(3), "out": Tid(2)}),
    ]
    x = np.random.default_rng(6).standard_normal((2, 5, 3)).astype(np.float32)
    fields = {"originals": [Tid(0)], "sliced": [Tid(1)], "outputs": [Tid(2)], "carry": [Tid(3)]}
    fields.update(body_chain_idx=0, scan_axis=1)
    it = _run("ScanNode", fields, {0: x, 3: np.zeros((2, 3), np.float32)}, chains=[body])
    np.testing.assert_allclose(_np(it.tensors[2]), np.cumsum(x, axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_np(it.tensors[3]), x.sum(axis=1), rtol=1e-6, atol=1e-6)


# --- existing node types made to follow the C++ runtime -----------------------------------


def test_integer_floor_divide_is_float_like_the_runtime():
    """The runtime fixes up a truncating integer division built on mlx::divide, which
    makes floats: -7 // 2 comes out as -4.5 (float32), which an int output truncates to -4."""
    a, b = np.array([-7, 7, 6, -6], np.int32), np.array([2, -2, 3, 4], np.int32)
    out = _run("FloorDivideNode", {"a": Tid(0), "b": Tid(1), "out": Tid(2)}, {0: a, 1: b}).tensors[2]
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(_np(out), [-4.5, -4.5, 2.0, -2.5])
    np.testing.assert_array_equal(np.trunc(_np(out)).astype(np.int32), a // b)


def test_arange_without_a_dtype_is_int32_like_mlx():
    fields = {"out": Tid(0), "start": 0, "stop": 5, "step": 2, "scalar_type": None}
    out = _run("ARangeNode", fields, {}).tensors[0]
    assert out.dtype == mx.int32
    np.testing.assert_array_equal(_np(out), [0, 2, 4])


def test_scalar_int_nodes_refuse_int32_overflow_like_the_runtime():
    with pytest.raises(MLXNodeFailure, match="overflow"):
        _run("MultiplyIntNode", {"a": 2**20, "b": 2**12, "out": Vid(0)}, {})
    with pytest.raises(MLXNodeFailure, match="division by zero"):
        _run("FloorDivideIntNode", {"a": 3, "b": Vid(1), "out": Vid(0)}, {}, {1: 0})
    assert _run("FloorDivideIntNode", {"a": -7, "b": 2, "out": Vid(0)}, {}).values[0] == -4


def test_sdpa_node_casts_an_additive_mask_and_refuses_mask_with_causal():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float16) for _ in range(3))
    mask = np.triu(np.full((3, 3), -1e4, np.float32), 1)  # float32 mask, float16 q
    fields = {"q": Tid(0), "k": Tid(1), "v": Tid(2), "out": Tid(4), "mask": Tid(3), "scale": 0.5, "causal": False}
    out = _run("SdpaNode", fields, {0: q, 1: k, 2: v, 3: mask}).tensors[4]
    causal = _run("SdpaNode", {**fields, "mask": None, "causal": True}, {0: q, 1: k, 2: v}).tensors[4]
    assert out.dtype == mx.float16
    np.testing.assert_allclose(_np(out.astype(mx.float32)), _np(causal.astype(mx.float32)), atol=2e-3)
    with pytest.raises(MLXNodeFailure, match="causal"):
        _run("SdpaNode", {**fields, "causal": True}, {0: q, 1: k, 2: v, 3: mask})


def test_addmm_node_applies_alpha_only_with_a_bias_like_the_runtime():
    rng = np.random.default_rng(8)
    a, b, bias = rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal((2,))
    a, b, bias = (x.astype(np.float32) for x in (a, b, bias))
    fields = {"mat1": Tid(0), "mat2": Tid(1), "bias": Tid(2), "out": Tid(3), "alpha": 2.0, "beta": 0.5}
    out = _run("AddmmNode", fields, {0: a, 1: b, 2: bias}).tensors[3]
    np.testing.assert_allclose(_np(out), 2.0 * (a @ b) + 0.5 * bias, rtol=1e-5, atol=1e-5)
    plain = _run("AddmmNode", {**fields, "bias": None}, {0: a, 1: b}).tensors[3]
    np.testing.assert_allclose(_np(plain), a @ b, rtol=1e-5, atol=1e-5)


class _GatedDeltaRule(torch.nn.Module):
    """ExecuTorch's mlx::gated_delta_rule: a recurrence over T whose state is a buffer
    updated in place (starting at zero, so the delegate owns it)."""

    def __init__(self, use_custom_kernel: bool):
        super().__init__()
        self.use_custom_kernel = use_custom_kernel
        self.register_buffer("state", torch.zeros(1, 2, 4, 32))

    def forward(self, q, k, v, g, beta):
        return torch.ops.mlx.gated_delta_rule(q, k, v, g, beta, self.state, use_custom_kernel=self.use_custom_kernel)


def _gated_delta_inputs():
    torch.manual_seed(0)
    b, t, h, dk, dv = 1, 5, 2, 32, 4
    return (
        torch.randn(b, t, h, dk) * 0.2,
        torch.randn(b, t, h, dk) * 0.2,
        torch.randn(b, t, h, dv),
        torch.rand(b, t, h),
        torch.rand(b, t, h),
    )


def test_scan_node_end_to_end_with_state_across_calls():
    """Without the custom kernel the handler lowers the recurrence to a ScanNode whose
    body reads and writes the carried state; the state then carries to the next call."""
    import executorch.backends.mlx.custom_kernel_ops.gated_delta_rule  # noqa: F401

    inputs = _gated_delta_inputs()
    eager = _GatedDeltaRule(use_custom_kernel=False)
    artifact = compiler.compile(copy.deepcopy(eager), inputs, backend="mlx")
    assert "ScanNode" in _payload_kinds(artifact)
    executor = ReferenceExecutor(artifact.pte)
    first, second = executor.run(list(inputs))[0], executor.run(list(inputs))[0]
    torch.testing.assert_close(first, eager(*inputs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, eager(*inputs), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first, second)


def test_metal_kernel_payload_fails_with_the_named_reason():
    import executorch.backends.mlx.custom_kernel_ops.gated_delta_rule  # noqa: F401

    inputs = _gated_delta_inputs()
    artifact = compiler.compile(_GatedDeltaRule(use_custom_kernel=True), inputs, backend="mlx")
    assert "MetalKernelNode" in _payload_kinds(artifact)
    with pytest.raises(UnsupportedMLXNode, match="limit of the reference executor") as err:
        compiler.run(artifact, inputs)
    assert err.value.nodes == ("MetalKernelNode",)


def _stock_mlx_pte(model, inputs) -> bytes:
    """ExecuTorch's own lowering (to_edge_transform_and_lower + MLXPartitioner): the
    driver's fold stage cannot take TorchAO-quantized models yet, and the payload
    is what matters here."""
    ensure_generated()
    from executorch.backends.mlx.partitioner import MLXPartitioner
    from executorch.exir import to_edge_transform_and_lower

    exported = torch.export.export(model, inputs)
    return to_edge_transform_and_lower(exported, partitioner=[MLXPartitioner()]).to_executorch().buffer


def _torchao_int4(model, only=None):
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_api import IntxWeightOnlyConfig, quantize_

    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), only)
    return model


@pytest.mark.parametrize(
    "name, kind",
    [("linear", "QuantizedMatmulNode"), ("conv", "DequantizeNode")],
)
def test_torchao_int4_payloads_match_eager(name, kind):
    """A quantized linear fuses into QuantizedMatmulNode; a quantized conv weight is a
    standalone dequantize_affine, a DequantizeNode feeding Conv2DNode."""
    torch.manual_seed(0)
    if name == "linear":
        model, x = _torchao_int4(torch.nn.Sequential(torch.nn.Linear(64, 16)).eval()), torch.randn(3, 64)
    else:
        conv = torch.nn.Sequential(torch.nn.Conv2d(32, 8, 3)).eval()
        model, x = _torchao_int4(conv, lambda m, fqn: isinstance(m, torch.nn.Conv2d)), torch.randn(1, 32, 6, 6)
    executor = ReferenceExecutor(_stock_mlx_pte(model, (x,)))
    kinds = set().union(*(MLXGraph(bytes(d.data)).node_kinds() for d in executor.program.backend_delegate_data))
    assert kind in kinds
    (ours,) = executor.run([x])
    with torch.no_grad():
        torch.testing.assert_close(ours, model(x), atol=1e-5, rtol=1e-5)


class _Sample(torch.nn.Module):
    def forward(self, logits, temperature, top_k, top_p, seed):
        return torch.ops.mlx.sample(logits, temperature, top_k, top_p, seed)


def test_seeded_sampling_draws_the_gumbel_noise_mlx_draws():
    """mlx::sample lowers to RandomBitsNode keyed by the seed, then uniform -> gumbel ->
    argmax; the token must be argmax(logits / T + mx.random.gumbel(key(seed))). The
    eager op uses torch's RNG, so only greedy (T = 0, the IfNode's other branch) matches it."""
    import executorch.backends.mlx.custom_ops  # noqa: F401

    torch.manual_seed(0)
    logits = torch.randn(3, 50)

    def inputs(temperature, seed):
        return [logits, torch.tensor(temperature), torch.tensor(50), torch.tensor(1.0), torch.tensor(seed)]

    artifact = compiler.compile(_Sample(), tuple(inputs(0.7, 123)), backend="mlx")
    assert {"RandomBitsNode", "IfNode"} <= _payload_kinds(artifact)
    executor = ReferenceExecutor(artifact.pte)
    for seed in (123, 5):
        (tokens,) = executor.run(inputs(0.7, seed))
        gumbel = _np(mx.random.gumbel(shape=(3, 50), key=mx.random.key(seed)))
        np.testing.assert_array_equal(tokens.numpy(), np.argmax(logits.numpy() / 0.7 + gumbel, axis=-1))
    (greedy,) = executor.run(inputs(0.0, 1))
    torch.testing.assert_close(greedy, _Sample()(*inputs(0.0, 1)))


def test_broadcast_to_node_keeps_dims_for_minus_one_from_the_right():
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    out = _run("BroadcastToNode", {"x": Tid(0), "out": Tid(1), "shape": [2, -1, 4]}, {0: x}).tensors[1]
    np.testing.assert_array_equal(_np(out), np.broadcast_to(x, (2, 3, 4)))
    with pytest.raises(ValueError):  # -1 on a new leading dimension: mlx refuses it
        _run("BroadcastToNode", {"x": Tid(0), "out": Tid(1), "shape": [-1, 3, 4]}, {0: x})
