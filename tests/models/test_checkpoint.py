"""A save_pretrained folder as MODEL: read in its own dtype, compiled by task, checked against eager."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

import compiler  # noqa: E402
from compiler.cli.main import main  # noqa: E402
from compiler.ir.errors import UserInputError  # noqa: E402
from compiler.models.catalog import check_model_spec  # noqa: E402
from compiler.models.checkpoint import load_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("checkpoints") / "llama"
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM

    folder = tmp_path_factory.mktemp("checkpoints") / "bert"
    config = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)
    BertForMaskedLM(config).eval().save_pretrained(folder)
    return str(folder)


def test_text_generation_reads_the_checkpoint_in_its_own_dtype(llama_folder):
    step, inputs, shapes = load_checkpoint(llama_folder, "text-generation", max_cache_len=32)
    dtypes = {p.dtype for p in step.parameters()}
    assert dtypes == {torch.bfloat16}  # not cast to float32 on the way in
    assert [tuple(t.shape) for t in inputs] == [(1, 1), (1,)] and shapes is None


def test_a_folders_text_model_is_its_own_dtype_and_checks_in_the_programs(llama_folder):
    """`generate`'s loader reads a bfloat16 folder as bfloat16; the eager model its check runs for a
    float32 program is a float32 copy, computing as the folder read in float32 does."""
    from compiler.models import llm
    from compiler.tools import generation

    text = llm.text_model(llama_folder, max_cache_len=32)
    assert {p.dtype for p in text.hf_model.parameters()} == {torch.bfloat16}
    cast = generation.in_precision(text, torch.float32)
    assert {p.dtype for p in cast.hf_model.parameters()} == {torch.float32}
    assert generation.in_precision(text, torch.bfloat16) is text
    wide = llm.text_model(llama_folder, max_cache_len=32, dtype=torch.float32)
    step = (torch.tensor([[1]]), torch.tensor([0]))
    with torch.no_grad():
        assert torch.equal(cast.step(*step), wide.step(*step))


@pytest.mark.slow  # the generation job with its runner check, about 30 s
def test_generate_reads_the_checkpoint_in_its_own_dtype_and_checks_in_the_programs(llama_folder):
    """The generation job loads a bfloat16 folder as bfloat16 (not doubled into float32 first); its
    check runs eager in float32, as the XNNPACK program computes, and allows only the one rounding of
    the logits the program returns in the model's bfloat16."""
    job = compiler.generate(llama_folder, "xnnpack", tokens=8, check=True, max_cache_len=32, cache=False)
    assert {p.dtype for p in job.model.hf_model.parameters()} == {torch.bfloat16}
    assert job.result.report.stage("precision").metrics["dtype"] == "float32"
    assert job.check.passed, job.check.describe()
    assert "half a bfloat16 ulp" in job.check.tolerance.rule  # the logits come back in the model's dtype


@pytest.mark.parametrize("backend", [pytest.param("portable", marks=pytest.mark.slow), "xnnpack"])
def test_cli_compiles_a_folder_by_task_and_checks_it(llama_folder, backend, tmp_path, capsys):
    output = tmp_path / "llama.pte"
    assert main(["compile", llama_folder, "--task", "text-generation", "--backend", backend, "--check",
                 "--no-cache", "--external-weights", "-o", str(output)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and output.exists() and (tmp_path / "llama.ptd").exists()
    assert main(["run", str(output), llama_folder, "--task", "text-generation"]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.slow  # two compiles of the decoder step and three checks, about a minute
def test_the_readmes_command_checks_one_figure_cold_on_a_cache_hit_and_in_run(llama_folder, tmp_path, capsys):
    """Issue 54: the README's real-size command passed cold and crashed in the check on a stage cache
    hit; `run` compared the quantized program with the float model."""
    program, report = tmp_path / "llama.pte", tmp_path / "report.json"
    command = ["compile", llama_folder, "--task", "text-generation", "--backend", "xnnpack", "--quantize", "8da4w",
               "--check", "--cache-dir", str(tmp_path / "cache"), "-o", str(program), "--report-json", str(report)]
    checks = []
    for _ in range(2):
        assert main(command) == 0
        checks.append(capsys.readouterr().out.splitlines()[-1])
    assert "precision" in [s["stage"] for s in json.loads(report.read_text())["stages"] if s["cached"]]
    assert main(["run", str(program), llama_folder, "--task", "text-generation"]) == 0
    checks.append(capsys.readouterr().out.splitlines()[-1])
    assert checks[0].startswith("check against the eager quantized model in float32:")
    assert checks == [checks[0]] * 3


@pytest.mark.slow
def test_fill_mask_folder_compiles(bert_folder):
    module, inputs, _ = load_checkpoint(bert_folder, "fill-mask")
    result = compiler.compile(module, inputs, "xnnpack", cache=False)
    check = compiler.compare_with_eager(result, module, inputs)
    assert check.passed, check.describe()
    assert result.run(*inputs)[0].shape == (1, 16, 300)


def test_a_folder_needs_a_known_task(llama_folder, tmp_path):
    with pytest.raises(UserInputError, match="needs a task"):
        check_model_spec(llama_folder)
    with pytest.raises(UserInputError, match="needs a task, not 'translation'"):
        check_model_spec(f"{llama_folder}:translation")
    check_model_spec(f"{llama_folder}:text-generation")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserInputError, match="holds no config.json"):
        check_model_spec(f"{empty}:text-generation")


def test_task_is_refused_for_a_model_that_is_not_a_folder(capsys):
    assert main(["compile", "mlp", "--task", "fill-mask"]) == 2
    assert "--task fill-mask is for a save_pretrained folder" in capsys.readouterr().err


def test_a_folder_without_weights_says_so(llama_folder, tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text(open(os.path.join(llama_folder, "config.json")).read())
    with pytest.raises(UserInputError, match="no weights"):
        load_checkpoint(config_only, "fill-mask")
