"""`--dynamic-dim INPUT:DIM:[MIN:]MAX` makes a built-in model's input size dynamic: the CLI turns
the flags into `dynamic_shapes` (`compiler.api.dynamic_dims`) and compiles through the API."""

import json

import pytest
import torch

from compiler.api import dynamic_dims
from compiler.cli.main import main
from compiler.ir.errors import UserInputError
from dynamic_shape_models import CausalAttention


def test_a_built_in_model_compiles_with_a_dynamic_sequence_and_is_checked_at_its_ends(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["compile", "transformer:depth=1,dim=32,seq=8", "--backend", "xnnpack", "--dynamic-dim", "x:1:2:32",
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
    ],
)
def test_a_wrong_dim_is_named(dims, says):
    model, inputs = CausalAttention(), (torch.randint(0, 40, (1, 8)),)
    with pytest.raises(UserInputError, match=says):
        dynamic_dims(model, inputs, dims)


@pytest.mark.parametrize("text", ["x:1", "x", "x:one:32", "x:1:2:3:4"])
def test_a_malformed_flag_is_an_argument_error(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "mlp", "--dynamic-dim", text])
    assert exit_.value.code == 2
    assert "INPUT:DIM:[MIN:]MAX" in capsys.readouterr().err
