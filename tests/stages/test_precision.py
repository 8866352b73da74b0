"""The precision stage: a bfloat16 model computes in float32 on the backends whose delegate has
no bfloat16 kernels (XNNPACK; Core ML, which computes inside in its own compute precision), cast
only at the program's edges, so the delegate takes its ops and the program still takes and
returns bfloat16. Without it every op of such a model ran on the portable CPU kernels."""

import copy

import pytest
import torch

import compiler
from compiler.backends import resolve
from compiler.ir.artifacts import AtenProgram
from compiler.ir.errors import UserInputError
from compiler.ir.graph import op_nodes
from compiler.running.runtime import LoadedProgram
from compiler.stages.base import StageContext
from compiler.stages.options import PrecisionOptions
from compiler.stages.precision import Precision

BF16 = torch.bfloat16
# An edge cast in the Edge dialect (`_to_copy` becomes ExecuTorch's dim-order copy).
EDGE_CAST = "dim_order_ops._to_dim_order_copy.default"


class LinearGeluLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Accumulate(torch.nn.Module):
    """Takes float32, casts to its dtype itself (`.to(torch.bfloat16)` in the program), and keeps
    a running sum in that dtype."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(2, 8))
        self.dtype = BF16

    def forward(self, x):
        y = torch.relu(self.linear(x.to(self.dtype)))
        self.total.add_(y)
        return self.total * 2


def _bfloat16(model):
    torch.manual_seed(0)
    return model().to(BF16).eval()


def _close_to_float32(out, model, inputs, atol):
    """Within bfloat16 rounding of the float32 model's answer: one bfloat16 step (2**-7
    relative) and `atol` for the few values near zero."""
    with torch.no_grad():
        expected = model.float()(*(x.float() for x in inputs))
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=atol)


def _captured(model, inputs):
    with torch.no_grad():
        return AtenProgram(torch.export.export(model, inputs))


def _precision(program, backend, dtype="auto"):
    ctx = StageContext(backend=resolve(backend), options=PrecisionOptions(dtype))
    return Precision().apply(program, ctx), ctx.metrics


@pytest.fixture(scope="module", params=["xnnpack", "coreml"])
def lowered(request):
    model = _bfloat16(LinearGeluLinear)
    inputs = (torch.randn(2, 16, dtype=BF16),)
    return request.param, model, inputs, compiler.compile(model, inputs, request.param)


def test_every_op_of_a_bfloat16_model_runs_in_the_delegate(lowered):
    backend, _, _, result = lowered
    plan = result.stages["partition"].plan
    model_ops = [p for p in plan.nodes if p.op != EDGE_CAST]
    assert model_ops and all(not p.on_cpu for p in model_ops), plan.summary()
    # Only the edge casts stay on the CPU: the delegate takes no bfloat16 input or output.
    assert [p.op for p in plan.cpu_nodes] == [EDGE_CAST, EDGE_CAST]
    notes = result.report.stage("precision").metrics
    assert notes["dtype"] == "float32" and notes["tensors_converted"] == 4 and notes["edge_casts"] == 2


def test_the_program_takes_and_returns_bfloat16_with_float32_numbers(lowered):
    backend, model, inputs, result = lowered
    (out,) = LoadedProgram(result)(inputs)
    assert out.dtype == BF16
    # Core ML computes inside in float16, its default compute precision.
    _close_to_float32(out, copy.deepcopy(model), inputs, atol=1e-3 if backend == "xnnpack" else 1e-2)


def test_the_report_says_the_precision_each_node_computes_in(lowered):
    backend, _, _, result = lowered
    rows = {n.node: n for n in result.stages["partition"].plan.described()}
    delegated = {n.precision for n in rows.values() if n.backend_id}
    assert delegated == {"float16" if backend == "coreml" else "float32"}
    assert sorted(n.precision for n in rows.values() if not n.backend_id) == ["bfloat16", "float32"]
    header, table = result.report.node_rows()
    assert "precision" in header and len(table) == len(rows)
    assert all("precision" in n for n in result.report.to_json()["nodes"])


def test_casts_and_state_of_the_model_compute_in_float32():
    """The model's own `.to(bfloat16)` casts to float32; its bfloat16 buffer is float32 state,
    written each call: two calls follow the float32 model."""
    model, inputs = _bfloat16(Accumulate), (torch.randn(2, 8),)
    result = compiler.compile(copy.deepcopy(model), inputs, "xnnpack")
    plan = result.stages["partition"].plan
    assert all(not p.on_cpu for p in plan.nodes if p.op == "aten.linear.default")
    program, reference = LoadedProgram(result), model.float()
    reference.dtype = torch.float32
    for _ in range(2):
        (out,) = program(inputs)
        assert out.dtype == BF16
        _close_to_float32(out, reference, inputs, atol=1e-3)


def test_precision_model_keeps_the_bfloat16_program():
    model, inputs = _bfloat16(LinearGeluLinear), (torch.randn(2, 16, dtype=BF16),)
    result = compiler.compile(model, inputs, "xnnpack", precision="model", stop_after="partition")
    plan = result.artifact.plan
    # Every op stays bfloat16 on the CPU (the weights' transposes are folded into constants).
    assert [p.op for p in plan.nodes] == ["aten.addmm.default", "aten.gelu.default", "aten.addmm.default"]
    assert len(plan.cpu_nodes) == len(plan.nodes) and all(p.dtype == "bfloat16" for p in plan.nodes)


@pytest.mark.parametrize("backend", ["mlx", "portable"])
def test_auto_leaves_a_bfloat16_program_alone_where_bfloat16_runs(backend):
    program = _captured(_bfloat16(LinearGeluLinear), (torch.randn(2, 16, dtype=BF16),))
    kept, metrics = _precision(program, backend)
    assert kept is program and "float32" not in metrics["precision"]


class RoundsThroughBfloat16(torch.nn.Module):
    def forward(self, x):
        return (x * 2).to(torch.bfloat16).to(torch.float32).sin()


def test_a_float32_model_rounding_through_bfloat16_keeps_its_rounding():
    program = _captured(RoundsThroughBfloat16(), (torch.randn(2, 3),))
    kept, metrics = _precision(program, "xnnpack")
    assert kept is program and metrics["precision"] == "as the model computes: no bfloat16 computation"


def test_float16_makes_every_floating_tensor_float16_inside_the_edges():
    torch.manual_seed(0)
    model, inputs = LinearGeluLinear().eval(), (torch.randn(2, 16),)
    program = _captured(model, inputs)
    ep = _precision(program, "portable", "float16")[0].program
    inside = [n for n in op_nodes(ep) if n.target is not torch.ops.aten._to_copy.default]
    assert {n.meta["val"].dtype for n in inside} == {torch.float16}
    assert all(v.dtype == torch.float16 for v in ep.state_dict.values())
    out = ep.module()(*inputs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(*inputs), rtol=1e-2, atol=1e-2)
    assert program.program.state_dict["up.weight"].dtype == torch.float32  # the input artifact is untouched


class Bits(torch.nn.Module):
    def forward(self, x):
        return (x * 2).view(torch.int16), x + 1


def test_a_bitcast_reads_the_model_dtype():
    inputs = (torch.randn(2, 8, dtype=BF16),)
    ep = _precision(_captured(Bits(), inputs), "xnnpack")[0].program
    bits, plus = ep.module()(*inputs)
    assert torch.equal(bits, Bits()(*inputs)[0]) and plus.dtype == BF16


class WritesItsInput(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x + 1


def test_an_input_the_model_writes_is_left_alone_or_refused():
    program = _captured(WritesItsInput(), (torch.randn(2, 8, dtype=BF16),))
    kept, metrics = _precision(program, "xnnpack")
    assert kept is program and "writes its input(s) x in place" in metrics["precision"]
    with pytest.raises(UserInputError, match="precision float32: the model writes its input"):
        _precision(program, "xnnpack", "float32")
