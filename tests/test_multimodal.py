"""The LLaVA-style vision-language model: one program of `vision_encoder`, `token_embedding` and
`text_decoder` that ExecuTorch's MultimodalRunner runs, generating greedily as eager does."""

import pytest

import compiler
from compiler.models import vlm
from compiler.tools import multimodal

pytest.importorskip("transformers")


@pytest.mark.slow
def test_llava_generates_as_eager_under_the_multimodal_runner(tmp_path):
    job = multimodal.describe_image("portable", tokens=3, output_dir=tmp_path, check=True)
    check = job.check
    assert check.passed, check.describe()
    assert check.runner == multimodal.RUNNER and len(check.program_tokens) == 3
    # Timed over the runner's own Stats intervals and token counts.
    assert check.prefill_ms_per_token > 0 and check.decode_ms_per_token > 0
    assert {*vlm.METHODS, "get_max_seq_len", "get_eos_ids", "enable_dynamic_shape"} <= set(check.methods)
    assert check.to_json()["program_methods"] == list(vlm.METHODS)
    assert job.pte_path.is_file() and job.tokenizer_path.is_file()
    # The image's placeholders stand where the runner prefills the image: after BOS and two tokens.
    assert check.prompt[:3] == (vlm.llm.BOS, 5, 9) and check.prompt[3:19] == (vlm.IMAGE,) * 16


def test_the_eager_methods_compose_as_transformers_generates():
    model = vlm.vision_language_model()
    segments = multimodal.prompt_ids(model, multimodal.DEFAULT_PROMPT)
    eager = multimodal.eager_greedy(model, segments, 6)
    assert eager.tokens == multimodal._transformers_generate(model, segments, 6)
    assert [start for _, start in eager.calls[:4]] == [0, 3, 19, 23]  # BOS t5 t9, the image, t13..t25, a token
    assert not model.methods.decoder.exportable.key_cache_0.any()  # the eager cache is empty again


def test_a_prompt_must_not_start_with_the_image():
    with pytest.raises(compiler.UserInputError, match="text, then the image"):
        multimodal.prompt_ids(vlm.vision_language_model(), (multimodal.IMAGE, "t5"))


@pytest.mark.slow
def test_llava_generates_32_tokens_as_eager_on_xnnpack():
    check = multimodal.describe_image("xnnpack", tokens=32, check=True).check
    assert check.passed, check.describe()
    assert check.runner == multimodal.RUNNER and len(check.program_tokens) == 32


@pytest.mark.slow
def test_llava_generates_32_tokens_as_eager_on_mlx_with_its_ops():
    """With MLX's own cache update and attention (mlx:: ops) as without them."""
    check = multimodal.describe_image("mlx", tokens=32, check=True, backend_llm_ops=True).check
    assert check.passed, check.describe()
    assert check.runner == multimodal.generation.REFERENCE and check.llm_ops == "mlx"
    assert check.prefill_ms_per_token is None and check.decode_ms_per_token is None  # no runner ran it


@pytest.mark.slow
def test_the_describe_image_command(tmp_path, capsys):
    from compiler.cli.main import main

    assert main(["describe-image", "--tokens", "3", "--check", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 greedy tokens equal to eager's" in out and "MultimodalRunner" in out
    assert (tmp_path / "llava.pte").is_file() and (tmp_path / "tokenizer.json").is_file()
