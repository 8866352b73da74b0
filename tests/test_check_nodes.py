"""The node-level check (`compiler.check_nodes`): every node of a compiled program against eager's
op on the program's own inputs to it, inside delegates too.

It fails on real faults the outputs hide (each fix of `benchmarks/locate_faults.py` switched off,
behind a softmax, a sigmoid and a max), at the fix's node; and it raises no false alarm on
programs without a fault, among them each program on which an earlier version of it raised one.
"""

from __future__ import annotations

import pytest
import torch

import compiler
from benchmarks import locate_faults, node_check
from compiler.ir.errors import UserInputError

SQUASHING = ("softmax", "sigmoid", "max")


def _fault_params():
    params = []
    for case in locate_faults.CASES:
        if case.switch == "never_alias":  # the fault is an output aliasing an input: nothing can read it
            continue
        params += [pytest.param(case, behind, id=f"{case.id}-{behind}") for behind in SQUASHING]
    return params


@pytest.mark.parametrize("case, behind", _fault_params())
def test_a_fault_the_outputs_hide_fails_the_node_check_at_the_fixs_node(case, behind):
    row = node_check.fault_row(case, behind)
    assert row["nodes"] == "FAILS", row
    assert row["named"], row


def test_a_fault_behind_a_softmax_passes_the_output_check_and_not_the_node_check():
    """The blind spot the node check exists for: a tanh GELU converted as the exact one, at float32."""
    (case,) = [c for c in locate_faults.CASES if c.id == "coreml.tanh_gelu"]
    row = node_check.fault_row(case, "softmax")
    assert row["check"].startswith("passes"), row
    assert row["nodes"] == "FAILS" and row["first"].startswith("aten_gelu_default"), row


class SplitItem(torch.nn.Module):
    """Items of two multi-output ops share the name `getitem`: the second is not the first's."""

    def forward(self, x):
        torch.relu(x)
        _, second = x.split(1, 0)
        return second * 2


class WriteIntoClone(torch.nn.Module):
    """A captured program writes in place into a view of a clone its next node reads."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(2), requires_grad=False)

    def forward(self, x):
        y = x.clone()
        y[0:2] = self.p
        return x - y


class GrowBuffer(torch.nn.Module):
    """A buffer written in place: the captured program's add_ must not run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.randn(2))

    def forward(self, x):
        self.s.add_(x)
        return self.s * 1


class BooleanOutput(torch.nn.Module):
    """A comparison Core ML holds as 0.0 and 1.0 inside its payload."""

    def forward(self, x):
        return torch.relu(x), x >= 0.5


class MaskedPick(torch.nn.Module):
    """A data-dependent size: the shapes of its nodes are symbols."""

    def __init__(self) -> None:
        super().__init__()
        self.keep = torch.tensor([True, False, True])

    def forward(self, x):
        return torch.relu(x)[self.keep] * 2


class SquareAttention(torch.nn.Module):
    """nn.MultiheadAttention over 6 tokens of 2 heads, as ACT's encoder: its scores are 6 x 6, and
    a transposed key of that square shape has the counterpart of another meaning."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(8, 2)

    def forward(self, x, padding):
        return self.attention(x, x, value=x, key_padding_mask=padding)[0]


class Bfloat16Norm(torch.nn.Module):
    """A bfloat16 RMS norm taking its mean square in float32 (pi0's): on XNNPACK and Core ML the
    precision stage makes the program compute in float32, where eager rounds between its ops;
    a node's own op on its inputs then agrees exactly (an error of 0.0 is no error)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16), requires_grad=False)
        self.linear = torch.nn.Linear(16, 16, dtype=torch.bfloat16)

    def forward(self, x):
        x = self.linear(x)
        variance = torch.square(x.float()).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-6) * (1.0 + self.weight.float())


FOUND = {
    "split-item": (SplitItem, lambda: (torch.randn(2, 2, dtype=torch.float16),)),
    "write-into-clone": (WriteIntoClone, lambda: (torch.randn(3),)),
    "grow-buffer": (GrowBuffer, lambda: (torch.randn(2),)),
    "boolean-output": (BooleanOutput, lambda: (torch.randn(4),)),
    "masked-pick": (MaskedPick, lambda: (torch.randn(3),)),
    "square-attention": (SquareAttention, lambda: (torch.randn(6, 2, 8), torch.tensor([[False] * 5 + [True]] * 2))),
    "bfloat16-norm": (Bfloat16Norm, lambda: (torch.randn(4, 16, dtype=torch.bfloat16),)),
}


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
@pytest.mark.parametrize("name", list(FOUND))
def test_no_false_alarm_where_an_earlier_node_check_raised_one(name, backend):
    build, make_inputs = FOUND[name]
    torch.manual_seed(0)
    model, inputs = build().eval(), make_inputs()
    result = compiler.compile(model, inputs, backend)
    found = compiler.check_nodes(result, model, inputs)
    assert found.passed, found.describe()
    assert found.compared >= 1


@pytest.mark.parametrize("backend", ["xnnpack", "coreml"])
def test_the_compile_job_checks_every_node_and_reports_it(backend, tmp_path):
    job = compiler.compile_job("transformer", backend, check_nodes=True, cache_dir=str(tmp_path))
    assert job.passed and job.nodes.passed, job.nodes.describe()
    assert job.nodes.compared >= 30  # inside the delegates too, not only the CPU ops
    assert job.report.to_json()["check_nodes"]["passed"] is True


def test_a_resumed_run_cannot_check_nodes_and_is_told_before_work():
    with pytest.raises(UserInputError, match="check_nodes=True compares the captured program"):
        compiler.compile_job(None, resume_from="missing.stage", check_nodes=True)


class RepeatedKeys(torch.nn.Module):
    """Grouped-query attention's keys repeated per head (SmolVLA's): unsqueeze, expand, clone, view."""

    def forward(self, q, k):
        k = k[:, :, :, None, :].expand(1, 13, 2, 2, 16).reshape(1, 13, 4, 16).transpose(1, 2)
        return torch.softmax(q.transpose(1, 2) @ k.transpose(-1, -2), -1)


def test_a_tap_reading_another_ops_value_is_cut_and_its_readers_judged_again(monkeypatch):
    """A converter's pass may give the var a tap reads to another op (on SmolVLA's repeated keys
    Core ML's tap of a clone read a transpose): the value the payload returns when cut decides,
    and each reader is judged again on it, not on what eager computed from the tap's value."""
    from compiler.tools.locate import every_node

    torch.manual_seed(0)
    model, inputs = RepeatedKeys().eval(), (torch.randn(1, 13, 4, 16), torch.randn(1, 13, 2, 16))
    result = compiler.compile(model, inputs, "coreml")
    expand = next(n.name for n in result.stages.split_constants.program.graph.nodes if "expand" in n.name)
    tap = every_node.backends.intermediate_values

    def misread(backend_id):
        read = tap(backend_id)

        def values(*args, **kwargs):
            found = read(*args, **kwargs)
            found[expand] = found[expand].flip(-1)  # the var of another op: same shape, other values
            return found
        return values

    monkeypatch.setattr(every_node.backends, "intermediate_values", misread)
    found = compiler.check_nodes(result, model, inputs, at_float32=False)
    assert found.passed, found.describe()
    assert found.compared >= 4


class HalfLayerNorm(torch.nn.Module):
    """A float16 layer norm, which our decomposition normalizes in float32 (several nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32, dtype=torch.float16)

    def forward(self, x):
        return torch.softmax(self.norm(x * 0.1), -1)


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_a_wrong_rewrite_fails_at_its_last_node_though_each_of_its_ops_is_right(backend, monkeypatch):
    """Our half-precision layer norm rewrite made wrong (its epsilon 3000 times torch's): each
    node it makes computes its own op right, so only eager's layer norm, the counterpart of the
    rewrite's last node, shows the fault; its own op must not clear it."""
    from compiler.passes import decomposition

    right = decomposition._layer_norm_in_float32

    def wrong(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        return right(x, normalized_shape, weight, bias, eps * 3000)

    monkeypatch.setitem(decomposition._DECOMPOSED_HERE, torch.ops.aten.native_layer_norm.default, wrong)
    torch.manual_seed(0)
    model, inputs = HalfLayerNorm().eval(), (torch.randn(4, 32, dtype=torch.float16),)
    found = compiler.check_nodes(compiler.compile(model, inputs, backend), model, inputs)
    assert not found.passed
    assert "layer_norm" in found.first[0].reference, found.describe()
