"""The reference executor: what it refuses, and how it says so."""

import pytest
import torch

import compiler
from compiler.backends.mlx import interpreter
from compiler.backends.mlx.interpreter import BadMLXPayload, MLXGraph, UnsupportedMLXNode
from compiler.running.reference import ReferenceExecutor, run_program
from compiler.models.examples import mlp


@pytest.fixture(scope="module")
def mlp_artifact():
    model, inputs = mlp(features=8, hidden=16, layers=2)
    return compiler.compile(model, inputs, backend="mlx"), inputs


def test_payload_decodes_to_node_types(mlp_artifact):
    artifact, _ = mlp_artifact
    executor = ReferenceExecutor(artifact.pte)
    payload = executor.program.backend_delegate_data[0].data
    assert {"AddmmNode", "TransposeNode"} <= MLXGraph(bytes(payload)).node_kinds()


def test_unknown_payload_node_type_is_named(mlp_artifact, monkeypatch):
    artifact, inputs = mlp_artifact
    monkeypatch.delitem(interpreter.NODE_FUNCTIONS, "AddmmNode")
    with pytest.raises(UnsupportedMLXNode) as err:
        compiler.run(artifact, inputs)
    assert "AddmmNode" in str(err.value)
    assert err.value.nodes == ("AddmmNode",)


def test_payload_that_is_not_mlx_is_refused():
    with pytest.raises(BadMLXPayload) as err:
        MLXGraph(b"\x00" * 64)
    assert "MLX0" in str(err.value)


def test_run_program_returns_torch_tensors(mlp_artifact):
    artifact, inputs = mlp_artifact
    (out,) = run_program(artifact.pte, list(inputs))
    assert isinstance(out, torch.Tensor) and out.shape == (4, 8)


@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_cpu_nodes_run_in_torch_like_the_portable_runtime(name):
    from compiler.models.examples import EXAMPLES

    kwargs = {"convnet": dict(channels=4, size=8), "transformer": dict(depth=1, dim=16, heads=2, seq=4)}[name]
    model, inputs = EXAMPLES[name](**kwargs)
    artifact = compiler.compile(model, inputs, backend="portable")
    (ours,) = run_program(artifact.pte, list(inputs))
    (runtime,) = compiler.run(artifact, inputs)  # ExecuTorch's own runtime
    torch.testing.assert_close(ours, runtime, atol=1e-5, rtol=1e-5)


class _Count(torch.nn.Module):
    """A buffer updated in place: its value carries from one call to the next."""

    def __init__(self, start: float):
        super().__init__()
        self.register_buffer("count", torch.full((4,), start))

    def forward(self, x):
        self.count.add_(x)
        return self.count * 2.0


@pytest.mark.parametrize(
    "start, owner",
    [(0.0, "the MLX delegate"), (1.5, "the CPU")],
    ids=["zero-start-delegate-owned", "initialized-cpu-owned"],
)
def test_state_carries_between_runs_like_eager(start, owner):
    """A buffer starting at zero is the delegate's mutable buffer (the MLX runtime starts
    it at zeros and keeps it in its handle); one that does not stays CPU-owned (the
    program carries its first value and the Method's memory keeps it). Either way a
    second run sees the first run's update, as eager does; a new executor starts afresh."""
    torch.manual_seed(0)
    eager = _Count(start)
    x = torch.randn(4)
    artifact = compiler.compile(_Count(start), (x,), backend="mlx")
    executor = ReferenceExecutor(artifact.pte)
    graph = MLXGraph(bytes(executor.program.backend_delegate_data[0].data))
    assert bool(graph.mutable_buffers) == (owner == "the MLX delegate")
    for _ in range(3):
        (ours,) = executor.run([x])
        torch.testing.assert_close(ours, eager(x))
    (fresh,) = ReferenceExecutor(artifact.pte).run([x])
    torch.testing.assert_close(fresh, (torch.full((4,), start) + x) * 2.0)


def test_payload_input_of_another_dtype_is_refused_like_the_runtime(mlp_artifact):
    """The MLX runtime's tensor_to_mlx refuses an input whose dtype is not the payload's."""
    artifact, inputs = mlp_artifact
    executor = ReferenceExecutor(artifact.pte)
    graph = MLXGraph(bytes(executor.program.backend_delegate_data[0].data))
    delegate = interpreter.Interpreter(graph, executor.named_data)
    (ours,) = delegate.execute([inputs[0]])
    torch.testing.assert_close(ours, compiler.run(artifact, inputs)[0])
    with pytest.raises(interpreter.MLXNodeFailure, match="dtype mismatch"):
        delegate.execute([inputs[0].double()])


class BoolFill(torch.nn.Module):
    def forward(self, x):
        keep = torch.ones(x.shape, dtype=torch.bool)  # FullNode with a bool dtype
        return (keep & (x > 0)).float() + torch.full_like(x, 1, dtype=torch.bool).float()


class EmptyConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("nothing", torch.zeros(0))

    def forward(self, x):
        return torch.cat([x.flatten(), self.nothing]) * 2


@pytest.mark.parametrize("module_type", [BoolFill, EmptyConstant])
def test_fills_keep_their_dtype_and_empty_constants_load(module_type):
    model, inputs = module_type().eval(), (torch.randn(2, 3),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    (out,) = compiler.run(artifact, inputs)
    expected = model(*inputs)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected)


class FilledBySlices(torch.nn.Module):
    """`empty_like` filled by strided slices (SmolVLA's rotary embedding): the empty is made
    on the CPU by ExecuTorch's `_empty_dim_order.out`."""

    def forward(self, x):
        rotated = torch.empty_like(x)
        rotated[..., 0::2] = -x[..., 1::2]
        rotated[..., 1::2] = x[..., 0::2]
        return rotated


def test_an_empty_tensor_made_on_the_cpu_is_sized_like_the_runtime_does():
    model, inputs = FilledBySlices(), (torch.randn(2, 3, 8),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    ops = {node.target for node in artifact.stages["lower"].program.graph.nodes if node.op == "call_function"}
    assert any("_empty_dim_order" in str(op) for op in ops)  # the CPU kernel this exercises
    (out,) = compiler.run(artifact, inputs)
    torch.testing.assert_close(out, model(*inputs))


def test_a_failing_cpu_kernel_is_a_named_error(monkeypatch):
    from compiler.running import reference

    def refuse(*args, **kwargs):
        raise RuntimeError("this kernel refuses")

    model, inputs = FilledBySlices(), (torch.randn(2, 3, 8),)
    artifact = compiler.compile(model, inputs, backend="mlx")
    monkeypatch.setitem(reference._KERNELS_DONE_HERE, "dim_order_ops::_empty_dim_order.out", refuse)
    with pytest.raises(reference.ReferenceExecutionError) as err:
        compiler.run(artifact, inputs)
    assert err.value.nodes == ("dim_order_ops::_empty_dim_order.out",)
    assert "this kernel refuses" in str(err.value)
