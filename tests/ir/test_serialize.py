"""Stage files of programs holding symbolic floats (`zuf0` from `.item()` of a float tensor).

ExecuTorch 1.5.1's serializer has no SymFloat in its schema; stage files carry such
values as placeholder integers named in the manifest and give the floats back on load.
"""

import logging

import pytest
import torch

import compiler
from compiler.backends.portable import PortableBackend
from compiler.driver.instruments import DumpStages
from compiler.driver.stage_files import load_stage_file
from compiler.stages import STAGE_NAMES


class EulerSteps(torch.nn.Module):
    """Each step's time and step size read from a grid input at run time."""

    def forward(self, x, grid):
        for i in range(2):
            t = grid[i].item()
            dt = (grid[i + 1] - grid[i]).item()
            x = x + dt * torch.sin(x + t)
        return x


class ScaledBySum(torch.nn.Module):
    """Arithmetic on a symbolic float: graph nodes (operator.mul, operator.add) valued 2.0*zuf0 + 1.0."""

    def forward(self, x, y):
        return y * (x.sum().item() * 2.0 + 1.0)


def _euler():
    return EulerSteps(), (torch.randn(2, 4), torch.linspace(0, 1, 3))


def _stage_file(directory, stage):
    return directory / f"{STAGE_NAMES.index(stage) + 1:02d}-{stage}.stage"


@pytest.mark.parametrize("stop", ["capture", "decompose"])
def test_dump_and_resume_of_symbolic_floats_gives_the_same_pte(tmp_path, stop):
    model, inputs = _euler()
    whole = compiler.compile(model, inputs, "portable", dump_dir=tmp_path)
    resumed = compiler.compile(None, None, "portable", resume_from=str(_stage_file(tmp_path, stop)))
    assert resumed.pte == whole.pte
    assert torch.allclose(compiler.run(resumed, inputs)[0], model(*inputs), atol=1e-6)


def test_loaded_program_has_its_symbolic_floats_back(tmp_path):
    model, inputs = ScaledBySum(), (torch.randn(4), torch.randn(4))
    saved = compiler.compile(model, inputs, "portable", stop_after="fold", dump_dir=tmp_path).artifact.program
    loaded = load_stage_file(_stage_file(tmp_path, "fold")).artifact.program

    def values(program):
        return {n.name: n.meta["val"] for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.SymFloat)}

    assert set(values(loaded)) == set(values(saved)) == {"item", "mul", "add"}
    source = values(loaded)["item"].node.expr
    assert str(values(loaded)["add"].node.expr) == f"2.0*{source} + 1.0"
    assert loaded.range_constraints[source].is_float
    assert all(isinstance(v, torch.SymFloat) for v in values(saved).values())  # saving hid them only meanwhile


class FlakyPortable(PortableBackend):
    """Fails its partition, like a backend bug would."""

    def __init__(self, fail: bool):
        self.fail = fail

    def partition(self, program):
        if self.fail:
            raise RuntimeError("partitioner exploded")
        return super().partition(program)


def test_crash_reproducer_saves_a_program_with_symbolic_floats(tmp_path):
    model, inputs = _euler()
    whole = compiler.compile(model, inputs, "portable")
    with pytest.raises(compiler.CompileError) as err:
        compiler.compile(model, inputs, FlakyPortable(fail=True), reproducer_dir=tmp_path)
    assert err.value.reproducer_path == str(tmp_path / "decompose.stage")
    resumed = compiler.compile(None, None, FlakyPortable(fail=False), resume_from=err.value.reproducer_path)
    assert resumed.pte == whole.pte


def test_a_stage_file_the_serializer_refuses_costs_the_dump_not_the_compile(small_model, tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("Unable to serialize output")

    model, inputs = small_model
    monkeypatch.setattr("compiler.driver.stage_files.save_stage_file", refuse)
    dump = DumpStages(tmp_path)
    with caplog.at_level(logging.WARNING, logger="compiler.driver.instruments"):
        artifact = compiler.compile(model, inputs, "portable", instruments=[dump])
    assert artifact.pte
    assert [e.stage for e in dump.failures] == [s for s in STAGE_NAMES if s not in ("quantize", "emit")]
    assert "Unable to serialize output" in dump.failures[0].reason
    assert (tmp_path / "02-capture.txt").exists() and not list(tmp_path.glob("*.stage"))
    assert "could not dump capture's output" in caplog.text


class NamedTupleOutputs(torch.nn.Module):
    """Outputs that are torch.return_types structseqs, which no pytree serializer names."""

    def forward(self, x):
        return x.median(dim=-1), x.max(dim=0)


def test_outputs_that_are_return_types_round_trip_through_a_stage_file(tmp_path):
    model, x = NamedTupleOutputs(), torch.randn(3, 5)
    saved = compiler.compile(model, (x,), "portable", stop_after="decompose", dump_dir=tmp_path).artifact.program
    loaded = load_stage_file(_stage_file(tmp_path, "decompose")).artifact.program
    spec = loaded.module_call_graph[0].signature.out_spec
    assert spec == saved.module_call_graph[0].signature.out_spec
    assert [child.type for child in spec.children()] == [tuple, tuple]  # capture made them plain tuples
    resumed = compiler.compile(None, None, "portable", resume_from=_stage_file(tmp_path, "decompose"))
    expected = [t for pair in model(x) for t in pair]
    assert [torch.equal(a, b) for a, b in zip(compiler.run(resumed, (x,)), expected, strict=True)] == [True] * 4
