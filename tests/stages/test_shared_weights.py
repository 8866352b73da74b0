"""One data file for several programs compiled from the same weights (`compiler.share_weights`):
each distinct weight stored once, every program runs from it as from its own, and files holding
different weights under one name are refused."""

import os

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.ir.errors import UserInputError


class _Table(torch.nn.Module):
    """A table the CPU reads (the embedding) and Linears XNNPACK takes."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(128, 64)
        self.first, self.second = torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)

    def forward(self, tokens):
        return self.second(torch.relu(self.first(self.embedding(tokens))))


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return _Table().eval(), (torch.tensor([[1, 5, 9, 127]]),)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _compiled(tmp_path, name: str, backend: str, seed: int = 0, **options) -> str:
    model, inputs = _model(seed)
    path = tmp_path / f"{name}.pte"
    compiler.compile(model, inputs, backend, external_weights=True, **options).save(path)
    return str(path)


def test_programs_of_one_model_share_one_data_file(tmp_path):
    model, inputs = _model()
    programs = [_compiled(tmp_path, "cpu", "portable"), _compiled(tmp_path, "xnnpack", "xnnpack"),
                _compiled(tmp_path, "quantized", "xnnpack", quantize="8da4w", quantize_group_size=32)]
    shared = compiler.share_weights(programs, tmp_path / "shared.ptd")
    # The float weights the CPU program holds and XNNPACK's payload names are one copy; the
    # quantized program's table is the float programs' too.
    alone = sum(compiler.share_weights([p], tmp_path / "one.ptd").segments for p in programs)
    assert shared.segments < alone, (shared.segments, alone)
    assert shared.bytes_written < 0.6 * shared.bytes_read, shared.describe()
    assert shared.bytes_written < 1.6 * _weight_bytes(model), shared.describe()
    for program in programs:
        own = compiler.run(program, inputs)
        from_shared = compiler.run(program, inputs, weights=tmp_path / "shared.ptd")
        assert all(torch.equal(a, b) for a, b in zip(own, from_shared))
        # Without its own data file beside it, the program runs from the shared one alone.
        os.remove(program.replace(".pte", ".ptd"))
        check = compiler.compare_with_eager(program, model, inputs, weights=tmp_path / "shared.ptd")
        assert check.passed or "quantized" in program, check.describe()


def test_data_files_holding_other_weights_under_one_name_are_refused(tmp_path):
    first = _compiled(tmp_path, "first", "portable", seed=0)
    other = _compiled(tmp_path, "other", "portable", seed=1)
    with pytest.raises(UserInputError, match="different weights under one name, 'embedding.weight'"):
        compiler.share_weights([first, other], tmp_path / "shared.ptd")
    assert not (tmp_path / "shared.ptd").exists()
    with pytest.raises(UserInputError, match="compile the program with --external-weights"):
        compiler.share_weights([tmp_path / "missing.pte"], tmp_path / "shared.ptd")


@pytest.mark.slow  # two CLI compiles; the API test above covers the file
def test_cli_shares_the_weights_and_runs_a_program_from_them(tmp_path, capsys):
    for backend in ("portable", "xnnpack"):
        assert main(["compile", "mlp", "--backend", backend, "--external-weights", "--no-cache", "-q",
                     "-o", str(tmp_path / f"{backend}.pte")]) == 0
    shared = tmp_path / "shared.ptd"
    assert main(["share-weights", str(tmp_path / "portable.pte"), str(tmp_path / "xnnpack.ptd"), "-o", str(shared)]) == 0
    assert "wrote" in capsys.readouterr().out and shared.exists()
    os.remove(tmp_path / "xnnpack.ptd")
    assert main(["run", str(tmp_path / "xnnpack.pte"), "mlp", "--weights", str(shared)]) == 0
    assert "OK" in capsys.readouterr().out
