"""Single ops that are not core ATen, alone in a program, on every backend.

Each must compile; on portable, XNNPACK and MLX the program must match eager; on
Core ML (compile only here) the op is delegated whole where coremltools converts it
(as stock does), and otherwise decomposed into ops that land somewhere with a kernel.
"""

import logging
import warnings

import pytest
import torch
from torch import nn

import compiler
from compiler.ir.dialect import op_name

BACKENDS = ["portable", "xnnpack", "mlx", "coreml"]


def _edge_ops(artifact) -> set[str]:
    return {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}


def _check(model, inputs, backend, *, kept_on_coreml=None, coreml_cpu=(), gone=()):
    """Compile `model`; elsewhere than Core ML compare with eager. On Core ML, `kept_on_coreml`
    is the op delegated whole (None when it is decomposed) and `coreml_cpu` the ops that run
    on the CPU (each with a kernel: the pipeline checks that). `gone` are ops that must not
    be in the Edge program (decomposed)."""
    model = model.eval()
    artifact = compiler.compile(model, inputs, backend)
    plan = artifact.program.plan
    if backend == "coreml":
        assert {p.op for p in plan.cpu_nodes} == set(coreml_cpu), [(p.op, p.reason) for p in plan.cpu_nodes]
        assert plan.delegated_nodes and artifact.program.delegates
        if kept_on_coreml is not None:
            assert kept_on_coreml in {p.op for p in plan.delegated_nodes}
            return artifact
    else:
        with torch.no_grad():
            expected = model(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = compiler.run(artifact, inputs)
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, equal_nan=True)
    assert not set(gone) & _edge_ops(artifact)
    return artifact


# --- adaptive max pooling ----------------------------------------------------------


class WithIndices(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def forward(self, x):
        values, indices = self.pool(x)
        return values * 2, indices


ADAPTIVE_MAX_POOL = {
    # name: (module, input shape, op Core ML is given whole, or None: decomposed into ops it
    # takes, all delegated); the inputs of the cases with indices hold ties (first one wins)
    "1d": (lambda: nn.AdaptiveMaxPool1d(3), (1, 4, 10), "aten.adaptive_max_pool1d.default"),
    "1d_even": (lambda: nn.AdaptiveMaxPool1d(5), (2, 3, 10), "aten.adaptive_max_pool1d.default"),
    "2d": (lambda: nn.AdaptiveMaxPool2d((3, 3)), (1, 4, 9, 9), "aten.adaptive_max_pool2d.default"),
    "2d_uneven": (lambda: nn.AdaptiveMaxPool2d((3, 4)), (2, 3, 10, 10), "aten.adaptive_max_pool2d.default"),
    "2d_unbatched": (lambda: nn.AdaptiveMaxPool2d(2), (3, 5, 7), "aten.adaptive_max_pool2d.default"),
    "2d_global": (lambda: nn.AdaptiveMaxPool2d(1), (1, 4, 6, 5), "aten.adaptive_max_pool2d.default"),
    # coremltools' converter gives no indices: decomposed for Core ML
    "2d_indices": (lambda: WithIndices(nn.AdaptiveMaxPool2d((3, 4), return_indices=True)), (1, 2, 7, 9), None),
    # coremltools has no converter for adaptive_max_pool3d
    "3d": (lambda: nn.AdaptiveMaxPool3d(2), (1, 2, 4, 4, 4), None),
    "3d_uneven": (lambda: nn.AdaptiveMaxPool3d((2, 3, 2)), (1, 2, 5, 7, 3), None),
    "3d_indices": (lambda: WithIndices(nn.AdaptiveMaxPool3d((3, 2, 2), return_indices=True)), (2, 6, 5, 4), None),
}
_ADAPTIVE_OPS = ("aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool3d.default")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ADAPTIVE_MAX_POOL)
def test_adaptive_max_pool(case, backend):
    factory, shape, kept = ADAPTIVE_MAX_POOL[case]
    torch.manual_seed(0)
    inputs = (torch.randint(0, 4, shape).float() if "indices" in case else torch.randn(shape),)
    artifact = _check(factory(), inputs, backend, kept_on_coreml=kept, gone=_ADAPTIVE_OPS)
    if backend in ("portable", "xnnpack"):
        # no runtime kernel for a 3-d max pool: decomposed all the way
        assert "aten::max_pool3d_with_indices.out" not in artifact.program.operators


# --- median --------------------------------------------------------------------------


class Median(nn.Module):
    def forward(self, x):
        return torch.median(x)


class MedianDim(nn.Module):
    def forward(self, x):
        values, indices = torch.median(x, dim=1)
        return values, indices


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", [Median, MedianDim])
def test_median(model_type, backend):
    torch.manual_seed(0)
    _check(model_type(), (torch.randn(3, 5),), backend, gone=("aten.median.default", "aten.median.dim"))


# --- round with decimals -----------------------------------------------------------


class Round(nn.Module):
    def __init__(self, decimals):
        super().__init__()
        self.decimals = decimals

    def forward(self, x):
        return torch.round(x, decimals=self.decimals)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decimals", [2, -1])
def test_round_with_decimals(decimals, backend):
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 10 ** (1 - decimals)
    _check(Round(decimals), (x,), backend, gone=("aten.round.decimals",))


# --- Tensor.unfold -------------------------------------------------------------------


class Unfold(nn.Module):
    def __init__(self, dim, size, step):
        super().__init__()
        self.dim, self.size, self.step = dim, size, step

    def forward(self, x):
        return x.unfold(self.dim, self.size, self.step) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("args", [(1, 3, 2), (-1, 2, 1)], ids=["strided", "last_dim"])
def test_unfold(args, backend):
    torch.manual_seed(0)
    # Core ML: coremltools converts no as_strided (stock leaves its unfold_copy on the CPU too)
    cpu = {"aten.as_strided_copy.default"}
    _check(Unfold(*args), (torch.randn(2, 9, 4),), backend, coreml_cpu=cpu, gone=("aten.unfold.default",))


# --- stock ---------------------------------------------------------------------------


def _stock_coreml(model, inputs):
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        program = torch.export.export(model.eval(), inputs)
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return to_edge_transform_and_lower(program, partitioner=[CoreMLPartitioner()])
    finally:
        logging.disable(logging.NOTSET)


STOCK_FAILS = {
    "adaptive_max_pool2d": (nn.AdaptiveMaxPool2d((3, 3)), (1, 4, 9, 9), "aten.adaptive_max_pool2d.default"),
    "adaptive_max_pool3d": (nn.AdaptiveMaxPool3d(2), (1, 2, 4, 4, 4), "aten.adaptive_max_pool3d.default"),
    "median": (Median(), (3, 5), "aten.median.default"),
    "round_decimals": (Round(2), (3, 5), "aten.round.decimals"),
}


@pytest.mark.parametrize("case", STOCK_FAILS)
def test_stock_coreml_refuses_the_op_and_we_compile_it(case):
    from torch._export.verifier import SpecViolationError

    model, shape, op = STOCK_FAILS[case]
    inputs = (torch.randn(shape),)
    # Stock asks to keep adaptive_max_pool2d whole but only preserves ops its own table
    # would decompose, so the verifier refuses it; the others no table decomposes.
    with pytest.raises(SpecViolationError, match=f"{op.replace('.', '.')} is not in Core ATen opset"):
        _stock_coreml(model, inputs)
    compiler.compile(model, inputs, "coreml")


def test_stock_and_we_delegate_adaptive_max_pool1d_whole_to_coreml():
    model, inputs = nn.AdaptiveMaxPool1d(3), (torch.randn(1, 4, 10),)
    stock = _stock_coreml(model, inputs).exported_program()
    calls = [n.target for n in stock.graph.nodes if n.op == "call_function"]
    assert "executorch_call_delegate" in str(calls) and not any(isinstance(c, torch._ops.OpOverload) for c in calls)
    artifact = compiler.compile(model, inputs, "coreml")
    assert not artifact.program.plan.cpu_nodes
    assert artifact.program.delegates == ("CoreMLBackend",)


# --- the decompositions themselves, eagerly -------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_adaptive_max_pool_decomposition_matches_torch_for_every_size(n):
    from compiler.passes.decomposition import _adaptive_max_pool

    pool = torch.ops.aten.adaptive_max_pool2d.default if n == 2 else torch.ops.aten.adaptive_max_pool3d.default
    generator = torch.Generator().manual_seed(n)
    for size in range(1, 9):
        for out in range(1, size + 3):  # more bins than positions too: bins overlap
            spatial = [size, 7, 3][:n]
            output = [out, 3, 2][:n]
            for x in (torch.randn([2, *spatial], generator=generator), torch.randint(0, 3, [1, 2, *spatial], generator=generator).float()):
                values, indices = _adaptive_max_pool(x, output, n)
                expected_values, expected_indices = pool(x, output)
                assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices), (spatial, output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_decimals_decomposition_matches_torch(dtype):
    from compiler.passes.decomposition import _round_decimals

    x = (torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    x = torch.cat([x, torch.tensor([0.125, -0.125, 2.5, -2.5, 0.005, 15.0, 25.0], dtype=dtype)])  # halves: to even
    for decimals in (-2, -1, 0, 1, 2, 3):
        assert torch.equal(_round_decimals(x, decimals=decimals), torch.round(x, decimals=decimals)), decimals
