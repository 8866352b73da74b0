"""The dry run: keep whole only what the backend really takes, skip when nothing can change."""

import attrs
import pytest
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import compiler
import compiler.models.examples
import compiler.stages.dry_run as dry_run_module
from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.backends.coreml import CoreMLBackend
from compiler.ir.dialect import ATEN, op_dialect, op_name
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from executorch.runtime import Runtime


class Attention(torch.nn.Module):
    def forward(self, q, k):
        return torch.matmul(q, k.transpose(-1, -2)).softmax(-1)


def inputs():
    return torch.randn(2, 3, 4), torch.randn(2, 3, 4)


class KeepMatmulTakeNothing(Partitioner):
    """Like CoreMLPartitioner with `skip_ops_for_coreml_delegation=["aten.matmul.default"]`:
    the support check passes the ATen node (so it is kept whole) but not the Edge node (so
    it is not delegated, and stock's own after-lowering check does not notice)."""

    def ops_to_not_decompose(self, ep):
        return [torch.ops.aten.matmul.default], lambda node: op_dialect(node.target) == ATEN

    def partition(self, ep):
        return PartitionResult(ep, {})


class KeepMatmulBackend(Backend):
    name = "keep-matmul"

    def keep_whole(self, program):
        ops, node_filter = KeepMatmulTakeNothing().ops_to_not_decompose(program)
        return KeepWhole(frozenset(ops), node_filter)

    def partition(self, program):
        return BackendPartition({}, {n.name: "refused by this backend's rules" for n in program.graph.nodes})


def test_stock_keeps_matmul_whole_and_the_pte_fails_to_load(capfd):
    with torch.no_grad():
        ep = torch.export.export(Attention(), inputs())
    pte = to_edge_transform_and_lower(ep, partitioner=[KeepMatmulTakeNothing()]).to_executorch().buffer
    with pytest.raises(RuntimeError, match="Failed to load method forward"):
        Runtime.get().load_program(pte).load_method("forward")
    assert "aten::matmul.out" in capfd.readouterr().err  # the runtime logs the missing kernel


def test_dry_run_decomposes_a_kept_op_that_would_land_on_the_cpu():
    model, args = Attention(), inputs()
    artifact = compiler.compile(model, args, KeepMatmulBackend())
    plan = artifact.stages["dry_run"].keep_whole
    assert plan.nodes == frozenset() and plan.skipped is None
    (reason,) = plan.dropped.values()
    assert "refused by this backend's rules" in reason and "aten::matmul.out" in reason
    assert artifact.report.stage("dry_run").metrics["decomposed"] == "aten.matmul.default"
    # It dropped a node: its decomposition kept that one whole, so the decompose stage makes its own.
    assert artifact.stages["dry_run"].decomposed is None
    assert "from_dry_run" not in artifact.report.stage("decompose").metrics
    assert "aten::matmul.out" not in artifact.program.operators
    assert compiler.compare_with_eager(artifact, model, args).max_abs_error < 1e-5


def test_dry_run_is_skipped_and_decomposes_nothing_on_a_plain_float_model(monkeypatch):
    calls = []
    monkeypatch.setattr(dry_run_module, "to_edge_program", lambda *a: calls.append(a))
    model, args = compiler.models.examples.transformer(depth=1)
    artifact = compiler.compile(model, args, "xnnpack", stop_after="dry_run").artifact
    assert artifact.keep_whole.skipped and not calls
    assert artifact.keep_whole.nodes  # the linears stay whole for XNNPACK


def test_kept_nodes_are_the_ones_the_decompose_stage_keeps():
    model, args = compiler.models.examples.mlp()
    artifact = compiler.compile(model, args, "xnnpack")
    kept = artifact.stages["dry_run"].keep_whole.nodes
    edge_ops = [op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"]
    assert edge_ops.count("aten.linear.default") == len(kept) == 3


class UnfilteredCoreML(CoreMLBackend):
    """Core ML asking to keep whole everything stock keeps whole (no filter of ours)."""

    def keep_whole(self, program):
        return KeepWhole(super().keep_whole(program).ops)


class Uint8Matmul(torch.nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b).float() * 0.5


def test_dry_run_drops_a_core_ml_kept_op_the_uint8_rule_moves_to_the_cpu():
    inputs = (torch.randint(0, 9, (2, 3), dtype=torch.uint8), torch.randint(0, 9, (3, 2), dtype=torch.uint8))
    artifact = compiler.compile(Uint8Matmul(), inputs, UnfilteredCoreML())
    plan = artifact.stages["dry_run"].keep_whole
    assert list(plan.dropped) == ["matmul"] and "uint8" in plan.dropped["matmul"]
    assert "aten::matmul.out" not in artifact.program.operators


class FrameToMatmul(torch.nn.Module):
    """A uint8 frame (so the dry run must look) feeding a matmul Core ML keeps whole and takes."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, frame):
        return torch.matmul(frame.float() / 255.0, self.w)


def test_the_dry_run_answer_is_plan_data_and_a_resume_runs_the_same_stages(tmp_path):
    """What the dry run decided is its artifact's keep-whole plan, saved in the stage file:
    resuming after the dry run plans, decomposes and partitions exactly as going on does."""
    inputs = (torch.zeros(1, 2, 8, dtype=torch.uint8),)
    artifact = compiler.compile(FrameToMatmul(), inputs, "coreml", dump_dir=tmp_path)
    dry_run = artifact.report.stage("dry_run")
    assert "uint8" in dry_run.metrics["because"] and dry_run.metrics["kept"] == 1
    planned = artifact.stages["dry_run"]
    assert set(attrs.fields_dict(type(planned))) == {"program", "keep_whole", "decomposed"}
    # It dropped nothing, so its decomposition is the decompose stage's output and its search
    # the partition stage's, each made once...
    assert artifact.stages["decompose"] is planned.decomposed
    assert artifact.stages["partition"] is planned.decomposed.searched
    assert artifact.report.stage("decompose").metrics == {"from_dry_run": True}
    assert artifact.report.stage("partition").metrics == {"search_from_dry_run": True}
    assert artifact.report.stage("dry_run").metrics["decomposition_handed_on_s"] > 0
    assert artifact.report.stage("dry_run").metrics["search_handed_on_s"] > 0
    # ...and never saved: a resumed run decomposes and partitions anew, from the plan alone,
    # to the same programs and the same .pte.
    resumed = compiler.compile(None, resume_from=tmp_path / "05-dry_run.stage")
    assert "from_dry_run" not in resumed.report.stage("decompose").metrics
    assert "search_from_dry_run" not in resumed.report.stage("partition").metrics
    assert resumed.stages["decompose"].program.graph_module.code == planned.decomposed.program.graph_module.code
    assert resumed.stages["decompose"].preserved_ops == artifact.stages["decompose"].preserved_ops
    assert resumed.stages["partition"].program.graph_module.code == artifact.stages["partition"].program.graph_module.code
    assert resumed.program.plan == artifact.program.plan
    assert resumed.pte == artifact.pte
    edge = artifact.stages["decompose"].program
    assert not any("delegation_tag" in n.meta for n in edge.graph.nodes)  # the search ran on a copy


class MaskedPositions(torch.nn.Module):
    """SmolVLA's patch-position merge: `ids[mask]`, whose size depends on the mask's values."""

    def forward(self, mask, ids):
        return ids[mask > 0] * 2


class KeepIndexBackend(Backend):
    """Asks to keep aten.index.Tensor whole, as Core ML does, and takes nothing."""

    name = "keep-index"

    def keep_whole(self, program):
        return KeepWhole(frozenset({torch.ops.aten.index.Tensor}))

    def partition(self, program):
        return BackendPartition({})


def masked_positions_inputs():
    return torch.tensor([[1.0, -1.0, 2.0, 0.0, 3.0]]), torch.arange(5).reshape(1, 5)


def test_stock_fails_to_decompose_a_kept_index_of_data_dependent_size():
    class KeepIndex(Partitioner):
        def ops_to_not_decompose(self, ep):
            return [torch.ops.aten.index.Tensor], lambda node: True  # the per-node path Core ML takes

        def partition(self, ep):
            return PartitionResult(ep, {})

    with torch.no_grad():
        ep = torch.export.export(MaskedPositions(), masked_positions_inputs())
    with pytest.raises(Exception, match="EDGE_DO_NOT_DECOMP.index.Tensor"):
        to_edge_transform_and_lower(ep, partitioner=[KeepIndex()])


@pytest.mark.parametrize("backend", [KeepIndexBackend(), "coreml"], ids=["keep-index", "coreml"])
def test_a_node_of_data_dependent_size_is_not_kept_whole(backend):
    model, args = MaskedPositions(), masked_positions_inputs()
    artifact = compiler.compile(model, args, backend)
    plan = artifact.stages["dry_run"].keep_whole
    (name,) = [n.name for n in artifact.stages["dry_run"].program.graph.nodes if n.target == torch.ops.aten.index.Tensor]
    assert name not in plan.nodes and "depends on the data (u" in plan.dropped[name]
    if not isinstance(backend, str):
        assert torch.equal(compiler.run(artifact, args)[0], model(*args))


class FloorByNumber(torch.nn.Module):
    def forward(self, x):
        return torch.div(x, 3, rounding_mode="floor")  # recorded as div.Tensor_mode(x, 3)


def test_a_node_passing_a_number_for_a_tensor_is_not_kept_whole():
    model, args = FloorByNumber(), (torch.randn(2, 5) * 10,)
    artifact = compiler.compile(model, args, "mlx")  # MLX asks to keep div.Tensor_mode whole
    plan = artifact.stages["dry_run"].keep_whole
    (name,) = [n.name for n in artifact.stages["dry_run"].program.graph.nodes if n.target == torch.ops.aten.div.Tensor_mode]
    assert name not in plan.nodes and "the number 3 as its Tensor argument 'other'" in plan.dropped[name]
    torch.testing.assert_close(compiler.run(artifact, args)[0], model(*args))


class CheckedImageMerge(torch.nn.Module):
    """A vision-language model's image-token merge: the mask's count is checked against
    the image features (transformers' get_placeholder_mask), which fixes the masked
    index's size, so its fake value shows no data-dependent symbol."""

    def forward(self, embeddings, ids, features):
        mask = (ids == 7).unsqueeze(-1).expand_as(embeddings)
        torch._check(embeddings[mask].numel() == features.numel())
        return embeddings.masked_scatter(mask, features)


@pytest.mark.parametrize("backend", [KeepIndexBackend(), "coreml"], ids=["keep-index", "coreml"])
def test_a_boolean_mask_index_of_checked_size_is_not_kept_whole(backend):
    args = (torch.randn(1, 6, 4), torch.tensor([[1, 7, 7, 2, 7, 3]]), torch.randn(1, 3, 4))
    artifact = compiler.compile(CheckedImageMerge(), args, backend)
    program = artifact.stages["dry_run"].program
    (name,) = [n.name for n in program.graph.nodes if n.target == torch.ops.aten.index.Tensor]
    assert not free_unbacked_symbols(program.graph.find_nodes(op="call_function", target=torch.ops.aten.index.Tensor)[0].meta["val"])
    plan = artifact.stages["dry_run"].keep_whole
    assert name not in plan.nodes and "boolean mask" in plan.dropped[name]
    if not isinstance(backend, str):
        torch.testing.assert_close(compiler.run(artifact, args)[0], CheckedImageMerge()(*args))
