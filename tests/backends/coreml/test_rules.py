"""Core ML rules: bool min/max, integer bitwise_and, log1p, 0-d fills, index_put forms, rank above 5, ceil-mode pools, pixel_unshuffle below iOS 16, size expressions read from outside Core ML."""

from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.backends.coreml.conversion import CoreMLConversionError
from compiler.running.runtime import compare_with_eager
from coreml_helpers import assert_matches_eager, compile_coreml, cpu_ops, cpu_reasons, delegated_ops, stock_error, stock_pte


class BoolReduce(nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(x > 0).float() + x.sum(-1)


@pytest.mark.parametrize(
    "reduce, op",
    [
        (lambda b: b.amax(dim=-1), "aten.amax.default"),
        (lambda b: b.amin(dim=-1), "aten.amin.default"),
        (lambda b: torch.maximum(b, b.flip(-1)).sum(-1), "aten.maximum.default"),
    ],
)
def test_min_max_over_bool_runs_on_cpu(reduce, op):
    model, inputs = BoolReduce(reduce), (torch.randn(2, 4),)
    artifact = compile_coreml(model, inputs)
    assert op in cpu_ops(artifact).values()
    assert "gt" in " ".join(delegated_ops(artifact))
    reason = next(r for n, r in cpu_reasons(artifact).items() if cpu_ops(artifact)[n] == op)
    assert "over bool" in reason
    assert_matches_eager(artifact, model, inputs)


def test_stock_fails_on_bool_amax():
    assert "reduce_max" in stock_error(BoolReduce(lambda b: b.amax(dim=-1)), (torch.randn(2, 4),))


class BitwiseAnd(nn.Module):
    """`&` of integers next to ops Core ML takes; the bool `&` of two comparisons it takes too."""

    def forward(self, x):
        flags = (x > 0) & (x < 5)
        return (x & (x + 1)) * 2 + flags.int()


def test_bitwise_and_of_integers_runs_on_cpu_and_of_bools_on_core_ml():
    model, inputs = BitwiseAnd(), (torch.randint(-8, 8, (2, 4), dtype=torch.int32),)
    artifact = compile_coreml(model, inputs)
    on_cpu = [n for n, op in cpu_ops(artifact).items() if op == "aten.bitwise_and.Tensor"]
    assert len(on_cpu) == 1
    assert "only of bool" in cpu_reasons(artifact)[on_cpu[0]]
    assert "bitwise_and" in " ".join(delegated_ops(artifact))  # the bool one stays delegated
    assert_matches_eager(artifact, model, inputs)


def test_stock_fails_on_bitwise_and_of_integers():
    model, inputs = BitwiseAnd(), (torch.randint(-8, 8, (2, 4), dtype=torch.int32),)
    assert "only supports boolean input" in stock_error(model, inputs)


class Log1p(nn.Module):
    """log1p, and logsigmoid, which decomposes to min(x, 0) - log1p(exp(-|x|))."""

    def forward(self, x):
        return torch.log1p(x) * 2, F.logsigmoid(x) + 1


_NEAR_ZERO = (torch.full((2, 3), 1e-4) * torch.arange(1, 7).reshape(2, 3),)


def test_log1p_and_logsigmoid_run_on_the_cpu_and_match_eager():
    model = Log1p()
    artifact = compile_coreml(model, _NEAR_ZERO)
    on_cpu = [n for n, op in cpu_ops(artifact).items() if op == "aten.log1p.default"]
    assert len(on_cpu) == 2
    assert all("log with epsilon 1" in cpu_reasons(artifact)[n] for n in on_cpu)
    assert {"aten.exp.default", "aten.mul.Tensor"} <= set(delegated_ops(artifact))
    for inputs in (_NEAR_ZERO, (torch.randn(2, 3),)):
        assert compare_with_eager(artifact, model, inputs).passed
    assert compare_with_eager(artifact, model, _NEAR_ZERO).output_errors[0][1] < 0.01  # relative


def test_without_the_rule_the_payload_check_refuses_log1p():
    from compiler.ir.errors import VerificationError

    with _without_rule("log1p_as_log_of_x_plus_one"), pytest.raises(VerificationError, match="epsilon 1"):
        compile_coreml(Log1p(), _NEAR_ZERO)


def test_stock_log1p_near_zero_is_wrong():
    """Stock's payload computes log(x + 1) in float16, where 1 + 1e-4 is 1: log1p's output is
    all wrong (relative error 1), though within float16's tolerance of the largest output."""
    model = Log1p()
    check = compare_with_eager(stock_pte(model, _NEAR_ZERO), model, _NEAR_ZERO)
    assert check.output_errors[0][1] > 0.5


class IndexPut(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, y, v):
        y = y.clone()
        self.write(y, v)
        return y * 2


class CacheUpdate(nn.Module):
    """The single-entry cache-update form, which Core ML converts."""

    def forward(self, cache, pos, v):
        cache = cache.clone()
        cache[:, :, pos] = v
        return cache * 2


class Accumulate(nn.Module):
    def forward(self, y, idx, v):
        return torch.index_put(y, (idx,), v, accumulate=True) * 2


class BoolMask(nn.Module):
    def forward(self, y, v):
        y = y.clone()
        y[y > 0] = v
        return y * 2


@pytest.mark.parametrize(
    "model, inputs, on_cpu, why",
    [
        (CacheUpdate(), (torch.randn(1, 2, 6, 4), torch.tensor([3]), torch.randn(1, 2, 1, 4)), False, None),
        (Accumulate(), (torch.randn(5, 3), torch.tensor([0, 0, 2]), torch.randn(3, 3)), True, "accumulate=True"),
        (BoolMask(), (torch.randn(4, 3), torch.tensor(1.0)), True, "a bool mask index"),
    ],
    ids=["cache-update", "accumulate", "bool-mask"],
)
def test_index_put_forms(model, inputs, on_cpu, why):
    artifact = compile_coreml(model, inputs)
    cpu = cpu_ops(artifact)
    index_put = [op for op in cpu.values() if op.startswith("aten.index_put")]
    assert bool(index_put) == on_cpu
    if why:
        assert any(why in r for r in cpu_reasons(artifact).values())
    else:
        assert "aten.index_put.default" in delegated_ops(artifact)


def _broadcast_indices(y, v):
    y[torch.tensor([[0], [2]]), torch.tensor([1, 3, 4])] = v  # (2, 1) and (3,) broadcast to (2, 3)


def _two_indices_after_slice(y, v):
    y[:, torch.tensor([1]), torch.tensor([2])] = v


def _two_long_indices_after_slice(y, v):
    y[:, torch.tensor([0, 2]), torch.tensor([1, 3])] = v


def _two_dimensional_index_after_slice(y, v):
    y[:, torch.tensor([[0, 2], [1, 3]])] = v


def _bool_next_to_slice(y, v):
    y[:, torch.tensor([True, False, True, False])] = v


class IndexPutAt(nn.Module):
    """index_put with a run-time 0-d index (`y[:, i] = v` would call .item() on it)."""

    def __init__(self, with_slice):
        super().__init__()
        self.with_slice = with_slice

    def forward(self, y, i, v):
        indices = [None, i] if self.with_slice else [i]
        return torch.ops.aten.index_put.default(y, indices, v) * 2


_I = torch.tensor(1)


@pytest.mark.parametrize(
    "model, inputs, target, why, stock",
    [
        (IndexPut(_broadcast_indices), (torch.randn(4, 5), torch.randn(2, 3)), None,
         "index tensors that broadcast against each other", "has shape (3,), others have (2, 1)"),
        (IndexPutAt(False), (torch.randn(4, 3), _I, torch.randn(3)), None,
         "a 0-d index and no slice", "AttributeError: type object 'int' has no attribute 'get_primitive'"),
        (IndexPutAt(True), (torch.randn(2, 4, 3), _I, torch.randn(2, 3)), None,
         "a 0-d index or several indices next to a slice, with values that vary before the last index", ""),
        (IndexPutAt(True), (torch.randn(2, 4, 3), _I, torch.randn(3)), None, None, ""),
        (IndexPut(_two_indices_after_slice), (torch.randn(2, 4, 5, 3), torch.randn(2, 1, 3)), None,
         "several indices next to a slice, with values that vary before the last index",
         "The updates tensor should have shape"),
        (IndexPut(_two_indices_after_slice), (torch.randn(2, 4, 5, 3), torch.randn(1, 3)), None, None, ""),
        (IndexPut(_bool_next_to_slice), (torch.randn(3, 4), torch.randn(3, 2)), None,
         "a bool index next to a slice", "y has dtype int32 whereas x has dtype bool"),
        (IndexPut(_two_long_indices_after_slice), (torch.randn(2, 4, 5, 3), torch.randn(2, 2, 3)), None,
         "several indices of more than one entry next to a slice", "Input squeeze_0 has rank 1 != other inputs rank 0"),
        (IndexPut(_two_dimensional_index_after_slice), (torch.randn(2, 4, 3), torch.randn(2, 2, 2, 3)), None,
         "an index of rank 2 next to a slice", "Input squeeze_0 has rank 2 != other inputs rank 0"),
        # Stock fails the same way at iOS 18, so the form stays refused there too.
        (IndexPut(_bool_next_to_slice), (torch.randn(3, 4), torch.randn(3, 2)), "iOS18",
         "a bool index next to a slice", "y has dtype int32 whereas x has dtype bool"),
    ],
    ids=[
        "broadcast-indices", "0-d-index", "0-d-next-to-slice-values-vary", "0-d-next-to-slice",
        "several-next-to-slice-values-vary", "several-next-to-slice", "bool-next-to-slice", "several-long-next-to-slice",
        "2-d-next-to-slice", "bool-next-to-slice-ios18",
    ],
)
def test_more_index_put_forms(model, inputs, target, why, stock):
    stock_options = {}
    if target:
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend as EtCoreML

        specs = EtCoreML.generate_compile_specs(minimum_deployment_target=ct.target[target])
        stock_options = {"compile_specs": specs}
    failure = stock_error(model, inputs, **stock_options)
    assert (stock in failure) if stock else failure == ""  # "": stock builds (wrong values when refused)

    artifact = compile_coreml(model, inputs, **({"minimum_deployment_target": target} if target else {}))
    assert artifact.pte  # to_executorch succeeded
    assert "aten.mul.Tensor" in delegated_ops(artifact)
    reasons = {n: r for n, r in cpu_reasons(artifact).items() if "index_put" in n}
    if why:
        (reason,) = reasons.values()
        assert why in reason
        assert ("(stock: " in reason) if stock else "coremltools converts it wrongly" in reason
    else:
        assert not reasons
        assert "aten.index_put.default" in delegated_ops(artifact)


class Stack5d(nn.Module):
    def forward(self, x):
        return torch.stack([x, x + 1], dim=1) * 2


def test_rank_above_five_runs_on_cpu():
    model, inputs = Stack5d(), (torch.randn(1, 2, 2, 2, 2),)
    assert "Core ML only supports tensors with rank <= 5" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    reasons = cpu_reasons(artifact)
    assert reasons and all("rank 6" in r for r in reasons.values())
    assert "aten.add.Tensor" in delegated_ops(artifact)


class FirstPositives(nn.Module):
    """A count read with .item() slices a tensor: a scalar known only at run time."""

    def forward(self, x, y):
        n = (x > 0).sum().item()
        torch._check(n >= 0)
        torch._check(n <= y.shape[0])
        return y[:n] * 2


def _first_positives_inputs():
    return torch.tensor([1.0, -1.0, 2.0, 3.0, -2.0, 0.5]), torch.randn(6, 3)


def test_stock_fails_on_a_slice_to_a_count_read_at_run_time():
    assert "should share the same data type" in stock_error(FirstPositives(), _first_positives_inputs())


def test_scalars_read_at_run_time_stay_on_cpu():
    artifact = compile_coreml(FirstPositives(), _first_positives_inputs())
    ops, reasons = cpu_ops(artifact), cpu_reasons(artifact)
    on_cpu = {ops[n]: reasons[n] for n in ops}
    for op in ("aten._local_scalar_dense.default", "aten.slice_copy.Tensor"):
        assert "a number read from a tensor at run time" in on_cpu[op]
    assert "aten.mul.Tensor" in delegated_ops(artifact) and "aten.sum.default" in delegated_ops(artifact)
    assert_matches_eager(artifact, FirstPositives(), _first_positives_inputs())


class AssignIntoBool(nn.Module):
    def forward(self, mask):
        out = mask.clone()
        out[1:3] = True
        return out, mask.any(0)


def test_slice_assign_into_bool_runs_on_the_cpu():
    model, inputs = AssignIntoBool(), (torch.rand(4, 5) > 0.5,)
    assert "expects tensor or scalar of dtype from type domain" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert any("of bool data" in reason for reason in cpu_reasons(artifact).values())


class GatherBool(nn.Module):
    def __init__(self, gather):
        super().__init__()
        self.gather = gather

    def forward(self, mask, x):
        return self.gather(mask), x * 2


@pytest.mark.parametrize(
    "gather, op",
    [
        (lambda m: m.index_select(0, torch.tensor([0, 2])), "aten.index_select.default"),
        (lambda m: torch.gather(m, 0, torch.tensor([3, 0, 0])), "aten.gather.default"),
        (lambda m: torch.select_scatter(m.reshape(2, 2), m[:2], 0, 1), "aten.select_scatter.default"),
    ],
    ids=["index_select", "gather", "select_scatter"],
)
def test_gathers_and_scatters_of_bool_stay_off_core_ml(gather, op):
    """On the CPU with the reason, or (select_scatter, refused so not kept whole) decomposed
    into ops Core ML takes."""
    model, inputs = GatherBool(gather), (torch.rand(4) > 0.5, torch.randn(3))
    assert "type domain" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert op not in delegated_ops(artifact)
    reasons = [cpu_reasons(artifact)[node] for node, cpu_op in cpu_ops(artifact).items() if cpu_op == op]
    assert all("of bool data" in reason for reason in reasons)
    assert compare_with_eager(artifact, model, inputs).passed


class IndexBool(nn.Module):
    """Integer indices into bool data (a mask picked per row, as a padding mask is)."""

    def forward(self, x, rows):
        mask = x > 0
        return mask[rows].float() * 2, mask[rows, rows.clamp(max=2)].float() + 1


def test_index_of_bool_data_runs_on_core_ml_like_stock():
    """coremltools' `index` gathers bool data through a cast (its `_construct_gather_op`); the
    bool-data rule once refused it too, and each transformer's mask indexing ran on the CPU."""
    model, inputs = IndexBool(), (torch.randn(5, 3), torch.tensor([0, 2, 4, 2]))
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    assert delegated_ops(artifact).count("aten.index.Tensor") == 2
    assert compare_with_eager(artifact, model, inputs).passed
    assert compare_with_eager(stock_pte(model, inputs), model, inputs).passed


class ProductOfConstants(nn.Module):
    """A matmul that reads no model input: kept whole for Core ML, its partition would
    have no inputs (Core ML needs iOS 18 for that), so it lands on the CPU, where the
    runtime has no matmul kernel unless the dry run decomposes it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return torch.ones(4, 3) @ self.w, x + 1


def test_a_kept_op_reading_no_model_input_is_decomposed_when_it_lands_on_the_cpu():
    model, inputs = ProductOfConstants(), (torch.randn(2),)
    artifact = compile_coreml(model, inputs)
    assert "matmul" not in {op.split(".")[-2] for op in cpu_ops(artifact).values()}
    assert artifact.stages["dry_run"].keep_whole.skipped is None


class RoundsThroughBfloat16(nn.Module):
    def forward(self, x):
        return (x * 2).to(torch.bfloat16).to(torch.float32).sin()


def test_a_cast_to_a_dtype_coremltools_cannot_name_runs_on_the_cpu():
    model, inputs = RoundsThroughBfloat16(), (torch.randn(2, 3),)
    assert "KeyError: torch.bfloat16" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert any("coremltools cannot name" in reason for reason in cpu_reasons(artifact).values())
    assert delegated_ops(artifact)


class ZeroDimFill(nn.Module):
    """0-d fills: `ones` and `new_zeros` Core ML cannot make; `full` and `zeros` it can."""

    def forward(self, x):
        return x * torch.ones(()) + x.new_zeros(()), x + torch.full((), 2.0), torch.zeros((), dtype=torch.int32) + 3


def test_a_zero_dim_ones_or_new_zeros_is_not_kept_whole_and_its_full_runs_on_core_ml():
    """Refused, a 0-d `ones` or `new_zeros` is not kept whole: it decomposes to a `full`,
    which Core ML makes (before the rule was narrowed to these two, every 0-d fill ran on the CPU)."""
    model, inputs = ZeroDimFill(), (torch.randn(2, 3),)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    delegated = delegated_ops(artifact)
    assert delegated.count("aten.full.default") == 3 and "aten.zeros.default" in delegated
    assert compare_with_eager(artifact, model, inputs).passed


class Fill(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        return x + self.fill(x)


_ZERO_DIM_FILLS = {
    "ones": lambda x: torch.ones(()),
    "new_zeros": lambda x: x.new_zeros(()),
    "full": lambda x: torch.full((), 2.0),
    "full_int": lambda x: torch.full((), 3, dtype=torch.int32),
    "zeros": lambda x: torch.zeros(()),
}


@pytest.mark.parametrize("fill", ["ones", "new_zeros"])
def test_stock_and_ours_without_the_rule_fail_on_a_zero_dim_fill(fill):
    model, inputs = Fill(_ZERO_DIM_FILLS[fill]), (torch.randn(2, 3),)
    assert "expects tensor or scalar of dtype from type domain ['int32']" in stock_error(model, inputs)
    with _without_rule("zero_dim_fill"), pytest.raises(CoreMLConversionError, match="type domain"):
        compile_coreml(model, inputs)


@pytest.mark.parametrize("fill", ["full", "full_int", "zeros"])
def test_stock_runs_a_zero_dim_full_or_zeros_right(fill):
    """What the rule leaves to Core ML: coremltools casts `full`'s shape to int32 and folds `zeros`."""
    model, inputs = Fill(_ZERO_DIM_FILLS[fill]), (torch.randn(2, 3),)
    assert compare_with_eager(stock_pte(model, inputs), model, inputs).passed


class PoolIndices(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def forward(self, x):
        values, indices = self.pool(x)
        return values * 2, indices


@pytest.mark.parametrize(
    "pool",
    [nn.MaxPool2d(2, return_indices=True), nn.AdaptiveMaxPool2d(3, return_indices=True)],
    ids=["max_pool2d", "adaptive_max_pool2d"],
)
def test_a_pool_whose_indices_are_used_runs_on_the_cpu(pool):
    model, inputs = PoolIndices(pool), (torch.randn(1, 2, 6, 6),)
    if isinstance(pool, nn.MaxPool2d):  # stock refuses the adaptive one earlier (not core ATen)
        assert "does not handle/bind value at index 1" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    # the adaptive pool is not kept whole: its decomposition is a max_pool2d_with_indices
    assert list(cpu_ops(artifact).values()) == ["aten.max_pool2d_with_indices.default"]
    assert all("whose indices are used" in reason for reason in cpu_reasons(artifact).values())
    assert "aten.mul.Tensor" in delegated_ops(artifact)


class PadBool(nn.Module):
    """Gemma 3's image-block start: `pad(is_image, (1, 0))[:, :-1]`, then `~`."""

    def forward(self, ids):
        is_image = ids == 7
        previous = nn.functional.pad(is_image, (1, 0), value=0)[:, :-1]
        return (is_image & ~previous).int().cumsum(1)


def test_pad_of_bool_runs_on_the_cpu():
    model, inputs = PadBool(), (torch.tensor([[1, 7, 7, 2, 7]]),)
    assert "bitwise_not" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert any("pad" in op and "of bool data" in cpu_reasons(artifact)[node] for node, op in cpu_ops(artifact).items())


def _without_rule(name):
    from compiler.backends.coreml import rules

    return mock.patch.object(rules, "NODE_RULES", rules.NODE_RULES.without(name))


class Pooled(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def forward(self, x):
        return self.pool(x) * 2


@pytest.mark.parametrize(
    "pool, shape, on_cpu",
    [
        (lambda x: F.max_pool2d(x, 2, 3, ceil_mode=True), (1, 2, 6, 6), True),
        (lambda x: F.avg_pool2d(x, 2, 3, ceil_mode=True), (1, 2, 6, 6), True),
        (lambda x: F.max_pool1d(x, 2, 3, ceil_mode=True), (1, 2, 6), True),
        # the last window starts inside the input: Core ML keeps it too
        (lambda x: F.max_pool2d(x, 2, 2, ceil_mode=True), (1, 2, 5, 5), False),
        # padded: Core ML drops a window past the input too
        (lambda x: F.max_pool2d(x, 3, 2, padding=1, ceil_mode=True), (1, 2, 6, 6), False),
    ],
    ids=["max_pool2d", "avg_pool2d", "max_pool1d", "last-window-inside", "padded"],
)
def test_a_ceil_mode_pool_whose_last_window_starts_past_the_input_runs_on_the_cpu(pool, shape, on_cpu):
    """torch (1, 2, 2, 2), Core ML's program (1, 2, 3, 3) for max_pool2d(2, 3, ceil_mode) of 6x6."""
    model, inputs = Pooled(pool), (torch.randn(*shape),)
    artifact = compile_coreml(model, inputs, compute_precision="float32")
    reasons = [r for r in cpu_reasons(artifact).values() if "ceil_mode" in r]
    assert len(reasons) == (1 if on_cpu else 0)
    assert "aten.mul.Tensor" in delegated_ops(artifact)
    assert compare_with_eager(artifact, model, inputs).passed


def test_a_ceil_mode_pool_past_the_input_is_the_wrong_shape_on_core_ml():
    from compiler.running.reference import ReferenceExecutionError

    model, inputs = Pooled(lambda x: F.max_pool2d(x, 2, 3, ceil_mode=True)), (torch.randn(1, 2, 6, 6),)
    with _without_rule("ceil_mode_pool_past_the_input"):
        artifact = compile_coreml(model, inputs, compute_precision="float32")
    assert not cpu_ops(artifact)
    with pytest.raises(ReferenceExecutionError, match=r"shape \(1, 2, 3, 3\).*\(1, 2, 2, 2\)"):
        compare_with_eager(artifact, model, inputs)


class PixelUnshuffle(nn.Module):
    def forward(self, x):
        return F.pixel_unshuffle(x, 2) * 2


def test_the_rule_refuses_pixel_unshuffle_below_ios16_only():
    import coremltools as ct

    from compiler.backends.coreml.rules import RuleContext, refusal

    program = torch.export.export(PixelUnshuffle(), (torch.randn(1, 2, 4, 4),))
    (node,) = [n for n in program.graph.nodes if n.target == torch.ops.aten.pixel_unshuffle.default]
    assert "below iOS 16" in refusal(node, RuleContext())
    assert "below iOS 16" in refusal(node, RuleContext(minimum_deployment_target=ct.target.iOS15))
    assert refusal(node, RuleContext(minimum_deployment_target=ct.target.iOS16)) is None


@pytest.mark.parametrize("target", [None, "iOS15", "iOS16"])
def test_pixel_unshuffle_below_ios16_is_not_kept_whole(target):
    """Refused, pixel_unshuffle is not kept whole: its decomposition (views and a permute)
    runs on Core ML at any target. Kept whole below iOS 16, lowering stopped on it."""
    model, inputs = PixelUnshuffle(), (torch.randn(1, 2, 4, 4),)
    options = {"minimum_deployment_target": target} if target else {}
    artifact = compile_coreml(model, inputs, compute_precision="float32", **options)
    assert not cpu_ops(artifact)
    delegated = delegated_ops(artifact)
    if target == "iOS16":
        assert "aten.pixel_unshuffle.default" in delegated
    else:
        assert "aten.pixel_unshuffle.default" not in delegated and "aten.permute_copy.default" in delegated
    assert compare_with_eager(artifact, model, inputs).passed


def test_without_the_rule_pixel_unshuffle_below_ios16_stops_lowering():
    model, inputs = PixelUnshuffle(), (torch.randn(1, 2, 4, 4),)
    with _without_rule("pixel_unshuffle_before_ios16"), pytest.raises(CoreMLConversionError, match="No available version for pixel_unshuffle"):
        compile_coreml(model, inputs)


def test_stock_fails_on_pixel_unshuffle_below_ios16():
    model, inputs = PixelUnshuffle(), (torch.randn(1, 2, 4, 4),)
    assert "No available version for pixel_unshuffle in the coremltools.target.iOS15 opset" in stock_error(model, inputs)


class FlatPickedRows(nn.Module):
    """A bool index picks u rows; a view sizes them 16*u (on the CPU: it reads u), read by ops Core ML takes."""

    def forward(self, x, keep):
        rows = x[keep]
        return rows.view(rows.shape[0] * 16).exp() * 2


_PICKED_ROWS = (torch.randn(6, 16), torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool))


def test_an_op_reading_a_size_expression_from_outside_core_ml_runs_on_the_cpu():
    model, inputs = FlatPickedRows(), _PICKED_ROWS
    artifact = compile_coreml(model, inputs)
    ops, reasons = cpu_ops(artifact), cpu_reasons(artifact)
    for op in ("aten.exp.default", "aten.mul.Tensor"):
        (node,) = [n for n, o in ops.items() if o == op]
        assert "sized 16*u" in reasons[node] and "from outside its Core ML partition" in reasons[node]
    assert "aten.index.Tensor" in delegated_ops(artifact)
    assert compare_with_eager(artifact, model, inputs).passed


def test_without_the_rule_coremltools_refuses_a_size_expression_input(monkeypatch):
    from compiler.backends.coreml import rules
    from compiler.ir.errors import StageFailure

    monkeypatch.setattr(rules, "reads_size_expression", lambda node, inside: None)
    with pytest.raises(StageFailure, match=r"expressions of symbolic variables, but got 16\*u"):
        compile_coreml(FlatPickedRows(), _PICKED_ROWS)


class AttentionOverDoubledRows(nn.Module):
    """SDPA (kept whole for Core ML, no CPU kernel) reading 2*n rows from an op on the CPU (log1p)."""

    def forward(self, x):
        rows = torch.log1p(torch.cat([x, x]).abs())
        q = rows.view(1, 1, rows.shape[0], 8)
        return F.scaled_dot_product_attention(q, q, q)


def test_a_kept_op_reading_a_size_expression_from_the_cpu_is_decomposed_there():
    """The size rule refuses it after the search, so the dry run must see it (else it stays whole on the CPU, without a kernel)."""
    import compiler

    model, inputs = AttentionOverDoubledRows(), (torch.rand(3, 8),)
    artifact = compiler.compile(model, inputs, "coreml", dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    assert "is sized 2*s" in artifact.report.stage("dry_run").metrics["because"]
    assert "aten.scaled_dot_product_attention.default" not in cpu_ops(artifact).values()
    assert "aten.bmm.default" in cpu_ops(artifact).values()
    assert compare_with_eager(artifact, model, (torch.rand(5, 8),)).passed


# --- calls whose converter fails: kept off Core ML, they run on the CPU or decompose ----------


class Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class TrainingBatchNormStatistics(nn.Module):
    """Inference batch norm whose saved mean and inverse std (empty in eval) are outputs too."""

    def forward(self, x, weight, bias, mean, var):
        return torch.native_batch_norm(x, weight, bias, mean, var, False, 0.1, 1e-5)


_CONVERTER_FAILURES = {
    "amin-of-0-d": (Call(lambda x: x.amin(0, keepdim=True)), (torch.tensor(2.5),), "aten.amin.default", "0-d"),
    "flip-of-no-dims": (Call(lambda x: x.flip([]) * 2), (torch.randn(2, 3),), "aten.flip.default", "of no dims"),
    "roll-without-dims": (Call(lambda x: torch.roll(x, 2) * 2), (torch.randn(2, 3),), "aten.roll.default", "without dims"),
    "mse_loss-default-reduction": (Call(F.mse_loss), (torch.randn(2, 3), torch.randn(2, 3)), "aten.mse_loss.default",
                                   "reduction left out"),
    "irfft-of-a-real-input": (Call(lambda x: torch.fft.irfft(x, dim=0)), (torch.randn(5, 3),), "aten.fft_irfft.default",
                              "real one"),
    "avg_pool-divisor_override": (Call(lambda x: F.avg_pool2d(x, 3, 1, 1, divisor_override=2)), (torch.randn(1, 2, 5, 5),),
                                  "aten.avg_pool2d.default", "divisor_override"),
    "batch-norm-statistics-used": (TrainingBatchNormStatistics(), (torch.randn(2, 3, 4), torch.randn(3), torch.randn(3),
                                                                   torch.randn(3), torch.rand(3) + 1),
                                   "aten._native_batch_norm_legit_no_training.default", "saved mean or inverse std"),
}


@pytest.mark.parametrize("case", list(_CONVERTER_FAILURES))
def test_a_call_coremltools_cannot_convert_stays_off_core_ml_and_matches_eager(case):
    """Stock fails converting each of these (OpInfo's samples): 'pop from empty list', 'got 2
    input(s), expected [3]', 'expects ... complex64', 'divisor_override is not supported', 'does
    not handle/bind value at index 1'. Refused by a rule, each runs on the CPU (the irfft:
    decomposed there) or is decomposed into ops Core ML takes, and matches eager."""
    model, inputs, op, why = _CONVERTER_FAILURES[case]
    assert stock_error(model, inputs)
    artifact = compile_coreml(model, inputs, compute_precision="float32")
    assert op not in delegated_ops(artifact)
    reasons = " ".join(cpu_reasons(artifact).values())
    assert why in reasons or op not in cpu_ops(artifact).values()
    assert_matches_eager(artifact, model, inputs)


def test_a_converter_that_fails_gives_a_refusal_naming_its_node(monkeypatch):
    """Where no rule keeps the call off Core ML, coremltools' own error (the roll converter's
    'got 2 input(s), expected [3]') becomes our error naming the node, with the option that
    keeps the op on the CPU."""
    from compiler.backends.coreml import rules

    monkeypatch.setattr(rules, "NODE_RULES", rules.NODE_RULES.without("arguments_left_out"))
    model, inputs, _, _ = _CONVERTER_FAILURES["roll-without-dims"]
    with pytest.raises(CoreMLConversionError) as caught:
        compile_coreml(model, inputs)
    error = caught.value
    assert error.stage == "lower" and error.nodes == ("aten_roll_default",)
    assert "converter `roll` raised ValueError: node aten_roll_default (roll) got 2 input(s), expected [3]" in error.reason
    assert error.suggest == {"skip_ops_for_coreml_delegation": ["aten.roll"]}
