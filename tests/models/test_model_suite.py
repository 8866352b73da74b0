"""The transformers model suite: each model compiles for every backend and matches eager.

Models are built from configs with random weights (compiler.models.model_suite); nothing is
downloaded. Portable, XNNPACK and MLX programs run here (MLX through the reference
runner); for Core ML the placement and the converted MIL are checked where they matter,
and the image-text-to-text model runs through the MIL reference interpreter.
"""

import pytest
import torch

pytest.importorskip("transformers")

import compiler
from compiler.models import model_suite
from compiler.backends.coreml.payload import read_models

pytestmark = pytest.mark.models

RUNNABLE = ["portable", "xnnpack", "mlx"]

# Largest absolute difference from eager allowed, float32 throughout: a few ulps of the
# largest logits, accumulated over the layers (48 for GPT-2).
TOLERANCE = {name: 1e-4 for name in model_suite.SUITE}
TOLERANCE["gpt2"] = 5e-4


def _build(name):
    return model_suite.SUITE[name]()


def _assert_matches_eager(name, got, want):
    for g, w in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
        assert g.shape == w.shape
        error = (g - w).abs().max().item()
        assert error <= TOLERANCE[name], f"{name}: max |ours - eager| = {error:.3g} > {TOLERANCE[name]}"


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("name", [n for n in model_suite.SUITE if n != "llama_static_cache"])
def test_model_compiles_and_matches_eager(name, backend):
    module, inputs = _build(name)
    artifact = compiler.compile(module, inputs, backend)
    with torch.no_grad():
        want = module(*inputs)
    _assert_matches_eager(name, compiler.run(artifact, inputs), want)
    if backend != "portable":
        assert artifact.program.delegates, f"{name}: nothing was delegated to {backend}"


@pytest.mark.parametrize("backend", RUNNABLE)
def test_llama_static_cache_decodes_two_steps_like_eager(backend):
    """The KV cache is state: the second step reads what the first wrote."""
    eager, _ = model_suite.llama_static_cache()
    module, inputs = model_suite.llama_static_cache()
    loaded = compiler.LoadedProgram(compiler.compile(module, inputs, backend))
    outputs = []
    for step in range(2):
        step_inputs = model_suite.decode_inputs(step)
        with torch.no_grad():
            want = eager(*step_inputs)
        (got,) = loaded(step_inputs)
        _assert_matches_eager("llama_static_cache", (got,), want)
        outputs.append(got)
    # The second step's logits depend on the first token through the cache.
    fresh = compiler.LoadedProgram(compiler.compile(*model_suite.llama_static_cache(), backend))
    fresh((torch.tensor([[99]]), torch.tensor([0])))
    (other,) = fresh(model_suite.decode_inputs(1))
    assert not torch.allclose(other, outputs[1])


@pytest.mark.parametrize("name", list(model_suite.SUITE))
def test_model_compiles_for_core_ml(name):
    module, inputs = _build(name)
    artifact = compiler.compile(module, inputs, "coreml")
    assert artifact.program.delegates == ("CoreMLBackend",) * len(artifact.program.delegates)
    assert read_models(artifact.pte)


def _reading(program, name):
    """The nodes computed from the input `name`."""
    (node,) = [n for n in program.graph.nodes if n.op == "placeholder" and n.name == name]
    seen, frontier = set(), [node]
    while frontier:
        for user in frontier.pop().users:
            if user.name not in seen:
                seen.add(user.name)
                frontier.append(user)
    return seen


def test_camera_frame_wrapper_keeps_only_the_ops_before_the_float_conversion_on_the_cpu():
    """Of the ops computed from the frame; the position ids Idefics3 computes from no input
    stay on the CPU below iOS 18 (a Core ML partition needs a tensor input there)."""
    module, inputs = model_suite.smolvlm_vision_uint8()
    artifact = compiler.compile(module, inputs, "coreml")
    from_frame = _reading(artifact.stages["partition"].program, "frame")
    cpu = sorted(p.op for p in artifact.program.plan.cpu_nodes if p.node in from_frame)
    assert cpu == [
        "aten.permute_copy.default",
        "aten.unsqueeze_copy.default",
        "dim_order_ops._to_dim_order_copy.default",  # the .to(float32)
    ]


def test_gemma_gelu_converts_in_tanh_mode():
    module, inputs = model_suite.gemma()
    artifact = compiler.compile(module, inputs, "coreml")
    modes = [op.constants["mode"] for model in read_models(artifact.pte) for op in model.ops_of_type("gelu")]
    assert modes and set(modes) == {"TANH_APPROXIMATION"}


def test_image_text_to_text_matches_eager_on_core_ml():
    """SmolVLM's vision tower runs over the images that are not all padding, u of them, picked by a
    bool mask at run time: ops reading a size of 16*u from the CPU run there too, and the attention
    mask's where over u images keeps the mask's shape (payloads run in the MIL reference interpreter)."""
    module, inputs = model_suite.smolvlm()
    artifact = compiler.compile(module, inputs, "coreml")
    assert compiler.compare_with_eager(artifact, module, inputs).passed
    assert any("sized 16*u" in p.reason for p in artifact.program.plan.cpu_nodes)


@pytest.mark.parametrize("name", ["llama_static_cache", "siglip", "gemma3_vlm", "whisper"])
def test_eager_attention_matches_eager_too(name):
    """transformers' other attention path: plain matmuls and softmax instead of SDPA."""
    module, inputs = model_suite.SUITE[name](attention="eager")
    artifact = compiler.compile(module, inputs, "xnnpack")
    with torch.no_grad():
        want = module(*inputs)
    _assert_matches_eager(name, compiler.run(artifact, inputs), want)
