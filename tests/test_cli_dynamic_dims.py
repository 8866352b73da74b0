"""`--dynamic-dim INPUT:DIM:[MIN:]MAX` makes a built-in model's input size dynamic, and
`INPUT:DIM=OTHER:DIM` ties a size to another's: the CLI turns the flags into `dynamic_shapes`
(`compiler.api.dynamic_dims`) and compiles through the API; `run` checks a `.pte` at the ends of
the ranges the flags give."""

import json
import textwrap

import pytest
import torch

from compiler.api import dynamic_dims
from compiler.cli.main import main
from compiler.driver.dynamic_dims import DynamicDim
from compiler.driver.stage_files import load_stage_file
from compiler.ir.errors import UserInputError
from dynamic_shape_models import CausalAttention

TRANSFORMER = "transformer:depth=1,dim=32,seq=8"


def test_a_built_in_model_compiles_with_a_dynamic_sequence_and_is_checked_at_its_ends(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["compile", TRANSFORMER, "--backend", "xnnpack", "--dynamic-dim", "x:1:2:32",
            "--check", "--report-json", str(report)]
    assert main(argv) == 0
    check = json.loads(report.read_text())["check"]
    assert check["passed"] and check["sizes"] == ["x's dim 1 = 2", "x's dim 1 = 32"]
    assert "also at x's dim 1 = 2, x's dim 1 = 32" in capsys.readouterr().out


def test_inputs_by_name_or_position_each_get_their_own_dim():
    model, inputs = CausalAttention(), (torch.randint(0, 40, (1, 8)),)
    (by_name,) = dynamic_dims(model, inputs, [("ids", 1, None, 64)])
    (by_position,) = dynamic_dims(model, inputs, [("0", 1, 2, 64)])
    assert (by_name[1].min, by_name[1].max, by_position[1].min) == (1, 64, 2)


@pytest.mark.parametrize(
    "dims, says",
    [
        ([("mask", 1, None, 64)], "forward has no input 'mask'"),
        ([("ids", 2, None, 64)], "has 2 dimensions"),
        ([("ids", 1, None, 4)], "the example's size 8 is outside 1..4"),
        ([("ids", 1, 9, 4)], "outside 9..4"),
        ([DynamicDim("ids", 0, same_as=("ids", 1))], "ids:0=ids:1 ties ids's dim 0 to ids's dim 1, which is given no"),
        ([("ids", 1, None, 64), DynamicDim("ids", 0, same_as=("ids", 1))], "example.s ids has size 1 there, its ids"),
    ],
)
def test_a_wrong_dim_is_named(dims, says):
    model, inputs = CausalAttention(), (torch.randint(0, 40, (1, 8)),)
    with pytest.raises(UserInputError, match=says):
        dynamic_dims(model, inputs, dims)


@pytest.mark.parametrize("command", [["compile", "mlp"], ["run", "mlp.pte", "mlp"]])
@pytest.mark.parametrize("text", ["x:1", "x", "x:one:32", "x:1:2:3:4", "mask:1=ids", "mask=ids:1", "mask:1=ids:1:32"])
def test_a_malformed_flag_is_an_argument_error(command, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--dynamic-dim", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --dynamic-dim: {text!r} is neither INPUT:DIM:[MIN:]MAX nor INPUT:DIM=OTHER:DIM" in err


def test_run_checks_a_program_at_the_ends_of_the_ranges_given(tmp_path, capsys):
    """A .pte does not say which sizes are dynamic: run's flags do, and it runs at their ends too."""
    program = str(tmp_path / "t.pte")
    assert main(["compile", TRANSFORMER, "--dynamic-dim", "x:1:2:32", "-o", program, "-q"]) == 0
    capsys.readouterr()
    assert main(["run", program, TRANSFORMER, "--dynamic-dim", "x:1:2:32"]) == 0
    assert "-> OK" in (out := capsys.readouterr().out) and "also at x's dim 1 = 2, x's dim 1 = 32" in out
    # Past the length its memory was planned for, the program is refused: the check fails there.
    assert main(["run", program, TRANSFORMER, "--dynamic-dim", "x:1:2:64"]) == 1
    assert "failed at x's dim 1 = 64" in capsys.readouterr().out


def test_a_tied_dim_is_one_symbol_for_both_inputs(tmp_path):
    """`attention_mask:1=input_ids:1`: one torch.export.Dim, so the captured program's two inputs share
    one size symbol (with two Dims of their own, torch.export refuses the model: the sizes must be equal)."""
    (tmp_path / "masked.py").write_text(textwrap.dedent("""
        import torch

        class Masked(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(16, 8)

            def forward(self, input_ids, attention_mask):
                return self.embed(input_ids) * attention_mask.unsqueeze(-1)

        def make():
            return Masked().eval(), (torch.randint(0, 16, (1, 6)), torch.ones(1, 6))
    """))
    stage = tmp_path / "capture.stage"
    argv = ["compile", f"{tmp_path / 'masked.py'}:make", "--dynamic-dim", "input_ids:1:2:32",
            "--dynamic-dim", "attention_mask:1=input_ids:1", "--stop-after", "capture", "-o", str(stage), "-q"]
    assert main(argv) == 0
    program = load_stage_file(str(stage)).artifact.program
    ids, mask = (node.meta["val"].shape for node in program.graph.nodes if node.op == "placeholder"
                 and node.name in program.graph_signature.user_inputs)
    assert isinstance(ids[1], torch.SymInt) and str(ids[1]) == str(mask[1])
    (bounds,) = [r for symbol, r in program.range_constraints.items() if str(symbol) == str(ids[1])]
    assert (bounds.lower, bounds.upper) == (2, 32)
