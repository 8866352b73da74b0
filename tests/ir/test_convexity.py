"""Tag groups a path leaves and re-enters: the invariant names them, the split fixes them."""

import pytest
import torch

import compiler
from compiler.ir import invariants as inv
from compiler.ir.artifacts import PartitionedProgram
from compiler.ir.convexity import split_reentered_groups
from compiler.ir.errors import VerificationError
from compiler.ir.graph import DELEGATION_TAG, copy_program, op_nodes
from compiler.ir.placement import PlacementPlan


def tagged(module, tags: dict[str, str]) -> PartitionedProgram:
    """`module`'s Edge program with its op nodes tagged by name (node name -> tag)."""
    edge = compiler.compile(module, (torch.randn(3, 4),), stop_after="decompose").artifact
    program = copy_program(edge.program)
    for node in op_nodes(program):
        if node.name in tags:
            node.meta[DELEGATION_TAG] = tags[node.name]
    return PartitionedProgram(program, PlacementPlan(()))


class SinBetween(torch.nn.Module):
    def forward(self, x):
        y = x + 1.0
        return y * y.sin()


def test_a_group_left_and_reentered_through_a_cpu_op_is_refused_by_name():
    artifact = tagged(SinBetween(), {"aten_add_tensor": "tag0", "aten_mul_tensor": "tag0"})
    with pytest.raises(VerificationError) as err:
        inv.tag_groups_convex.verify(artifact, "partition")
    assert err.value.invariant == "tag_groups_convex"
    assert err.value.nodes == ("aten_add_tensor", "aten_sin_default", "aten_mul_tensor")
    assert "group tag0 is left and re-entered" in err.value.reason


class Crossed(torch.nn.Module):
    """Two groups, neither with a path out and back in by itself; fused, each feeds the other."""

    def forward(self, x):
        a1, b1 = x + 1.0, x * 2.0
        return b1 - 1.0, a1 / 2.0


def test_two_groups_that_feed_each_other_are_refused_by_name():
    tags = {"aten_add_tensor": "A", "aten_sub_tensor": "A", "aten_mul_tensor": "B", "aten_div_tensor": "B"}
    with pytest.raises(VerificationError) as err:
        inv.tag_groups_convex.verify(tagged(Crossed(), tags), "partition")
    assert "aten_add_tensor (A) -> tag B -> aten_sub_tensor (A)" in err.value.reason
    assert "aten_mul_tensor (B) -> tag A -> aten_div_tensor (B)" in err.value.reason


class TwoExits(torch.nn.Module):
    def forward(self, x):
        y = x + 1.0
        z = y * y.sin()
        return z * z.cos() + y


def test_a_group_is_split_into_the_fewest_pieces_a_path_needs():
    names = ("aten_add_tensor", "aten_mul_tensor", "aten_mul_tensor_1", "aten_add_tensor_1")
    artifact = tagged(TwoExits(), dict.fromkeys(names, "tag0"))
    partitions, paths = split_reentered_groups(artifact.program.graph, {"tag0": "spec"})
    tags = {n.name: n.meta.get(DELEGATION_TAG) for n in op_nodes(artifact.program)}
    assert [tags[n] for n in names] == ["tag0", "tag0_1", "tag0_2", "tag0_2"]
    assert partitions == {"tag0": "spec", "tag0_1": "spec", "tag0_2": "spec"}
    assert [p.tag for p in paths] == ["tag0"]
    inv.tag_groups_convex.verify(artifact, "partition")


class SharedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.w + self.w


def test_a_weight_one_group_took_and_another_reads_is_no_path():
    """Before split_constants gives the other group its own copy, the weight is tagged for
    one group and read by both: the group's ops never leave it."""
    artifact = tagged(SharedWeight(), {"aten_mul_tensor": "H", "aten_add_tensor": "G"})
    (weight,) = (n for n in artifact.program.graph.nodes if n.op == "placeholder" and n.name == "p_w")
    weight.meta[DELEGATION_TAG] = "G"
    inv.tag_groups_convex.verify(artifact, "partition")
