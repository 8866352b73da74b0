"""The emit stage's constant methods: metadata an ExecuTorch runner reads from the `.pte`
(ExecuTorch's LLM runners read get_max_seq_len, get_eos_ids, use_kv_cache, ...)."""

import pytest
import torch

import compiler
from compiler.driver import config
from compiler.stages.options import EmitOptions, constant_method_values
from executorch.runtime import Runtime


def test_constant_methods_are_in_the_pte_and_return_their_values(small_model):
    model, inputs = small_model
    result = compiler.compile(
        model, inputs, "portable",
        emit_constant_methods=("get_max_seq_len=16", "get_eos_ids=1,2", "use_kv_cache=true", "scale=0.5"),
    )
    program = Runtime.get().load_program(result.pte)
    assert {"forward", "get_max_seq_len", "get_eos_ids", "use_kv_cache", "scale"} <= set(program.method_names)
    assert program.load_method("get_max_seq_len").execute([]) == [16]
    assert program.load_method("get_eos_ids").execute([]) == [1, 2]
    assert program.load_method("use_kv_cache").execute([]) == [True]
    assert program.load_method("scale").execute([]) == [0.5]
    (out,) = compiler.run(result, inputs)  # forward still runs (the first plan)
    torch.testing.assert_close(out, model(*inputs))


def test_values_are_read_as_bool_int_float_or_a_list():
    assert constant_method_values(("a=false", "b=-3", "c=1e-3", "d=7,8", "e=9,")) == {
        "a": False, "b": -3, "c": 1e-3, "d": [7, 8], "e": [9],
    }


@pytest.mark.parametrize("given", ["nameless", "=3", "x=", "x=abc", "x=1;y=2", "forward=1"])
def test_a_malformed_constant_method_is_a_named_error(given):
    with pytest.raises(compiler.UserInputError, match="emit") as raised:
        EmitOptions(constant_methods=(given,))
    assert "NAME=VALUE" in raised.value.hint


def test_a_name_given_twice_is_an_error():
    with pytest.raises(compiler.UserInputError, match="twice"):
        EmitOptions(constant_methods=("a=1", "a=2"))


def test_constant_methods_are_an_option_with_a_flag_and_recorded_in_the_configuration():
    spec = {s.name: s for s in config.options()}["emit_constant_methods"]
    assert spec.flag == "--emit-constant-methods" and spec.repeated
    chosen = config.CompileConfig().with_options({"emit_constant_methods": ("get_max_seq_len=8",)})
    assert config.CompileConfig.from_json(chosen.to_json()) == chosen


def test_a_resumed_run_emits_the_recorded_constant_methods(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(
        model, inputs, "portable", stop_after="lower", dump_dir=str(tmp_path), emit_constant_methods=("get_bos_id=2",)
    )
    (stage_file,) = tmp_path.glob("*-lower.stage")
    resumed = compiler.compile(None, resume_from=str(stage_file))
    program = Runtime.get().load_program(resumed.pte)
    assert program.load_method("get_bos_id").execute([]) == [2]
