"""Weights written to files as they are serialised, and kept out of the `.pte` in a data file.

The spill thresholds are lowered to zero here so a small model takes the path a real-size one
does: every named-data blob and CPU constant goes to a file as it is made, the `.pte` is held in
a file. The program must be the same bytes as the one built in memory, and run the same.
"""

import os

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.ir.errors import UserInputError
from compiler.ir import program_data
from compiler.ir.program_data import ProgramData
from compiler.stages import emit, lower

DELEGATED = ("portable", "xnnpack", "mlx")  # their runtimes read weights by name; Core ML's from its payload


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _model():
    torch.manual_seed(0)
    return _MLP().eval(), (torch.randn(2, 64),)


WEIGHT_BYTES = (64 * 96 + 96 + 96 * 8 + 8) * 4


@pytest.fixture
def everything_spilled(monkeypatch):
    monkeypatch.setattr(emit, "SPILL_BLOB_BYTES", 0)
    monkeypatch.setattr(program_data, "SPILL_PROGRAM_BYTES", 0)
    monkeypatch.setattr(lower, "SPILL_BLOB_BYTES", 0)


@pytest.mark.parametrize(
    "backend", ["portable", "xnnpack", pytest.param("mlx", marks=pytest.mark.slow), pytest.param("coreml", marks=pytest.mark.slow)]
)
def test_a_spilled_program_is_the_same_bytes_and_runs_the_same(backend, monkeypatch, tmp_path):
    model, inputs = _model()
    in_memory = compiler.compile(model, inputs, backend, cache=False)
    assert in_memory.program.data.path is None
    monkeypatch.setattr(emit, "SPILL_BLOB_BYTES", 0)
    monkeypatch.setattr(program_data, "SPILL_PROGRAM_BYTES", 0)
    monkeypatch.setattr(lower, "SPILL_BLOB_BYTES", 0)
    spilled = compiler.compile(model, inputs, backend, cache=False)
    assert spilled.program.data.path is not None and os.path.isfile(spilled.program.data.path)
    assert spilled.pte == in_memory.pte
    torch.testing.assert_close(spilled.run(*inputs)[0], in_memory.run(*inputs)[0], rtol=0, atol=0)
    (saved,) = spilled.save(tmp_path / "model.pte")
    assert open(saved, "rb").read() == in_memory.pte


def test_a_spilled_file_goes_with_its_program(everything_spilled):
    model, inputs = _model()
    result = compiler.compile(model, inputs, "xnnpack", cache=False)
    path = result.program.data.path
    del result
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_a_lowered_stage_file_keeps_spilled_weights(everything_spilled, tmp_path):
    """XNNPACK's named data spilled in lower is written into the stage file and read back."""
    model, inputs = _model()
    whole = compiler.compile(model, inputs, "xnnpack", cache=False, dump_dir=str(tmp_path))
    resumed = compiler.compile(None, resume_from=str(tmp_path / "09-lower.stage"), cache=False)
    assert resumed.pte == whole.pte


@pytest.mark.parametrize("backend", DELEGATED)
def test_external_weights_go_to_the_data_file_and_run_from_the_pair(backend, tmp_path):
    model, inputs = _model()
    inside = compiler.compile(model, inputs, backend, cache=False)
    result = compiler.compile(model, inputs, backend, cache=False, external_weights=True)
    weights = result.program.weights
    assert weights is not None and len(weights) >= WEIGHT_BYTES
    assert len(result.program.data) < len(inside.program.data) - WEIGHT_BYTES // 2  # the weights left the .pte
    assert result.report.stage("emit").metrics["ptd_bytes"] == len(weights)
    expected = model(*inputs)
    torch.testing.assert_close(result.run(*inputs)[0], expected, rtol=1e-4, atol=1e-5)
    program, data = result.save(tmp_path / "model.pte")
    assert data == str(tmp_path / "model.ptd") and os.path.getsize(data) == len(weights)
    torch.testing.assert_close(compiler.run(program, inputs)[0], expected, rtol=1e-4, atol=1e-5)  # found beside it


def test_external_weights_are_spilled_like_the_program(everything_spilled):
    model, inputs = _model()
    result = compiler.compile(model, inputs, "xnnpack", cache=False, external_weights=True)
    assert result.program.weights.path is not None
    torch.testing.assert_close(result.run(*inputs)[0], model(*inputs), rtol=1e-4, atol=1e-5)


def test_a_program_without_its_data_file_is_a_named_error(tmp_path):
    model, inputs = _model()
    result = compiler.compile(model, inputs, "xnnpack", cache=False, external_weights=True)
    program, data = result.save(tmp_path / "model.pte")
    os.remove(data)
    with pytest.raises(UserInputError, match="no data file was given") as error:
        compiler.run(program, inputs)
    assert ".ptd" in error.value.hint


def test_core_ml_keeps_its_weights_in_its_payload():
    """Core ML's 1.5.1 runtime reads a one-method model from its payload, not by name."""
    model, inputs = _model()
    result = compiler.compile(model, inputs, "coreml", cache=False, external_weights=True)
    assert result.program.weights is None
    assert len(result.program.data) > WEIGHT_BYTES // 2  # float16 weights, in the payload


def test_cli_writes_and_runs_the_pair(tmp_path, capsys):
    output = tmp_path / "mlp.pte"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--external-weights", "--no-cache", "-o", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"and its weights {tmp_path / 'mlp.ptd'}" in out
    assert (tmp_path / "mlp.ptd").stat().st_size > 0
    assert main(["run", str(output), "mlp"]) == 0
    assert "OK" in capsys.readouterr().out


def test_program_data_saves_a_file_without_reading_it(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(b"\x01" * 1000)
    data = ProgramData(path=str(source), owned=False)
    data.save(tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == b"\x01" * 1000 and data.head(3) == b"\x01" * 3
    del data
    assert source.exists()  # a file it does not own stays
