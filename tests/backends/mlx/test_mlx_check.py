"""Compiled for MLX, run here (CPU nodes in torch, MLX payloads with mlx.core), compared with eager."""

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.models.examples import mlp, transformer
from compiler.running.runtime import compare_with_eager

TOLERANCE = 1e-4


def _check(model, inputs, **options):
    artifact = compiler.compile(model, inputs, backend="mlx", **options)
    result = compare_with_eager(artifact, model, inputs)
    assert result.max_abs_error < TOLERANCE, result
    return artifact


def _placement(artifact, op):
    return [row for row in artifact.report.placement if row.op == op]


def test_mlp_matches_eager():
    model, inputs = mlp(features=16, hidden=32)
    artifact = _check(model, inputs)
    assert artifact.program.delegates == ("MLXBackend",)
    assert artifact.program.operators == ()  # all of it is in the payload


def test_transformer_example_matches_eager():
    model, inputs = transformer(depth=1, dim=32, heads=2, seq=8)
    artifact = _check(model, inputs)
    assert artifact.program.delegates == ("MLXBackend",)


class IntegerIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cols", torch.tensor([3, 0, 2]))
        self.register_buffer("rows", torch.tensor([[1, 0], [2, 3]]))
        self.register_buffer("pick", torch.tensor([1, 5]))

    def forward(self, x, i):
        return (
            x[:, self.cols] * 2.0,  # one index after a slice: take
            torch.index_select(x, 0, i),  # a run-time integer index
            x[self.rows, self.pick],  # two broadcast indices: gather
            x[i] + 1.0,
        )


def test_integer_index_ops_match_eager():
    model = IntegerIndex().eval()
    artifact = _check(model, (torch.randn(4, 8), torch.tensor([2, 1, 1])))
    assert all(row.where == "MLXBackend" for row in _placement(artifact, "aten.index.Tensor"))
    assert _placement(artifact, "aten.index_select.default")[0].where == "MLXBackend"


class RunTimeMask(torch.nn.Module):
    def forward(self, x):
        y = x * 2.0
        return y[y > 0] + 1.0


class RunTimeMaskPut(torch.nn.Module):
    def forward(self, x):
        y = x * 2.0
        y[y > 0] = 0.0
        return y + 1.0


def test_run_time_bool_mask_put_stays_on_cpu_with_reason():
    artifact = _check(RunTimeMaskPut().eval(), (torch.randn(4, 8),))
    (row,) = _placement(artifact, "aten.index_put.default")
    assert row.where == "cpu"
    assert "boolean index" in row.reason and "Boolean indices not supported" in row.reason
    assert artifact.program.operators == ("aten::index_put.out",)


def test_run_time_bool_mask_index_stays_on_cpu_and_matches_eager():
    artifact = _check(RunTimeMask().eval(), (torch.randn(4, 8),))
    (row,) = _placement(artifact, "aten.index.Tensor")
    assert row.where == "cpu" and "boolean index" in row.reason
    # MLX on both sides of it: the second payload takes a tensor of run-time size.
    assert artifact.program.delegates == ("MLXBackend", "MLXBackend")


class SameRankIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.tensor([[1, 0], [2, 3]]))

    def forward(self, x):
        return x[self.rows] * 2.0


def test_same_rank_single_index_stays_on_cpu_with_reason():
    artifact = _check(SameRankIndex().eval(), (torch.randn(4, 8),))
    (row,) = _placement(artifact, "aten.index.Tensor")
    assert row.where == "cpu" and "take_along_axis" in row.reason


def test_cli_compile_transformer_check(capsys, tmp_path):
    out_file = tmp_path / "transformer.pte"
    assert main(["compile", "transformer", "--backend", "mlx", "--check", "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "MLXBackend" in out and "OK" in out
    assert out_file.stat().st_size > 0


class ConstantMasks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cols", torch.tensor([True, False, True, True, False, False, True, False]))
        self.register_buffer("cells", torch.rand(4, 8) > 0.5)

    def forward(self, x):
        return x[:, self.cols] * 2.0, x[self.cells] + 1.0


def test_constant_bool_masks_reach_mlx_as_integer_positions():
    artifact = _check(ConstantMasks().eval(), (torch.randn(4, 8),))
    rows = _placement(artifact, "aten.index.Tensor")
    assert rows and all(row.where == "MLXBackend" for row in rows)
    partitioned = artifact.stages["partition"].program
    for node in partitioned.graph.nodes:
        if "index" in str(node.target):
            indices = [i for i in node.args[1] if i is not None]
            assert all(i.meta["val"].dtype != torch.bool for i in indices)


class Accumulator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4, 8))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2.0


def test_state_taken_over_by_mlx_matches_eager():
    artifact = compiler.compile(Accumulator().eval(), (torch.randn(4, 8),), backend="mlx")
    assert artifact.program.delegates == ("MLXBackend",)
    x = torch.randn(4, 8)
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, Accumulator()(x))


class ConstantOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.0, 1.0, 8))

    def forward(self, x):
        return x + 1.0, self.w * 2.0  # the second output folds to a constant


def test_folding_on_the_mlx_path_keeps_the_aten_program_aten():
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    artifact = _check(ConstantOutput().eval(), (torch.randn(2, 8),))
    folded = artifact.stages["fold"].program
    targets = [n.target for n in folded.graph.nodes if n.op == "call_function"]
    assert not any(isinstance(t, EdgeOpOverload) for t in targets)
    assert torch.ops.aten.clone.default in targets


class ManyOps(torch.nn.Module):
    """One payload with many node types: elementwise, reductions, shapes, norms, pad."""

    def forward(self, x):
        f = torch.nn.functional
        return (
            torch.softmax(x, -1), f.silu(x), torch.cat([x[:, :2], x[:, 4:]], 1), torch.where(x > 0, x, -x),
            x.mean(-1, keepdim=True), torch.rsqrt(x.abs() + 1), x.unsqueeze(0).expand(2, -1, -1).sum(0),
            f.rms_norm(x, (8,), eps=1e-6), torch.tanh(x) * torch.sigmoid(x), x.flip(0), torch.clamp(x, -0.5, 0.5),
            torch.stack([x, x], 1), x.amax(0), torch.argmax(x, 1), x.pow(2), torch.exp(x) / 3.0, x[:, 1::2],
            torch.zeros(2, 3) + x.sum(), x.to(torch.int32), f.gelu(x, approximate="tanh"), x.var(1),
            torch.cumsum(x, 1), f.pad(x, (1, 2)), x.t().contiguous(), torch.tril(x), x.repeat(2, 1), x.split(3, 1)[2],
        )


def test_many_payload_node_types_match_eager():
    artifact = _check(ManyOps().eval(), (torch.randn(4, 8),))
    assert all(row.where == "MLXBackend" for row in artifact.report.placement)


class SharedWithCpu(torch.nn.Module):
    """One buffer read by an op MLX takes and by a run-time bool-mask gather that stays on the CPU."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(32.0).reshape(4, 8) / 7)

    def forward(self, x):
        return x * self.table, self.table[x > 0]


def test_constant_shared_by_mlx_and_a_cpu_op_is_split_and_matches_eager():
    artifact = _check(SharedWithCpu().eval(), (torch.randn(4, 8),))
    assert artifact.report.stage("split_constants").metrics["copies"] == 1
    split = artifact.stages["split_constants"].program
    table = next(n for n in split.graph.nodes if n.name == "b_table")
    copy = next(n for n in split.graph.nodes if n.name == "b_table_copy_0")
    assert {u.meta.get("delegation_tag") for u in table.users} == {None}
    assert {u.meta.get("delegation_tag") for u in copy.users} == {copy.meta["delegation_tag"]}


class RunningTotal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.full((4, 8), 2.0))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 1.0


def test_state_that_does_not_start_at_zero_stays_cpu_owned_and_matches_eager():
    artifact = _check(RunningTotal().eval(), (torch.randn(4, 8),))
    assert artifact.program.delegates == ("MLXBackend",)
    partitioned = artifact.stages["partition"].program
    buffer = next(n for n in partitioned.graph.nodes if n.name == "b_total")
    assert "delegation_tag" not in buffer.meta  # MLX would start the state it owns at zeros
    assert artifact.report.stage("emit").metrics["initialized_state"] == 1


class DoubleSinusoid(torch.nn.Module):
    """A float64 sinusoidal embedding cast back to float32 (pi0's time embedding does this)."""

    def forward(self, x):
        t = x.double() * 2.0
        return torch.cat([t.sin(), t.cos()], -1).float() + 1.0


def test_float64_inside_a_tensor_list_stays_on_cpu_with_reason():
    artifact = _check(DoubleSinusoid().eval(), (torch.randn(1, 4),))
    (row,) = _placement(artifact, "aten.cat.default")
    assert row.where == "cpu" and "float64" in row.reason and "cannot hold" in row.reason
    assert _placement(artifact, "aten.add.Tensor")[0].where == "MLXBackend"


class FillAll(torch.nn.Module):
    """`y[0:1] = 3.0` over all of a (1, 4) y: an aten.copy of a 0-d source onto (1, 4)."""

    def __init__(self, reduce: bool = False):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        y = x.clone()
        y[0:1] = 3.0
        return y.sum(-1) if self.reduce else y


@pytest.mark.parametrize("reduce", [False, True], ids=["returned", "summed"])
def test_copy_of_a_smaller_source_keeps_the_destination_shape(reduce):
    model, x = FillAll(reduce).eval(), torch.randn(1, 4)
    artifact = _check(model, (x,))
    (out,) = compiler.run(artifact, (x,))
    expected = model(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)
    assert _placement(artifact, "aten.copy.default")[0].where == "MLXBackend"


class CopyCast(torch.nn.Module):
    """copy_ of an int32 [4] source onto a float32 [2, 4] destination: broadcast and cast."""

    def forward(self, x, i):
        y = x * 1.0
        y.copy_(i)
        return y + 0.5


def test_copy_of_another_dtype_and_shape_matches_eager():
    model, inputs = CopyCast().eval(), (torch.randn(2, 4), torch.arange(4, dtype=torch.int32))
    artifact = _check(model, inputs)
    (out,) = compiler.run(artifact, inputs)
    expected = model(*inputs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)


class FillDynamic(torch.nn.Module):
    def forward(self, x):
        y = x.clone()
        y[:] = 3.0
        return y + x


def test_copy_onto_a_symbolic_shape_stays_on_cpu_with_reason():
    from torch.export import Dim

    model, x = FillDynamic().eval(), torch.randn(3, 4)
    artifact = _check(model, (x,), dynamic_shapes=({0: Dim("n", min=2, max=8)},))
    (row,) = _placement(artifact, "aten.copy.default")
    assert row.where == "cpu" and "unbroadcast" in row.reason
    longer = torch.randn(5, 4)
    (out,) = compiler.run(artifact, (longer,))
    torch.testing.assert_close(out, model(longer))


class BoolMask(torch.nn.Module):
    """pi0's attention mask: a bool `ones` joined with a bool input, then and-ed."""

    def forward(self, m):
        c = torch.cat([torch.ones(1, 2, dtype=torch.bool), m], 1)
        return (c.unsqueeze(1) * c.unsqueeze(2)) & (torch.cumsum(c, 1).unsqueeze(1) <= torch.cumsum(c, 1).unsqueeze(2))


def test_bool_full_inside_a_payload_matches_eager():
    m = torch.tensor([[True, False, True]])
    artifact = _check(BoolMask().eval(), (m,))
    assert all(row.where == "MLXBackend" for row in artifact.report.placement)


class DescendingSorts(torch.nn.Module):
    """Arguments stock's MLX sort/argsort/topk handlers ignore, both outputs read."""

    def forward(self, x):
        values, indices = torch.sort(x, dim=1, descending=True)
        smallest, where = torch.topk(x, 3, dim=-1, largest=False)
        return values, indices, torch.argsort(x, dim=0, descending=True), smallest, where


def test_descending_sort_and_smallest_topk_match_eager_on_mlx():
    torch.manual_seed(0)
    model, inputs = DescendingSorts(), (torch.randn(4, 7, 5),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    cpu = [p.op for p in artifact.stages["partition"].plan.nodes if p.tag is None]
    assert not cpu, cpu  # rewritten, not refused: all on MLX
    for out, expected in zip(compiler.run(artifact, inputs), model(*inputs), strict=True):
        assert out.dtype == expected.dtype and torch.equal(out, expected)


def _matches_eager_exactly(model, inputs):
    artifact = compiler.compile(model, inputs, backend="mlx")
    outputs, expected = compiler.run(artifact, inputs), model(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected, strict=True):
        assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, out.dtype, want.shape, want.dtype)
        torch.testing.assert_close(out, want)
    return artifact


class FlatArgReductions(torch.nn.Module):
    """argmax/argmin over all elements with keepdim=True: stock's handlers ignored keepdim (0-d result)."""

    def forward(self, x):
        return torch.argmax(x, keepdim=True), torch.argmin(x, keepdim=True) + 1


def test_argmax_argmin_over_all_elements_keep_their_dims_on_mlx():
    torch.manual_seed(0)
    artifact = _matches_eager_exactly(FlatArgReductions(), (torch.randn(2, 3, 4),))
    assert _placement(artifact, "aten.argmax.default")[0].where == "MLXBackend"
    assert _placement(artifact, "aten.argmin.default")[0].where == "MLXBackend"


class Nearest(torch.nn.Module):
    """Scale factors whose output is the input's size or twice it: torch ignores the scale there."""

    def forward(self, x):
        f = torch.nn.functional
        return f.interpolate(x, scale_factor=2.2), f.interpolate(x, scale_factor=(1.2, 1.7)) * 2.0


def test_nearest_upsampling_with_a_scale_torch_ignores_matches_eager_on_mlx():
    torch.manual_seed(0)
    artifact = _matches_eager_exactly(Nearest(), (torch.randn(1, 2, 3, 5),))
    rows = _placement(artifact, "aten.upsample_nearest2d.vec") + _placement(artifact, "aten.upsample_nearest2d.default")
    assert rows and all(row.where == "MLXBackend" for row in rows), rows


class NoValueArguments(torch.nn.Module):
    """copy_(non_blocking=True) and expand(implicit=True): the same values as without them."""

    def forward(self, x, y):
        z = x * 1.0
        z.copy_(y, non_blocking=True)
        return z + 1.0, torch.ops.aten.expand.default(x[:, :1], [3, 4], implicit=True) * 2.0


def test_copy_and_expand_with_arguments_that_change_no_value_run_on_mlx():
    torch.manual_seed(0)
    artifact = _matches_eager_exactly(NoValueArguments(), (torch.randn(3, 4), torch.randn(3, 4)))
    assert all(row.where == "MLXBackend" for row in artifact.report.placement), artifact.report.placement


class IntegerFloorDivision(torch.nn.Module):
    def forward(self, x, i):
        j = (i // 2) * 2 + 1  # a float 3.5 on MLX for 7: as an index MLX refuses it
        k = torch.div(i, 3, rounding_mode="floor") * 3
        return x[j], j, k


def _floor_division_case():
    return IntegerFloorDivision(), (torch.randn(10, 3), torch.tensor([0, 3, 7, 8]))


def test_integer_floor_division_stays_on_cpu_and_matches_eager():
    model, inputs = _floor_division_case()
    artifact = compiler.compile(model, inputs, backend="mlx")
    cpu = {p.op: p.reason for p in artifact.stages["partition"].plan.nodes if p.tag is None}
    assert "mlx::divide" in cpu["aten.div.Tensor_mode"]
    for out, expected in zip(compiler.run(artifact, inputs), model(*inputs), strict=True):
        assert out.dtype == expected.dtype and torch.equal(out, expected)


def test_without_the_rule_the_payload_fails_as_the_runtime_would(monkeypatch):
    from compiler.backends.mlx import support
    from compiler.backends.mlx.interpreter import MLXNodeFailure

    monkeypatch.setattr(support, "RULES", support.RULES.without("integer_floor_division"))
    model, inputs = _floor_division_case()
    artifact = compiler.compile(model, inputs, backend="mlx")
    with pytest.raises(MLXNodeFailure) as err:
        compiler.run(artifact, inputs)
    assert err.value.nodes == ("TakeNode",) and "integral" in str(err.value)


class FarNearest(torch.nn.Module):
    """A scale where torch (float32) and stock's handler (float64) round 1 / scale apart."""

    def forward(self, x):
        return torch.nn.functional.interpolate(x, scale_factor=(1.0, 49.0)) + 1.0


def test_nearest_upsampling_torch_rounds_otherwise_stays_on_cpu_and_matches_eager():
    torch.manual_seed(0)
    artifact = _matches_eager_exactly(FarNearest(), (torch.randn(1, 2, 3, 2),))
    (row,) = _placement(artifact, "aten.upsample_nearest2d.vec")
    assert row.where == "cpu" and "other source rows or columns than torch" in row.reason


class IntegerClamp(torch.nn.Module):
    """An integer tensor clamped by float bounds: torch clamps in float32 (0.5 stays 0.5)."""

    def forward(self, i):
        return torch.clamp(i, min=0.5), torch.clamp(i, -1.5, 0.5) * 2


def test_integer_clamp_by_float_bounds_matches_eager_on_mlx():
    artifact = _matches_eager_exactly(IntegerClamp(), (torch.tensor([[-3, 0, 1, 4]], dtype=torch.int32),))
    rows = _placement(artifact, "aten.clamp.default")
    assert rows and all(row.where == "MLXBackend" for row in rows), rows


class DeadMaskIndex(torch.nn.Module):
    """A bool-mask index nothing uses: stock's support check calls the fill feeding it
    supported because its users are dead code, but our rule runs the index on the CPU,
    which makes the fill live outside MLX (which has no handler for it); the dry run
    then drops the fill, and the decompose stage after it must not trip over the
    unbacked size the dry run's trace of the index left pending."""

    def forward(self, x, y):
        mask = x.new_ones((1, 1, 5), dtype=torch.bool)
        mask[mask]
        return y * 2


def test_a_fill_that_is_only_dead_code_to_stock_runs_on_the_cpu_when_its_user_does():
    inputs = (torch.randn(2, 3), torch.randn(4))
    artifact = compiler.compile(DeadMaskIndex(), inputs, "mlx")
    (got,) = compiler.run(artifact, inputs)
    torch.testing.assert_close(got, inputs[1] * 2)
    assert artifact.stages["dry_run"].keep_whole.dropped


class SizeCheckedMask(torch.nn.Module):
    """Gemma 3's image-token check: a run-time bool mask's selection read only for its size,
    which only export's assertions read."""

    def forward(self, ids, x):
        mask = (ids == 7).unsqueeze(-1).expand_as(x)
        torch._check(x[mask].numel() == 8)
        return x * 2.0


def test_a_bool_index_only_assertions_read_places_at_least_as_stock_does():
    """Stock's builder drops the index (its readers end in assertions, which MLX does not run);
    ours kept it on the CPU by the boolean-index rule, one CPU call and a second delegate more."""
    from compiler.stages.emit import pte_calls
    from executorch.backends.mlx.partitioner import MLXPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model, inputs = SizeCheckedMask(), (torch.tensor([[1, 7, 3, 7, 2]]), torch.randn(1, 5, 4))
    exported = torch.export.export(model, inputs)
    stock = to_edge_transform_and_lower(exported, partitioner=[MLXPartitioner()]).to_executorch().buffer
    assert compare_with_eager(stock, model, inputs).passed
    artifact = _check(model, inputs)
    ours, theirs = pte_calls(artifact.pte), pte_calls(stock)
    assert (ours.delegates, ours.cpu_calls) == (theirs.delegates, theirs.cpu_calls) == (1, 0)
    assert not _placement(artifact, "aten.index.Tensor")


class Histogram(torch.nn.Module):
    def forward(self, x):
        return torch.histogramdd(x, bins=[3, 4]).hist


def test_an_op_with_a_list_among_its_results_gets_our_refusal_not_the_support_checks_crash():
    """histogramdd's bin edges are a list of tensors: stock's MLX support check crashed on them
    (NotImplementedError: val_to_idtype: [FakeTensor, ...]) before any stage could name the op."""
    from compiler.ir.errors import UnsupportedOp

    with pytest.raises(UnsupportedOp, match="histogramdd"):
        compiler.compile(Histogram(), (torch.randn(10, 2),), "mlx")


class FractionalVariance(torch.nn.Module):
    def forward(self, x):
        return torch.var(x, correction=0.5, keepdim=True)


class FlatRepeat(torch.nn.Module):
    def forward(self, x):
        return torch.repeat_interleave(x, 2)


@pytest.mark.parametrize(
    "switch, model, op",
    [("fractional_correction", FractionalVariance(), "aten.var.correction"),
     ("repeat_interleave_flattened", FlatRepeat(), "aten.repeat_interleave.self_int")],
    ids=["var-correction-0.5", "repeat_interleave-no-dim"],
)
def test_a_call_stocks_handler_computes_otherwise_is_not_delegated_whole_and_matches_eager(switch, model, op):
    """Stock's var handler passes int(correction) to MLX (0.5 computes 0): the call stays on the
    CPU. Its repeat_interleave handler repeats along dim 0 where torch, given no dim, repeats
    the flattened input: the call is decomposed (into ops MLX takes) instead of kept whole."""
    from compiler.backends.mlx.fixes import fixes_off

    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 4),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    assert op not in {p.op for p in artifact.program.plan.delegated_nodes}
    assert compare_with_eager(artifact, model, inputs).passed
    with fixes_off(switch):
        wrong = compiler.compile(model, inputs, backend="mlx", verify=False)
    assert op in {p.op for p in wrong.program.plan.delegated_nodes}
    assert not compare_with_eager(wrong, model, inputs).passed


class Argwhere(torch.nn.Module):
    def forward(self, x):
        return torch.argwhere(x > 0)


def test_a_partition_of_size_arithmetic_only_stays_on_the_cpu():
    """MLX has no nonzero: it runs on the CPU, and the size checks after it (sym_size, its bounds'
    asserts) made an MLX partition of no tensor and no output, which to_backend could not fuse
    ('Cannot determine insertion point ... orig_outputs is empty')."""
    model, inputs = Argwhere(), (torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.5, 0.0]]),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    placed = {p.op: p.tag for p in artifact.program.plan.nodes}
    assert placed["aten.gt.Scalar"] and placed["aten.sym_size.int"] is None
    assert torch.equal(compiler.run(artifact, inputs)[0], model(*inputs))


class Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_RUN_TIME_FAILURES = {  # rule -> model, input, the CPU reason, the payload's failure without the rule
    "dim_of_a_zero_d_tensor": (Call(lambda x: x.amin(-1) * 2), torch.tensor(1.5), "no axis of a 0-d array",
                               "Invalid axis -1"),
    "pool_of_an_unbatched_input": (Call(lambda x: torch.nn.functional.adaptive_max_pool1d(x * 2, 1)),
                                   torch.randn(4, 4), "pools batched inputs only",
                                   "Received 4 axes for array with 3 dimensions"),
}


@pytest.mark.parametrize("rule", list(_RUN_TIME_FAILURES))
def test_a_call_mlx_refuses_when_the_payload_runs_stays_on_the_cpu(rule, monkeypatch):
    """Without the rule the payload fails as the MLX runtime would (OpInfo's amin of a 0-d tensor,
    adaptive_max_pool1d of a 2-D input); with it the call runs on the CPU and matches eager."""
    from compiler.backends.mlx import support
    from compiler.backends.mlx.interpreter import MLXNodeFailure

    model, x, reason, failure = _RUN_TIME_FAILURES[rule]
    artifact = compiler.compile(model, (x,), backend="mlx")
    assert any(reason in (p.reason or "") for p in artifact.program.plan.cpu_nodes)
    assert torch.equal(compiler.run(artifact, (x,))[0], model(x))
    monkeypatch.setattr(support, "RULES", support.RULES.without(rule))
    with pytest.raises(MLXNodeFailure, match=failure):
        compiler.run(compiler.compile(model, (x,), backend="mlx"), (x,))
