"""An MLX payload's intermediate values (`compiler.backends.mlx.taps`, the hook `locate` reads
inside a delegate): the payload keeps no node names, so the graph is built again from the
delegate's original program, recording each node's slot and instructions; each node's value as
the payload computes it equals its value in the Edge program, a fault in one instruction shows
at its node only, and a program that does not build to the payload is refused."""

from __future__ import annotations

import pytest
import torch

import compiler
from compiler import backends
from compiler.backends.mlx import interpreter
from compiler.backends.mlx.taps import PayloadNotRebuilt, intermediate_values


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        y = self.n(torch.nn.functional.gelu(self.a(x), approximate="tanh"))
        return self.b(torch.softmax(y * 2, dim=-1)).transpose(0, 1), y.sum(-1)


def node_values(program, inputs) -> dict[str, torch.Tensor]:
    """Every node's value in `program` run by torch.fx.Interpreter on the user inputs."""
    from torch.export.graph_signature import InputKind

    given = iter(inputs)
    args = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            args.append(next(given))
        elif spec.target in program.state_dict:
            args.append(program.state_dict[spec.target])
        else:
            args.append(program.constants[spec.target])
    values = {}

    class Keeping(torch.fx.Interpreter):
        def run_node(self, node):
            values[node.name] = super().run_node(node)
            return values[node.name]

    with torch.no_grad():
        Keeping(program.graph_module).run(*args, enable_io_processing=False)
    return values


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model, inputs = Block().eval(), (torch.randn(2, 8),)
    result = compiler.compile(model, inputs, "mlx")
    lowered_program = result.stages["lower"].program
    (call,) = [n for n in lowered_program.graph.nodes if getattr(n.target, "__name__", "") == "executorch_call_delegate"]
    assert [a.name for a in call.args[1:]] == ["x"]  # the delegate gets the model's input
    lowered = getattr(lowered_program.graph_module, call.args[0].target)
    store = lowered.named_data_store_output
    named = {key: bytes(store.buffers[entry.buffer_index]) for key, entry in store.pte_data.items()}
    expected = node_values(result.stages["split_constants"].program, inputs)
    return lowered, named, list(inputs), expected


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_the_hook_is_registered_for_mlx():
    assert backends.intermediate_values("MLXBackend") is intermediate_values


def test_each_node_inside_the_payload_has_its_edge_value(compiled):
    lowered, named, inputs, expected = compiled
    payload = bytes(lowered.processed_bytes)
    values = intermediate_values(lowered.processed_bytes, inputs, named, program=lowered.original_module)
    assert bytes(lowered.processed_bytes) == payload  # read, never rewritten
    computed = {
        n.name for n in lowered.original_module.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert set(values) == computed and len(values) >= 8
    for name, value in values.items():
        want = expected[name]
        assert value.dtype == want.dtype and value.shape == want.shape, name
        assert error(value, want) <= 1e-5, name
    assert values.ops["aten_gelu_default"] == "GeluNode (approximate tanh)"
    assert values.ops["aten_linear_default"] == "TransposeNode (perm [1, 0]), AddmmNode (alpha 1, beta 1)"


def test_a_wrong_instruction_shows_at_its_node_and_not_before_it(compiled, monkeypatch):
    """The runtime computing the tanh GELU as the exact one: only the gelu node and after diverge."""
    lowered, named, inputs, expected = compiled
    import mlx.core as mx

    def exact_gelu(interp, fields):
        x = interp.t(fields["x"])
        interp.set(fields["out"], x * 0.5 * (1 + mx.erf(x / 2**0.5)))

    monkeypatch.setitem(interpreter.NODE_FUNCTIONS, "GeluNode", exact_gelu)
    values = intermediate_values(lowered.processed_bytes, inputs, named, program=lowered.original_module)
    assert error(values["aten_linear_default"], expected["aten_linear_default"]) <= 1e-5
    assert error(values["aten_gelu_default"], expected["aten_gelu_default"]) > 1e-4


def test_a_program_that_does_not_build_to_the_payload_is_refused(compiled):
    lowered, named, inputs, _ = compiled
    with pytest.raises(PayloadNotRebuilt, match="keeps no node names"):
        intermediate_values(lowered.processed_bytes, inputs, named)
    torch.manual_seed(1)
    other = compiler.compile(torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.ReLU()).eval(), (torch.randn(2, 8),), "mlx")
    other_lowered = other.stages["lower"].program.graph_module.lowered_module_0
    with pytest.raises(PayloadNotRebuilt, match="does not build to this MLX payload"):
        intermediate_values(lowered.processed_bytes, inputs, named, program=other_lowered.original_module)


def test_locate_reads_the_mlx_payload_through_the_hook_and_names_its_instruction(monkeypatch):
    """A runtime fault inside the payload (the tanh GELU computed as the exact one) is located at
    the gelu node through the hook, with the MLX instruction that computes it."""
    import mlx.core as mx

    def exact_gelu(interp, fields):
        x = interp.t(fields["x"])
        interp.set(fields["out"], x * 0.5 * (1 + mx.erf(x / 2**0.5)))

    monkeypatch.setitem(interpreter.NODE_FUNCTIONS, "GeluNode", exact_gelu)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8))
    location = compiler.locate(model.eval(), (torch.randn(4, 16) * 3,), backend="mlx")
    d = location.divergence
    assert location.stage == "lower" and d.node == "aten_gelu_default"
    assert (d.op, d.payload_op) == ("aten.gelu.default", "GeluNode (approximate tanh)")
    assert d.found_by == "the MLXBackend payload's intermediate values"
    assert all(e is not None and e <= d.tolerance for _, e in d.input_errors)
