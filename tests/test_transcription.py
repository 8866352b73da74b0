"""The Whisper-style encoder-decoder: one program of `encoder` and `text_decoder` sharing the
cross-attention cache the encoder fills, decoding greedily as eager does."""

import pytest

import compiler
from compiler.ir.private_api import deserialize_pte
from compiler.models import asr
from compiler.tools import transcription

pytest.importorskip("transformers")


@pytest.mark.slow
def test_whisper_decodes_as_eager_on_portable(tmp_path):
    job = transcription.transcribe("portable", tokens=8, output_dir=tmp_path, check=True)
    check = job.check
    assert check.passed, check.describe()
    assert check.runner == transcription.RUNTIME
    assert len(check.program_tokens) == 8 and len(set(check.eager_tokens)) > 1
    # Under ExecuTorch's runtime the ASR runner's calls are timed: the encoder call, the decoder's per token.
    assert check.encoder_ms > 0 and check.decode_ms_per_token > 0
    assert {"encoder_ms", "decode_ms_per_token"} <= check.to_json().keys() and "encoder call" in check.describe()
    names = [plan.name for plan in deserialize_pte(job.pte_path.read_bytes()).program.execution_plan]
    assert {"encoder", "text_decoder", "get_max_seq_len", "decoder_start_token_id"} <= set(names)
    # The decoder reads the cross-attention keys from the one buffer the encoder writes.
    decoder = job.result.methods["text_decoder"].artifact.program.graph_signature
    assert "owner.cross_keys_0" in decoder.inputs_to_buffers.values()
    assert "owner.cross_keys_0" not in decoder.buffers_to_mutate.values()


def test_the_eager_step_is_checked_against_transformers():
    """The eager reference's cached steps agree with the model's own uncached forward."""
    model = asr.speech_model()
    tokens, encoded = transcription.eager_greedy(model, 4)
    assert len(tokens) == 4 and encoded.shape == (1, 16, 64)
    assert not model.methods.self_keys_0.any()  # the eager caches are empty again


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "coreml", "mlx"])
def test_whisper_decodes_as_eager(backend):
    check = transcription.transcribe(backend, tokens=32, check=True).check
    assert check.passed, check.describe()
    assert check.runner == (transcription.RUNTIME if backend == "xnnpack" else transcription.REFERENCE)
    assert (check.encoder_ms is not None) == (check.decode_ms_per_token is not None) == (backend == "xnnpack")


def test_too_many_tokens_for_the_cache():
    with pytest.raises(compiler.UserInputError, match="do not fit"):
        transcription.check_transcription(b"", asr.speech_model(max_cache_len=8), "portable", steps=9)


@pytest.mark.slow
def test_the_transcribe_command(tmp_path, capsys):
    from compiler.cli.main import main

    assert main(["transcribe", "--tokens", "3", "--check", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 greedy tokens equal to eager's" in out and "text_decoder" in out
    assert (tmp_path / "whisper.pte").is_file()
