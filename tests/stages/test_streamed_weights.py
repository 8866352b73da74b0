"""A checkpoint folder compiles with its weights mapped, never all in memory, into the very
program the same model held in memory compiles to."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

import compiler  # noqa: E402
import compiler.backends.mlx as mlx_backend  # noqa: E402
import compiler.passes.mapped_quantization as mapped_quantization  # noqa: E402
from compiler.ir.artifacts import EagerModel  # noqa: E402
from compiler.ir.mapped import SPILL_TENSOR_BYTES, is_mapped  # noqa: E402
from compiler.models import llm  # noqa: E402
from compiler.models.checkpoint import load_checkpoint  # noqa: E402

CACHE = 16


def write_llama(folder, hidden: int, intermediate: int, layers: int, vocab: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Every weight at least a megabyte in bfloat16 (what a stage writes to a file of its own)."""
    return write_llama(tmp_path_factory.mktemp("checkpoints") / "llama", 512, 2048, 2, 4096)


def _tensors(artifact) -> dict[str, torch.Tensor]:
    if isinstance(artifact, EagerModel):
        module = artifact.module
        return dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers()])
    program = getattr(artifact, "program", None)
    return {} if program is None else {**program.state_dict, **program.constants}


def test_the_models_weights_are_views_of_the_mapped_files(folder):
    from transformers import AutoModelForCausalLM

    step, inputs, _ = load_checkpoint(folder, "text-generation", max_cache_len=CACHE)
    assert all(is_mapped(p) for p in step.parameters())
    held = llm.text_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), max_cache_len=CACHE)
    assert not any(is_mapped(p) for p in held.step.parameters())
    with torch.no_grad():
        assert torch.equal(step(*inputs), held.step(*inputs))


# (backend, scheme): the backends' float and 4-bit paths, Core ML cut into pieces of 1 MiB.
CASES = [("xnnpack", "8da4w"), ("xnnpack", None), ("mlx", "4w"), ("coreml", "4w")]


@pytest.mark.parametrize("backend,scheme", CASES, ids=[f"{b}-{s or 'float'}" for b, s in CASES])
def test_a_mapped_checkpoint_compiles_to_the_in_memory_models_program(folder, backend, scheme, monkeypatch):
    """Chunks of one layer and blocks of rows smaller than a weight: every piecewise path runs.
    No stage holds a large weight in memory, and the program is the in-memory model's, byte for byte."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(mapped_quantization, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(mapped_quantization, "ROWS_BYTES", 1 << 18)
    monkeypatch.setattr(mlx_backend, "SPILL_TENSOR_BYTES", 1 << 16)  # MLX's packed codes to files too
    options = {"cache": False, "quantize": scheme, "quantize_embedding": "4w" if backend == "xnnpack" and scheme else None}
    if backend == "coreml":
        options["backend_options"] = {"piece_weight_mb": 1}
    step, inputs, shapes = load_checkpoint(folder, "text-generation", max_cache_len=CACHE)
    streamed = compiler.compile(step, inputs, backend, dynamic_shapes=shapes, **options)
    for stage, artifact in streamed.stages.items():
        held = sorted(
            name for name, t in _tensors(artifact).items()
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= SPILL_TENSOR_BYTES and not is_mapped(t)
        )
        assert not held, f"{stage} holds {held} in memory"
    text = llm.text_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), max_cache_len=CACHE)
    text.reset()
    in_memory = compiler.compile(text.step, text.example_inputs, backend, dynamic_shapes=text.dynamic_shapes, **options)
    assert streamed.pte == in_memory.pte



def test_core_ml_converts_a_large_model_a_piece_at_a_time(folder, monkeypatch):
    """Pieces of about 1 MiB of weights, each payload stored as the program's named data with
    a reference in its delegate (as a real-size model's are): the KV cache's state stays whole
    in its piece, the report says how the program is split, and the program checks."""
    import compiler.backends.coreml.payload as coreml_payload

    monkeypatch.setattr(coreml_payload, "STORED_PAYLOAD_BYTES", 1 << 10)
    step, inputs, shapes = load_checkpoint(folder, "text-generation", max_cache_len=CACHE)
    result = compiler.compile(step, inputs, "coreml", dynamic_shapes=shapes, cache=False, quantize="4w",
                              backend_options={"piece_weight_mb": 1})
    partition = result.report.stage("partition")
    assert partition.delegates >= 4
    assert any("delegates of at most about 1 MiB each" in note for note in partition.notes)
    from compiler.ir.private_api import deserialize_pte

    named = deserialize_pte(result.pte).named_data
    assert len([key for key in named.pte_data if key.startswith("coreml_")]) == partition.delegates
    check = compiler.compare_with_eager(result, step, inputs)
    assert check.passed, check


_CHILD = textwrap.dedent("""
    import json, sys, torch, compiler
    from compiler.ir import mapped
    from compiler.models.checkpoint import load_checkpoint
    from compiler.passes import mapped_quantization
    from compiler.process.memory import peak_resident_bytes, resident_bytes

    # The pieces scaled down with the model (an 8B model's are 128, 64 and 32 MiB).
    mapped.RELEASE_EVERY_BYTES, mapped_quantization.CHUNK_BYTES, mapped_quantization.ROWS_BYTES = 16 << 20, 8 << 20, 4 << 20

    def compile_folder(folder):
        step, inputs, shapes = load_checkpoint(folder, "text-generation", max_cache_len=16)
        return compiler.compile(step, inputs, "xnnpack", dynamic_shapes=shapes, cache=False, quantize="8da4w",
                                quantize_embedding="4w")

    compile_folder(sys.argv[1])  # the libraries a compile imports, loaded before the baseline
    baseline = resident_bytes()
    result = compile_folder(sys.argv[2])
    print(json.dumps({"baseline": baseline, "peak": peak_resident_bytes(),
                      "stages": {r.stage: r.peak_rss_bytes for r in result.report.stages}}))
""")


@pytest.mark.slow
def test_a_compile_from_a_checkpoint_stays_within_the_streaming_bound(folder, tmp_path):
    """In a process of its own: what compiling a 0.2B-parameter checkpoint (357 MiB) adds to the
    resident set is within the bound an 8B compile holds to, scaled down with its pieces: half
    the weights and 128 MiB (a layer's codes and TorchAO's temporaries; the largest weight, the
    tied embedding, is 37% of them). Codes kept in memory add half the weights more, a copy of
    the checkpoint all of them."""
    big = write_llama(tmp_path / "big", 2048, 8192, 2, 32000)
    weights = sum(os.path.getsize(os.path.join(big, n)) for n in os.listdir(big) if n.endswith(".safetensors"))
    done = subprocess.run([sys.executable, "-c", _CHILD, folder, big], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    over = measured["peak"] - measured["baseline"]
    stages = ", ".join(f"{s} {(p or 0) / 2**20:.0f}" for s, p in measured["stages"].items())
    bound = weights // 2 + (128 << 20)
    assert over < bound, f"{over / 2**20:.0f} MiB over the baseline for {weights / 2**20:.0f} MiB of weights ({stages})"


def test_the_running_stage_says_how_much_of_the_weights_is_written():
    """A real-size lowering is minutes of writing weights: its line counts them."""
    from compiler.reporting import progress

    steps = []
    token = progress.listen(lambda desc, done, total: steps.append((desc, done, total)))
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)]).eval()
        compiler.compile(model, (torch.randn(2, 1024),), "xnnpack", cache=False)
    finally:
        progress.stop_listening(token)
    written = [(done, total) for desc, done, total in steps if desc == "MB of weights written"]
    assert written and written[-1][0] >= 11 and written[-1][1] == 12  # three 4 MiB weights and their biases
