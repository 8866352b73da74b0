"""Every delegation-tag group reaching lower is one call: no path leaves it and comes back.

A group a path leaves and re-enters made `to_backend` fail with "Invalid partition, found
dependency cycles"; the partition stage splits it, and says why in the placement plan.
"""

import pytest
import torch
from torch import nn

from executorch.exir.backend.partitioner import DelegationSpec

import compiler
from compiler.backends.base import Backend, BackendPartition
from compiler.ir.graph import DELEGATION_TAG, op_nodes
from tiny_models import RandomProgram


@pytest.mark.parametrize("backend", ["xnnpack", "coreml", "mlx"])
def test_the_random_program_compiles_and_matches_eager(backend):
    torch.manual_seed(0)
    model, inputs = RandomProgram().eval(), (torch.randn(2, 2, 4), torch.randn(4, 4))
    artifact = compiler.compile(model, inputs, backend=backend)
    check = compiler.compare_with_eager(artifact, model, inputs)
    assert check.passed, check.describe()


class SinBetween(Backend):
    """Takes every op but `sin` into one XNNPACK group, as a search blind to paths would."""

    name = "sin-between"

    def partition(self, program):
        for node in op_nodes(program):
            if "sin" not in str(node.target):
                node.meta[DELEGATION_TAG] = "tag0"
        return BackendPartition({"tag0": DelegationSpec("XnnpackBackend", [])})


class AddSinMul(nn.Module):
    def forward(self, x):
        y = x + 1.0
        return y * y.sin() + y


def test_a_group_left_and_reentered_is_split_there_and_the_program_runs():
    model, x = AddSinMul(), torch.randn(3, 4)
    artifact = compiler.compile(model, (x,), backend=SinBetween())
    plan = artifact.program.plan
    (sin,) = plan.cpu_nodes
    assert "a path from aten_add_tensor through it comes back into the same delegate at aten_mul_tensor" in sin.reason
    assert {p.node: p.tag for p in plan.delegated_nodes} == {
        "aten_add_tensor": "tag0", "aten_mul_tensor": "tag0_1", "aten_add_tensor_1": "tag0_1"
    }
    torch.testing.assert_close(compiler.run(artifact, (x,))[0], model(x))


class CopyOfAReturnedValue(nn.Module):
    """XNNPACK would drop the copy and return `y` twice: the copy runs on the CPU."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        z = y.clone()
        return y, z * 2.0, z > 0.1


def test_the_delegate_reads_past_a_copy_it_sends_to_the_cpu():
    torch.manual_seed(0)
    model, x = CopyOfAReturnedValue().eval(), (torch.randn(3, 4),)
    artifact = compiler.compile(model, x, backend="xnnpack")
    assert artifact.program.plan.delegate_numbers() == {"tag0": 1}  # linear and mul: one call
    assert compiler.compare_with_eager(artifact, model, x).max_abs_error < 1e-6


class DropoutBetween(nn.Module):
    """The T5 pattern: an eval-mode dropout leaves a clone between two ops XNNPACK takes,
    and the clone is also read by an op XNNPACK does not take."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        d = self.dropout(torch.softmax(x, -1))
        return d @ self.w, d > 0.1


def test_a_clone_inside_a_delegate_stays_there_as_in_stock():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from compiler.stages.emit import pte_calls

    torch.manual_seed(0)
    model, x = DropoutBetween().eval(), (torch.randn(3, 4),)
    artifact = compiler.compile(model, x, backend="xnnpack")
    ours = pte_calls(artifact.pte)
    stock = to_edge_transform_and_lower(torch.export.export(model, x), partitioner=[XnnpackPartitioner()])
    theirs = pte_calls(stock.to_executorch().buffer)
    assert (ours.delegates, ours.cpu_calls) == (theirs.delegates, theirs.cpu_calls) == (1, 1)
    assert compiler.compare_with_eager(artifact, model, x).max_abs_error < 1e-6
