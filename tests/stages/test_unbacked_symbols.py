"""Scalars read from tensors at run time (unbacked `u0`, `zuf0` from `.item()`) never crash a stage.

Each backend either carries such a value as the runtime does (the ExecuTorch CPU
runtime holds it as a scalar) or leaves the ops that make or read it on the CPU
with a named reason.
"""

import pytest
import torch

import compiler
from compiler.backends.mlx import support
from compiler.backends.node_rules import first_refusal
from compiler.ir.dialect import op_name


class EulerSteps(torch.nn.Module):
    """multi_task_dit's Euler integrator: each step's time read from a grid with `.item()`."""

    def forward(self, x):
        grid = torch.linspace(0, 1, 3)
        for i in range(2):
            t = grid[i].item()
            dt = (grid[i + 1] - grid[i]).item()
            t_batch = torch.full((x.shape[0],), t, dtype=x.dtype)
            x = x + dt * (x * t_batch[:, None] + 1)
        return x


class ScaleBySum(torch.nn.Module):
    """A float read from a tensor input at run time scales another."""

    def forward(self, x, y):
        return y * x.sum().item()


class FirstPositives(torch.nn.Module):
    """An integer read at run time sizes the output."""

    def forward(self, x, y):
        n = (x > 0).sum().item()
        torch._check(n >= 0)
        torch._check(n <= y.shape[0])
        return y[:n] * 2


CASES = {
    "euler-steps": (EulerSteps(), (torch.randn(2, 4),)),
    "scale-by-sum": (ScaleBySum(), (torch.randn(4), torch.randn(4))),
    "first-positives": (FirstPositives(), (torch.tensor([1.0, -1.0, 2.0, 0.0, 3.0, 1.0]), torch.randn(6, 3))),
}


def _compile(name, backend):
    model, args = CASES[name]
    with torch.no_grad():
        return compiler.compile(model, args, backend), model, args


def _matches_eager(artifact, model, args):
    with torch.no_grad():
        return torch.allclose(compiler.run(artifact, args)[0], model(*args), atol=1e-6)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_cpu_runtime_carries_scalars_read_at_run_time(name, backend):
    artifact, model, args = _compile(name, backend)
    assert _matches_eager(artifact, model, args)


@pytest.mark.parametrize("name", CASES)
def test_core_ml_compiles_with_scalars_read_at_run_time_on_the_cpu(name):
    artifact, _, _ = _compile(name, "coreml")
    on_cpu = {p.op: p.reason for p in artifact.program.plan.cpu_nodes}
    assert "a number read from a tensor at run time" in on_cpu["aten._local_scalar_dense.default"]
    assert artifact.program.plan.partitions and artifact.pte


def _edge_program_with_a_symbolic_float():
    with torch.no_grad():
        return compiler.compile(*CASES["scale-by-sum"], "portable", stop_after="decompose").artifact.program


def test_stock_mlx_support_check_crashes_on_a_symbolic_float():
    from executorch.backends.mlx.partitioner import MLXOperatorSupport

    compiler.backends.mlx.ensure_generated()
    with pytest.raises(NotImplementedError, match="val_to_idtype: zuf"):
        MLXOperatorSupport(_edge_program_with_a_symbolic_float(), [])


def test_mlx_support_check_runs_with_symbolic_floats_hidden_and_the_rule_refuses_their_nodes():
    from executorch.backends.mlx.partitioner import MLXOperatorSupport

    compiler.backends.mlx.ensure_generated()
    program = _edge_program_with_a_symbolic_float()
    with support.symbolic_floats_hidden(program):
        stock = MLXOperatorSupport(program, [])
    nodes = {n.name: n for n in program.graph.nodes}
    assert isinstance(nodes["_local_scalar_dense"].meta["val"], torch.SymFloat)  # given back
    refused = {op_name(n.target): why for n in program.graph.nodes if (why := first_refusal(n, support.RULES))}
    assert set(refused) == {"aten._local_scalar_dense.default", "aten.scalar_tensor.default"}
    assert all("MLX cannot carry zuf" in why for why in refused.values())
    mul = next(n for n in program.graph.nodes if n.op == "call_function" and "mul" in str(n.target))
    assert stock.is_node_supported({}, mul)


@pytest.mark.parametrize(
    "name",
    [
        "euler-steps",
        "scale-by-sum",
        "first-positives",  # an integer: MLX carries it (ItemIntNode)
    ],
)
def test_mlx_matches_eager_with_scalars_read_at_run_time(name):
    artifact, model, args = _compile(name, "mlx")
    assert _matches_eager(artifact, model, args)


class MaskedByBuffer(torch.nn.Module):
    """A bool buffer expanded to a mask: constant only once the Edge fold sees it, so ExecuTorch's
    verifier (after decompose) re-runs the `nonzero` of an unfolded mask on fake values."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.tensor([False, True, True, False]).reshape(1, 4, 1))

    def forward(self, x):
        return x[self.keep.expand_as(x)] * 2


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_a_mask_constant_only_after_decompose_compiles_and_runs_right(backend):
    model, x = MaskedByBuffer().eval(), torch.randn(1, 4, 8)
    result = compiler.compile(model, (x,), backend, cache=False)
    assert compiler.compare_with_eager(result, model, (torch.randn(1, 4, 8),)).passed


def test_no_stage_leaves_a_fresh_symbol_that_no_node_binds():
    """The verifier's fake re-run made `u9`; a later shape propagation raised on it."""
    from compiler.ir.dynamic import pending_unbacked_symbols

    result = compiler.compile(MaskedByBuffer().eval(), (torch.randn(1, 4, 8),), "portable", cache=False)
    for name in ("capture", "decompose", "partition", "lower"):
        assert pending_unbacked_symbols(getattr(result.stages, name).program) == [], name


def test_a_fresh_symbol_left_pending_is_named_by_the_invariant():
    from compiler.ir.artifacts import AtenProgram
    from compiler.ir.dynamic import program_shape_env
    from compiler.ir.errors import VerificationError
    from compiler.ir.invariants import no_pending_unbacked_symbols

    program = torch.export.export(MaskedByBuffer().eval(), (torch.randn(1, 4, 8),))
    no_pending_unbacked_symbols.verify(AtenProgram(program))
    program_shape_env(program).create_unbacked_symint()
    with pytest.raises(VerificationError, match="no node binds"):
        no_pending_unbacked_symbols.verify(AtenProgram(program))
