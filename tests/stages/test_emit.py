"""The emit stage: `.pte` bytes that carry what the program needs, including initial state."""

import pytest
import torch

import compiler
from compiler import backends
from compiler.ir.graph import copy_program
from compiler.stages.base import StageContext
from compiler.stages.emit import Emit
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch.export import ExportedProgram


class RunningTotal(torch.nn.Module):
    def __init__(self, start: float):
        super().__init__()
        self.register_buffer("total", torch.full((4, 8), start))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 1.0


def test_stock_emits_a_mutated_buffer_without_its_initial_value():
    model, x = RunningTotal(2.0), torch.randn(4, 8)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    pte = to_edge_transform_and_lower(ep).to_executorch().buffer
    (out,) = Runtime.get().load_program(pte).load_method("forward").execute([x])
    torch.testing.assert_close(out, x)  # the state started at zero, not at 2.0


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_mutated_buffer_keeps_its_initial_value(backend):
    x = torch.randn(4, 8)
    artifact = compiler.compile(RunningTotal(2.0), (x,), backend)
    assert artifact.report.stage("emit").metrics["initialized_state"] == 1
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, RunningTotal(2.0)(x))


def test_zero_initial_state_is_not_stored():
    x = torch.randn(4, 8)
    artifact = compiler.compile(RunningTotal(0.0), (x,), "portable")
    assert "initialized_state" not in artifact.report.stage("emit").metrics
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, x)


class TwoDelegates(torch.nn.Module):
    """Two delegate calls on XNNPACK (the CPU cumsum between them), a state Core ML keeps."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.cumsum(self.a(x).relu(), 1)).transpose(0, 1)


@pytest.mark.parametrize("backend", ["xnnpack", "coreml", "mlx"])
def test_emit_makes_delegate_outputs_from_call_sites_and_the_same_bytes(backend, tmp_path, monkeypatch):
    """`to_executorch` retraces the program; torch's fake kernel of a delegate call then runs
    the delegate's whole original program. Emit makes the call's outputs from its call site:
    the `.pte` is byte for byte what torch's kernel gives, and that kernel never runs."""
    import contextlib
    import sys

    import compiler.stages.emit as emit

    # The module (its name is also the op's, which `import ... as` would give).
    call_delegate = sys.modules["torch._higher_order_ops.executorch_call_delegate"]

    inputs = (torch.randn(4, 6, 8),)
    compiler.compile(TwoDelegates(), inputs, backend, stop_after="lower", dump_dir=tmp_path)
    (stage_file,) = tmp_path.glob("*-lower.stage")
    runs = []
    stock_kernel = call_delegate.call_delegate_cpu
    monkeypatch.setattr(call_delegate, "call_delegate_cpu", lambda *a: runs.append(1) or stock_kernel(*a))
    ours = compiler.compile(None, resume_from=stage_file)
    assert ours.program.delegate_calls >= 1 and runs == []
    monkeypatch.setattr(emit, "delegate_outputs_from_call_sites", lambda gm: contextlib.nullcontext())
    stock = compiler.compile(None, resume_from=stage_file)
    assert runs, "torch's kernel ran without the shortcut"
    assert ours.pte == stock.pte


class AccumulateAndScale(torch.nn.Module):
    """MLX takes over the buffer it updates: its delegate returns only `y * 2`, while the
    call site still recorded the buffer's new value as its first output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2, 2))

    def forward(self, x, y):
        self.total.add_(x)
        return y * 2


def test_emit_does_not_trust_a_call_site_that_records_a_state_the_delegate_keeps(monkeypatch):
    """Trusted, the recorded (2, 2) state stood where the delegate returns `y * 2`: the plan
    read the wrong output (the reference executor refused: 'a delegate returned shape (3, 4)
    for program value ..., whose shape is fixed at (2, 2)')."""
    import contextlib

    import compiler.stages.emit as emit

    model, inputs = AccumulateAndScale(), (torch.ones(2, 2), torch.randn(3, 4))
    ours = compiler.compile(model, inputs, "mlx")
    assert ours.program.delegate_calls == 1 and ours.program.kernel_calls == 0
    (got,) = compiler.run(ours, inputs)
    torch.testing.assert_close(got, inputs[1] * 2)
    monkeypatch.setattr(emit, "delegate_outputs_from_call_sites", lambda gm: contextlib.nullcontext())
    assert ours.pte == compiler.compile(AccumulateAndScale(), inputs, "mlx").pte


@pytest.mark.parametrize("backend", ["xnnpack", "coreml", "mlx"])
def test_emit_shares_the_delegates_and_leaves_the_lowered_program_as_it_was(backend, monkeypatch):
    """Emit rewrites a copy of the lowered program; its delegates are shared with that copy,
    not copied (a copy builds each original program anew and validates every op of it), and
    nothing in `to_executorch` changes them."""
    run = compiler.compile(TwoDelegates(), (torch.randn(4, 6, 8),), backend)
    lowered = run.stages["lower"]
    delegates = {
        name: module for name, module in lowered.program.graph_module.named_modules() if hasattr(module, "original_module")
    }

    def snapshot():
        return lowered.program.graph_module.code, {
            name: (module.original_module.graph_module.code, [str(n.meta.get("val")) for n in module.original_module.graph.nodes])
            for name, module in delegates.items()
        }

    before = snapshot()
    assert delegates
    built = []
    stock_init = ExportedProgram.__init__
    monkeypatch.setattr(ExportedProgram, "__init__", lambda self, *a, **k: built.append(1) or stock_init(self, *a, **k))
    copied = copy_program(lowered.program)
    assert built == []  # a copied delegate would build its original program anew
    assert all(getattr(copied.graph_module, name) is module for name, module in delegates.items())
    monkeypatch.undo()

    context = StageContext(backends.resolve(backend, {}), run.config.options_for("emit"))
    assert Emit().apply(lowered, context).pte == run.pte
    assert snapshot() == before
