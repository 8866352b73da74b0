"""The split-constants stage: one placeholder per tag group, list readers rewired.

The stock path (ExecuTorch 1.5.1's duplicate_constant_node_pass inside
to_backend) fails on the same models; each test shows that failure.
"""

import pytest
import torch
from torch.export.graph_signature import InputKind

import compiler
from compiler.ir.dialect import op_name
from compiler.backends.base import Backend, BackendPartition
from compiler.ir import invariants as inv
from compiler.stages.split_constants import split_constants
from executorch.exir import to_edge, to_edge_transform_and_lower
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend


def export(module, inputs):
    with torch.no_grad():
        return torch.export.export(module, inputs)


class TagByOp(Partitioner):
    """A test partitioner that takes constants over: each listed node, with its constant
    inputs, gets its own tag for XNNPACK (`None` leaves a node on the CPU)."""

    def __init__(self, tags_by_node):
        super().__init__()
        self.tags_by_node = tags_by_node

    def partition(self, ep):
        spec = DelegationSpec(XnnpackBackend.__name__, [])
        constants = set(ep.graph_signature.inputs_to_parameters) | set(ep.graph_signature.inputs_to_buffers)
        constants |= set(ep.graph_signature.inputs_to_lifted_tensor_constants)
        used = {}
        for node in ep.graph.nodes:
            tag = self.tags_by_node(node)
            if node.op != "call_function" or tag is None:
                continue
            node.meta["delegation_tag"] = tag
            used[tag] = spec
            for source in node.all_input_nodes:
                if source.name in constants and "delegation_tag" not in source.meta:
                    source.meta["delegation_tag"] = tag
        return PartitionResult(ep, used)


class TaggingBackend(Backend):
    name = "test-tagger"

    def __init__(self, tags_by_node):
        self.partitioner = TagByOp(tags_by_node)

    def partition(self, program):
        return BackendPartition(dict(self.partitioner.partition(program).partition_tags))


class SharedWeight(torch.nn.Module):
    """One weight read by three add ops (tagged per test) and two CPU ops."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        a, b, c = x + self.w, x * 2 + self.w, x * 3 + self.w
        return a, b, c, torch.atan2(x, self.w), torch.remainder(x, self.w)


def is_add(node):
    return node.op == "call_function" and op_name(node.target) == "aten.add.Tensor"


def adds_tagged(*tags):
    """The i-th add node gets tags[i]; other nodes stay on the CPU."""

    def tag(node):
        if not is_add(node):
            return None
        position = [n for n in node.graph.nodes if is_add(n)].index(node)
        return tags[position] if position < len(tags) else None

    return tag


def edge_program(model, inputs):
    return to_edge(export(model, inputs)).exported_program()


def copies_of(ep, name):
    return [n for n in ep.graph.nodes if n.op == "placeholder" and n.name.startswith(f"{name}_copy_")]


def test_two_delegates_and_cpu_users_give_exactly_two_copies():
    ep = edge_program(SharedWeight(), (torch.randn(4, 4),))
    TagByOp(adds_tagged("tag0", "tag1", "tag1")).partition(ep)
    assert split_constants(ep) == 2
    weight = next(n for n in ep.graph.nodes if n.name == "p_w")
    assert "delegation_tag" not in weight.meta  # the CPU users keep the original
    assert {u.meta.get("delegation_tag") for u in weight.users} == {None}
    copies = copies_of(ep, "p_w")
    assert sorted(c.name for c in copies) == ["p_w_copy_0", "p_w_copy_1"]
    for copy in copies:
        assert {u.meta["delegation_tag"] for u in copy.users} == {copy.meta["delegation_tag"]}
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    assert all(specs[c.name].kind == InputKind.PARAMETER for c in copies)
    assert len({s.target for s in ep.graph_signature.input_specs}) == len(ep.graph_signature.input_specs)
    assert inv.constants_listed_once.check(type("Artifact", (), {"program": ep})) is None
    ep._validate()


def test_single_tag_and_cpu_only_make_no_copy():
    for tags in [("tag0", "tag0", "tag0"), ()]:
        model = SharedWeight()
        ep = edge_program(model, (torch.randn(4, 4),))
        if tags:
            TagByOp(adds_tagged(*tags)).partition(ep)
            # only adds are tagged, so CPU users exist: one copy for the one delegate group
            assert split_constants(ep) == 1
        else:
            assert split_constants(ep) == 0


def test_all_users_in_one_delegate_make_no_copy():
    class OnlyAdds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x + self.w, x * 2 + self.w

    ep = edge_program(OnlyAdds(), (torch.randn(4),))
    TagByOp(lambda n: "tag0" if n.op == "call_function" else None).partition(ep)
    assert split_constants(ep) == 0


class OneDelegatedTwoCpu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + self.w, torch.atan2(x, self.w), torch.remainder(x, self.w)


def test_stock_lists_a_shared_constant_twice():
    model, inputs = OneDelegatedTwoCpu(), (torch.randn(4),)
    lowered = to_edge(export(model, inputs)).to_backend(TagByOp(adds_tagged("tag0"))).exported_program()
    targets = [s.target for s in lowered.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    assert targets == ["w", "w"]  # one copy per CPU user, both with the original's target
    violation = inv.constants_listed_once.check(type("Artifact", (), {"program": lowered}))
    assert violation is not None and violation.nodes == ("w",)


def test_one_delegated_and_two_cpu_users_share_the_original():
    model, inputs = OneDelegatedTwoCpu(), (torch.randn(4),)
    artifact = compiler.compile(model, inputs, TaggingBackend(adds_tagged("tag0")))
    assert artifact.report.stage("split_constants").metrics["copies"] == 1
    lowered = artifact.stages["lower"].program
    assert [s.target for s in lowered.graph_signature.input_specs if s.kind == InputKind.PARAMETER] == ["w"]
    assert compiler.compare_with_eager(artifact, model, inputs).max_abs_error < 1e-6


def test_shared_constant_across_two_partitions_and_cpu_compiles_and_matches_eager():
    model, inputs = SharedWeight(), (torch.randn(4, 4),)
    artifact = compiler.compile(model, inputs, TaggingBackend(adds_tagged("tag0", "tag1", "tag2")))
    assert artifact.report.stage("split_constants").metrics["copies"] == 3
    assert artifact.report.stage("lower").delegates == 3
    assert compiler.compare_with_eager(artifact, model, inputs).max_abs_error < 1e-6


class IndexByBuffer(torch.nn.Module):
    """A buffer used as the indices of aten.index (a list argument) and read by an add."""

    def __init__(self, index_first):
        super().__init__()
        self.index_first = index_first
        self.register_buffer("idx", torch.tensor([3, 0, 2]))

    def forward(self, x):
        if self.index_first:
            return x[self.idx], x[:3, 0] + self.idx
        return x[:3, 0] + self.idx, x[self.idx]


def tag_adds(node):
    return "tag0" if is_add(node) else None


@pytest.mark.parametrize("index_first", [True, False])
def test_constant_read_inside_a_list_is_rewired(index_first):
    model, inputs = IndexByBuffer(index_first), (torch.randn(5, 4),)
    artifact = compiler.compile(model, inputs, TaggingBackend(tag_adds))
    split = artifact.stages["split_constants"].program
    index = next(n for n in split.graph.nodes if n.op == "call_function" and op_name(n.target) == "aten.index.Tensor")
    (indices,) = [i for i in index.args[1] if i is not None]
    assert indices.name == "b_idx" and "delegation_tag" not in indices.meta
    assert compiler.compare_with_eager(artifact, model, inputs).max_abs_error == 0


class LiftedConstant(torch.nn.Module):
    """A lifted constant tensor: XNNPACK's linear takes it as weight, two CPU ops read it too."""

    def forward(self, x):
        weight = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [3.0, 1.0, -2.0]])
        return torch.nn.functional.linear(x, weight), torch.atan2(x, weight), torch.remainder(x, weight)


def test_lifted_constant_read_by_xnnpack_and_two_cpu_ops_matches_eager():
    model, inputs = LiftedConstant(), (torch.randn(3, 3),)
    artifact = compiler.compile(model, inputs, "xnnpack")
    assert artifact.report.stage("lower").delegates == 1
    assert compiler.compare_with_eager(artifact, model, inputs).max_abs_error < 1e-5


class FoldedWeight(torch.nn.Module):
    """A weight the fold stage turns into a lifted constant, read by XNNPACK's linear and two CPU ops."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        w = self.w * 2
        return torch.nn.functional.linear(x, w), torch.atan2(x, w), torch.remainder(x, w)


def test_stock_folded_constant_shared_with_xnnpack_cannot_be_unlifted():
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    ep = constant_prop_pass(export(FoldedWeight(), (torch.randn(3, 3),)).run_decompositions({}))
    lowered = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).exported_program()
    with pytest.raises(AttributeError, match="_prop_tensor_constant0` is not a buffer"):
        lowered.module()


def test_folded_constant_shared_with_xnnpack_is_listed_once_and_matches_eager():
    model, inputs = FoldedWeight(), (torch.randn(3, 3),)
    artifact = compiler.compile(model, inputs, "xnnpack")
    lowered = artifact.stages["lower"].program
    assert artifact.report.stage("split_constants").metrics["copies"] == 1
    lowered.module()  # unlifts: every constant target is listed once
    assert compiler.compare_with_eager(artifact, model, inputs).max_abs_error < 1e-5
