"""Each invariant fails on a program that breaks it, and passes on a good one."""

import copy

import attrs

import pytest
import torch
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

import compiler
from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.ir import invariants as inv
from compiler.ir.artifacts import (
    AtenProgram,
    EdgeProgram,
    ExecutorchProgram,
    PartitionedProgram,
    PlannedProgram,
    SplitProgram,
)
from compiler.driver.instruments import VerifyEach
from compiler.ir.errors import VerificationError
from compiler.ir.placement import PlacementPlan
from executorch.exir.dialects._ops import ops as exir_ops


class CloneOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3))

    def forward(self, x):
        return x.clone() + self.table, self.table.sum()


def aten_program():
    with torch.no_grad():
        return AtenProgram(torch.export.export(CloneOut(), (torch.randn(2, 3),)))


def edge_program():
    return compiler.compile(CloneOut(), (torch.randn(2, 3),), stop_after="decompose").artifact


def test_good_programs_pass_every_invariant():
    for artifact in (aten_program(), edge_program()):
        for invariant in type(artifact).invariants:
            invariant.verify(artifact, "test")


def test_exported_program_verifier_failure_is_reported():
    artifact = aten_program()
    node = next(n for n in artifact.program.graph.nodes if n.op == "call_function")
    node.target = lambda *a: a[0]  # not an operator: the ExportedProgram verifier refuses it
    with pytest.raises(VerificationError) as err:
        inv.program_validates.verify(artifact, "fold")
    assert err.value.invariant == "program_validates"
    assert err.value.stage == "fold"


def test_edge_op_in_aten_program_is_refused():
    # The stock 1.5.1 constant folding bug: an Edge clone put into an ATen program.
    artifact = aten_program()
    clone = next(n for n in artifact.program.graph.nodes if n.target == torch.ops.aten.clone.default)
    clone.target = exir_ops.edge.aten.clone.default
    with pytest.raises(VerificationError) as err:
        inv.aten_ops_only.verify(artifact, "fold")
    assert clone.name in err.value.nodes
    assert "ATEN program holds ops of another dialect" in str(err.value)


def test_aten_op_in_edge_program_is_refused():
    artifact = edge_program()
    node = next(n for n in artifact.program.graph.nodes if n.op == "call_function")
    node.target = torch.ops.aten.add.Tensor
    with pytest.raises(VerificationError) as err:
        inv.edge_ops_only.verify(artifact, "decompose")
    assert node.name in err.value.nodes


def test_constant_listed_twice_is_refused():
    artifact = aten_program()
    ep = artifact.program
    original = next(s for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER)
    first_input = next(n for n in ep.graph.nodes if n.op == "placeholder")
    with ep.graph.inserting_before(first_input):
        twin = ep.graph.placeholder("b_table_twin")
    twin.meta = copy.copy(next(n for n in ep.graph.nodes if n.name == original.arg.name).meta)
    ep.graph_signature.input_specs.insert(
        0, InputSpec(InputKind.BUFFER, TensorArgument(twin.name), original.target, True)
    )
    with pytest.raises(VerificationError) as err:
        inv.constants_listed_once.verify(artifact, "split_constants")
    assert err.value.nodes == (original.target,)
    assert "listed more than once" in str(err.value)


def _partitioned_with_tags(tags):
    edge = edge_program()
    program = edge.program
    for node in program.graph.nodes:
        if node.name in tags:
            node.meta["delegation_tag"] = tags[node.name]
    return PartitionedProgram(program, PlacementPlan(()))


def test_constant_tagged_for_a_delegate_with_a_cpu_user_is_refused():
    artifact = _partitioned_with_tags({"b_table": "tag0"})
    with pytest.raises(VerificationError) as err:
        inv.constant_tags_match_users.verify(artifact, "partition")
    assert any("b_table (tag tag0)" in n and "tag None" in n for n in err.value.nodes)


def test_constant_tagged_like_all_users_passes():
    edge = edge_program()
    users = [u.name for u in next(n for n in edge.program.graph.nodes if n.name == "b_table").users]
    artifact = _partitioned_with_tags({"b_table": "tag0", **{u: "tag0" for u in users}})
    inv.constant_tags_match_users.verify(artifact, "partition")


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        before = self.count * 3  # reads the state, then updates it
        self.count.add_(x)
        return before


def test_mutable_buffer_split_between_delegate_and_cpu_is_refused():
    edge = compiler.compile(Counter(), (torch.ones(3),), stop_after="decompose").artifact
    program = edge.program
    buffer = next(n for n in program.graph.nodes if n.name == "b_count")
    users = list(buffer.users)
    users[0].meta["delegation_tag"] = "tag0"
    # A delegate reading CPU-owned state as an input is fine ...
    inv.mutable_buffers_not_split.verify(PartitionedProgram(program, PlacementPlan(())), "partition")
    # ... but not state the delegate took over.
    buffer.meta["delegation_tag"] = "tag0"
    with pytest.raises(VerificationError) as err:
        inv.mutable_buffers_not_split.verify(PartitionedProgram(program, PlacementPlan(())), "partition")
    assert any("on tag0" in n for n in err.value.nodes) and any("on cpu" in n for n in err.value.nodes)


class KeepsMatmulButTakesNothing(Backend):
    """Asks to keep matmul whole and promises to take it (so the dry run trusts it),
    then delegates nothing: the stock 'kernel not found' trap, past the dry run."""

    name = "keeps-matmul"

    def keep_whole(self, program):
        return KeepWhole(frozenset({torch.ops.aten.matmul.default}))

    def dry_run_needed(self, program, kept):
        return None

    def partition(self, program):
        return BackendPartition({})


class Matmul(torch.nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y) + 1


def test_cpu_op_without_runtime_kernel_is_caught_at_compile_time():
    inputs = (torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    with pytest.raises(VerificationError) as err:
        compiler.compile(Matmul(), inputs, KeepsMatmulButTakesNothing(), reproducer=False)
    assert err.value.stage == "partition"
    assert err.value.invariant == "cpu_ops_have_kernels"
    assert any("aten::matmul.out" in n for n in err.value.nodes)


def test_without_verification_the_same_program_only_fails_at_load():
    inputs = (torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    artifact = compiler.compile(Matmul(), inputs, KeepsMatmulButTakesNothing(), verify=False)
    assert "aten::matmul.out" in artifact.program.operators
    with pytest.raises(RuntimeError, match=r"Failed to load method forward, error: 0x:?14"):  # 0x14: OperatorMissing
        compiler.run(artifact, inputs)


class IntegerRemainder(torch.nn.Module):
    def forward(self, t):
        return torch.remainder(t, 5)


def test_a_cpu_op_whose_runtime_kernel_is_wrong_is_refused_by_name():
    """Stock lowers integer remainder to the portable kernel, which truncates: silently wrong."""
    from executorch.exir import to_edge

    t = torch.tensor([-2, 3, -7])
    stock = to_edge(torch.export.export(IntegerRemainder(), (t,))).exported_program()
    (got,) = compiler.run(to_edge(torch.export.export(IntegerRemainder(), (t,))).to_executorch().buffer, (t,))
    assert got.tolist() == [-2, 3, -2] != IntegerRemainder()(t).tolist()
    artifact = EdgeProgram(stock)
    with pytest.raises(VerificationError) as err:
        inv.cpu_ops_have_kernels.verify(artifact, "decompose")
    assert "integer remainder truncates" in err.value.nodes[0]


def test_pte_calling_unregistered_operator_is_refused():
    artifact = ExecutorchProgram(b"", ("aten::add.out", "aten::matmul.out"), (), PlacementPlan(()))
    with pytest.raises(VerificationError) as err:
        inv.pte_operators_registered.verify(artifact, "emit")
    assert err.value.nodes == ("aten::matmul.out",)


class Uint8Frame(torch.nn.Module):
    def forward(self, frame):
        return frame.float() / 255.0


def test_delegate_reading_refused_dtype_is_refused():
    edge = compiler.compile(Uint8Frame(), (torch.zeros(4, dtype=torch.uint8),), stop_after="decompose").artifact
    program = edge.program
    for node in program.graph.nodes:
        if node.op == "call_function":
            node.meta["delegation_tag"] = "tag0"  # the conversion reads the uint8 input
    artifact = PartitionedProgram(program, PlacementPlan(()), refused_input_dtypes=frozenset({"uint8"}))
    with pytest.raises(VerificationError) as err:
        inv.delegate_inputs_have_supported_dtypes.verify(artifact, "partition")
    assert any("reads frame (uint8)" in n for n in err.value.nodes)
    inv.delegate_inputs_have_supported_dtypes.verify(attrs.evolve(artifact, refused_input_dtypes=frozenset()))


def _with_constant(artifact, target, value):
    ep = artifact.program
    store = ep.state_dict if target in ep.state_dict else ep.constants
    store[target] = value
    return artifact


def test_a_constant_that_is_a_view_is_refused_by_name():
    artifact = edge_program()
    inv.constants_own_their_bytes.verify(artifact, "decompose")
    table = artifact.program.state_dict["table"]
    larger = torch.cat([torch.zeros(2, 3), table])  # the same values, 6 elements into a larger storage
    _with_constant(artifact, "table", larger[2:])
    with pytest.raises(VerificationError) as err:
        inv.constants_own_their_bytes.verify(artifact, "decompose")
    assert err.value.invariant == "constants_own_their_bytes"
    assert err.value.nodes == ("table (24 bytes at element offset 6 of a 48-byte storage)",)
    _with_constant(artifact, "table", larger[:2])  # at offset 0, but still not all of its storage
    with pytest.raises(VerificationError, match="constants_own_their_bytes"):
        inv.constants_own_their_bytes.verify(artifact, "decompose")


def test_tied_and_transposed_constants_own_their_bytes():
    artifact = edge_program()
    table = artifact.program.state_dict["table"]
    _with_constant(artifact, "table", torch.arange(6.0).reshape(3, 2).t())  # another layout, all its storage
    inv.constants_own_their_bytes.verify(artifact, "decompose")
    artifact.program.state_dict["tied"] = table  # the same tensor under two names (tied weights)
    inv.constants_own_their_bytes.verify(artifact, "decompose")


def test_every_program_until_lowering_checks_constants_own_their_bytes():
    for artifact_type in (AtenProgram, PlannedProgram, EdgeProgram, PartitionedProgram, SplitProgram):
        assert inv.constants_own_their_bytes in artifact_type.invariants, artifact_type


class SlicedTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.randn(16, 8)[2:10])  # the model's own view

    def forward(self, x):
        return x @ self.rows


def test_a_captured_view_fails_verification_unless_capture_gave_it_storage():
    with torch.no_grad():
        exported = AtenProgram(torch.export.export(SlicedTable(), (torch.randn(4, 8),)))
    with pytest.raises(VerificationError) as err:  # a program that skipped capture's ownership step
        VerifyEach().after_stage("fold", None, exported)
    assert err.value.invariant == "constants_own_their_bytes" and err.value.stage == "fold"
    assert err.value.nodes[0].startswith("rows ")
    artifact = compiler.compile(SlicedTable(), (torch.randn(4, 8),), "xnnpack", stop_after="capture").artifact
    assert artifact.program.state_dict["rows"].storage_offset() == 0


class WritesAPlainTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.total = torch.zeros(3)  # not a buffer: export lifts it as a constant

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def test_a_written_constant_is_refused_by_name():
    exported = torch.export.export(WritesAPlainTensor(), (torch.randn(3),), strict=False)
    with pytest.raises(VerificationError, match="constants_not_written") as err:
        inv.constants_not_written.verify(AtenProgram(exported), stage="capture")
    assert "c_total" in str(err.value)


def test_a_vmap_region_is_refused_by_name():
    class VmapOuter(torch.nn.Module):
        def forward(self, x):
            return torch.vmap(lambda row: row.sum() * row)(x)

    exported = torch.export.export(VmapOuter(), (torch.randn(3, 4),), strict=False)
    with pytest.raises(VerificationError, match="no_transform_regions"):
        inv.no_transform_regions.verify(AtenProgram(exported), stage="capture")
    captured = compiler.compile(VmapOuter(), (torch.randn(3, 4),), stop_after="capture").artifact
    inv.no_transform_regions.verify(captured, stage="capture")


def test_a_constant_stored_in_another_layout_is_refused_by_name():
    artifact = edge_program()
    _with_constant(artifact, "table", torch.arange(6.0).reshape(3, 2).t())  # all its storage, column-major
    inv.constants_own_their_bytes.verify(artifact, "decompose")
    with pytest.raises(VerificationError, match="constants_row_major") as err:
        inv.constants_row_major.verify(artifact, "decompose")
    assert "strides (1, 2)" in str(err.value)
