"""Hugging Face transformers models, tiny and with random weights, built from configs.

These are the models users bring and did not write: a language model with a static KV
cache, vision and speech encoders, a vision-language model. Every builder returns
`(module, example_inputs)` like the built-in examples; `from_pretrained` is never called
and nothing is downloaded. They need the `models` extra (`pip install -e '.[models]'`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from compiler.ir.errors import UserInputError

TRANSFORMERS_RANGE = ">=5.4,<5.6"


def _needs_transformers(builder: Callable) -> Callable:
    """Seeded like the built-in examples (`seed` draws others), and a named error when the
    extra is missing."""

    @functools.wraps(builder)
    def build(*args, seed: int = 0, **kwargs):
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise UserInputError(
                f"the model {builder.__name__!r} needs Hugging Face transformers, which is not installed",
                hint="pip install -e '.[models]'",
            ) from exc
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            module, inputs = builder(*args, **kwargs)
        return module.eval(), inputs

    build.draws_inputs = True
    return build


def _attention(config, implementation: str):
    """transformers' attention: "sdpa" (its default, what users get) or "eager" (plain matmuls
    and softmax); either way the mask comes from its masking utilities."""
    if implementation not in ("sdpa", "eager"):
        raise UserInputError(
            f"attention={implementation!r} is not one of sdpa, eager", hint="attention=sdpa or attention=eager"
        )
    config._attn_implementation = implementation
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = implementation
    return config


def _layer_sizes(hidden: int, layers: int) -> dict:
    """The sizes every tiny transformer here shares: `layers` blocks of width `hidden`, an MLP
    twice as wide and four attention heads, in transformers' usual keyword names."""
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4)


def _gemma_text_sizes(hidden: int, layers: int) -> dict:
    """Gemma's and Gemma 3's text models: heads of width 16, the four query heads sharing one
    key/value head (multi-query attention)."""
    return dict(_layer_sizes(hidden, layers), num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


def _vision_config(config_class, image: int, patch: int, hidden: int, layers: int, attention: str):
    """A ViT-style vision tower's config (SigLIP, Idefics3): square `image`, `patch`-sized patches."""
    return _attention(config_class(image_size=image, patch_size=patch, **_layer_sizes(hidden, layers)), attention)


class Logits(nn.Module):
    """Runs a causal LM without a cache and returns only the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class DecoderStep(nn.Module):
    """One decoding step of a causal LM with a static KV cache, as optimum-executorch exports it.

    Wraps transformers' `TorchExportableModuleForDecoderOnlyLM`; its own `forward` drops
    `cache_position` in transformers 5.5 (its `export` traces the inner module instead), so
    this calls the inner module, whose registered cache buffers are mutated in place.
    """

    def __init__(self, exportable: nn.Module) -> None:
        super().__init__()
        self.exportable = exportable

    def forward(self, input_ids, cache_position):
        return self.exportable.model(input_ids=input_ids, cache_position=cache_position)


@_needs_transformers
def llama_static_cache(layers: int = 2, hidden: int = 64, max_cache_len: int = 16, vocab: int = 128, attention: str = "sdpa"):
    """Llama decoder step with a static KV cache (TorchExportableModuleForDecoderOnlyLM); inputs: token ids, cache position."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    config = _attention(
        LlamaConfig(
            vocab_size=vocab,
            **_layer_sizes(hidden, layers),
            num_key_value_heads=2,
            max_position_embeddings=4 * max_cache_len,
        ),
        attention,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
    return DecoderStep(exportable), (torch.tensor([[5]]), torch.tensor([0]))


def decode_inputs(step: int, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of decoding step `step` of `llama_static_cache`: a token id and its position."""
    return torch.tensor([[(5 + 7 * step) % vocab]]), torch.tensor([step])


@_needs_transformers
def gemma(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """Gemma causal LM with hidden_activation="gelu_pytorch_tanh"; returns the logits."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = _attention(
        GemmaConfig(vocab_size=vocab, **_gemma_text_sizes(hidden, layers), hidden_activation="gelu_pytorch_tanh"),
        attention,
    )
    return Logits(GemmaForCausalLM(config)), (torch.randint(0, vocab, (1, seq)),)


class Tensors(nn.Module):
    """Returns a model output's tensors as a tuple, in the order named."""

    def __init__(self, model: nn.Module, *names: str) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs):
        out = self.model(*inputs)
        return tuple(getattr(out, name) for name in self.names)


@_needs_transformers
def siglip(image: int = 32, patch: int = 8, hidden: int = 64, layers: int = 2, attention: str = "sdpa"):
    """SigLIP vision encoder; returns the patch embeddings and the pooled embedding."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    model = SiglipVisionModel(_vision_config(SiglipVisionConfig, image, patch, hidden, layers, attention))
    return Tensors(model, "last_hidden_state", "pooler_output"), (torch.randn(1, 3, image, image),)


class CameraFrame(nn.Module):
    """Takes a uint8 HWC camera frame as a robot gives it: permute, to float, scale, normalize."""

    def __init__(self, vision: nn.Module, mean: float = 0.5, std: float = 0.5) -> None:
        super().__init__()
        self.vision = vision
        self.mean, self.std = mean, std

    def forward(self, frame):
        pixels = frame.permute(2, 0, 1).unsqueeze(0).to(torch.float32) / 255.0
        return self.vision(pixel_values=(pixels - self.mean) / self.std).last_hidden_state


@_needs_transformers
def smolvlm_vision_uint8(image: int = 32, patch: int = 8, hidden: int = 64, layers: int = 2, attention: str = "sdpa"):
    """SmolVLM (Idefics3) vision transformer behind a uint8 HWC camera-frame wrapper."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    config = _vision_config(Idefics3VisionConfig, image, patch, hidden, layers, attention)
    frame = torch.randint(0, 256, (image, image, 3), dtype=torch.uint8)
    return CameraFrame(Idefics3VisionTransformer(config)), (frame,)


@_needs_transformers
def gpt2(layers: int = 48, embd: int = 128, seq: int = 16, vocab: int = 256, attention: str = "sdpa",
         heads: int = 4, positions: int = 64):
    """GPT-2 causal LM (48 layers, n_embd=128 by default); returns the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = _attention(
        GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=embd, n_layer=layers, n_head=heads), attention
    )
    return Logits(GPT2LMHeadModel(config)), (torch.randint(0, vocab, (1, seq)),)


class VisionLanguage(nn.Module):
    """A vision-language model's prefill: token ids with image placeholders, token types, pixels -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, token_type_ids, pixel_values):
        return self.model(
            input_ids=input_ids, token_type_ids=token_type_ids, pixel_values=pixel_values, use_cache=False
        ).logits


@_needs_transformers
def gemma3_vlm(image: int = 32, patch: int = 8, hidden: int = 64, layers: int = 2, text: int = 6, attention: str = "sdpa"):
    """Gemma 3 vision-language model (SigLIP tower, pooled projector, image-token merge, bidirectional image mask built with vmap)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    vision = _vision_config(SiglipVisionConfig, image, patch, hidden, 1, attention)
    text_config = Gemma3TextConfig(
        vocab_size=128,
        **_gemma_text_sizes(hidden, layers),
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"][:layers] + ["full_attention"] * (layers - 2),
    )
    image_tokens = 4
    config = _attention(
        Gemma3Config(
            text_config=text_config,
            vision_config=vision,
            mm_tokens_per_image=image_tokens,
            image_token_index=100,
            boi_token_index=101,
            eoi_token_index=102,
        ),
        attention,
    )
    model = Gemma3ForConditionalGeneration(config)
    prompt = [2, 101] + [100] * image_tokens + [102] + list(range(10, 10 + text))
    input_ids = torch.tensor([prompt])
    token_type_ids = (input_ids == 100).long()
    return VisionLanguage(model), (input_ids, token_type_ids, torch.randn(1, 3, image, image))


class ImageTextToText(nn.Module):
    """A vision-language model's prefill without token types: token ids with image placeholders, pixels -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, pixel_values):
        return self.model(input_ids=input_ids, pixel_values=pixel_values, use_cache=False).logits


@_needs_transformers
def smolvlm(image: int = 32, patch: int = 8, hidden: int = 64, layers: int = 2, text: int = 6, attention: str = "sdpa"):
    """SmolVLM image-text-to-text model (Idefics3 vision tower, pixel-shuffle connector, Llama decoder,
    image-token merge whose size checks export asserts through torch.sym_not / sym_ite)."""
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig

    vision = _vision_config(SmolVLMVisionConfig, image, patch, hidden, layers, attention)
    text_config = LlamaConfig(
        vocab_size=128, **_layer_sizes(hidden, layers), num_key_value_heads=2, max_position_embeddings=64
    )
    scale = 2
    config = SmolVLMConfig(
        vision_config=vision.to_dict(), text_config=text_config.to_dict(), image_token_id=100, scale_factor=scale
    )
    model = SmolVLMForConditionalGeneration(_attention(config, attention))
    image_tokens = (image // patch) ** 2 // scale**2
    input_ids = torch.tensor([[1] + [100] * image_tokens + list(range(10, 10 + text))])
    return ImageTextToText(model), (input_ids, torch.randn(1, 1, 3, image, image))


class SpeechToText(nn.Module):
    """An encoder-decoder speech model's forward: log-mel features and decoder token ids -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features, decoder_input_ids):
        return self.model(
            input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False
        ).logits


@_needs_transformers
def whisper(mels: int = 16, frames: int = 64, hidden: int = 64, layers: int = 2, vocab: int = 128, attention: str = "sdpa"):
    """Whisper speech encoder-decoder (conv front end, encoder, cross-attending decoder); returns the logits."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = _attention(
        WhisperConfig(
            vocab_size=vocab,
            num_mel_bins=mels,
            d_model=hidden,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=2 * hidden,
            decoder_ffn_dim=2 * hidden,
            max_source_positions=frames // 2,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
        attention,
    )
    model = WhisperForConditionalGeneration(config)
    return SpeechToText(model), (torch.randn(1, mels, frames), torch.tensor([[1, 5, 9, 13]]))


def _causal_lm(config_class, model_class, hidden: int, layers: int, seq: int, vocab: int, attention: str, **extra):
    """A `*ForCausalLM` of the Llama family's layout and its token ids; the module returns the logits."""
    config = _attention(
        config_class(vocab_size=vocab, **_layer_sizes(hidden, layers), max_position_embeddings=64, **extra), attention
    )
    return Logits(model_class(config)), (torch.randint(0, vocab, (1, seq)),)


@_needs_transformers
def qwen3(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """Qwen3 causal LM: grouped-query attention with RMS-normed queries and keys; returns the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _causal_lm(
        Qwen3Config, Qwen3ForCausalLM, hidden, layers, seq, vocab, attention, num_key_value_heads=2, head_dim=16
    )


@_needs_transformers
def phi3(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """Phi-3 causal LM: fused qkv and gate/up projections, partial rotary embedding; returns the logits."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _causal_lm(
        Phi3Config, Phi3ForCausalLM, hidden, layers, seq, vocab, attention,
        num_key_value_heads=4, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


@_needs_transformers
def mistral(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """Mistral causal LM: grouped-query attention under a sliding window shorter than the sequence; returns the logits."""
    from transformers import MistralConfig, MistralForCausalLM

    return _causal_lm(
        MistralConfig, MistralForCausalLM, hidden, layers, seq, vocab, attention,
        num_key_value_heads=2, head_dim=16, sliding_window=seq // 2,
    )


def _padded_batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two token-id rows and their attention mask, the second row padded at the end."""
    input_ids = torch.randint(3, vocab, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0
    return input_ids, mask


@_needs_transformers
def bert(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """BERT encoder on a padded batch (token ids, attention mask, token types); returns the hidden states and the pooled output."""
    from transformers import BertConfig, BertModel

    config = _attention(BertConfig(vocab_size=vocab, **_layer_sizes(hidden, layers), max_position_embeddings=64), attention)
    input_ids, mask = _padded_batch(vocab, seq)
    token_types = torch.zeros_like(input_ids)
    token_types[:, seq // 2:] = 1
    return Tensors(BertModel(config), "last_hidden_state", "pooler_output"), (input_ids, mask, token_types)


@_needs_transformers
def t5_encoder(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "eager"):
    """T5 encoder on a padded batch: relative position buckets, RMS norms, no biases, eager attention (T5's only); returns the hidden states."""
    from transformers import T5Config, T5EncoderModel

    config = _attention(
        T5Config(
            vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=layers, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
        ),
        attention,
    )
    return Tensors(T5EncoderModel(config), "last_hidden_state"), _padded_batch(vocab, seq)


@_needs_transformers
def clip_text(layers: int = 2, hidden: int = 64, seq: int = 8, vocab: int = 128, attention: str = "sdpa"):
    """CLIP text encoder: causal mask, quick-GELU, pooled at each row's end-of-text token; returns the hidden states and the pooled output."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = _attention(
        CLIPTextConfig(
            vocab_size=vocab, **_layer_sizes(hidden, layers), max_position_embeddings=seq,
            pad_token_id=1, bos_token_id=0, eos_token_id=2,
        ),
        attention,
    )
    input_ids = torch.randint(3, vocab, (2, seq))
    input_ids[0, -1] = input_ids[1, seq // 2] = 2  # each row's end-of-text token
    return Tensors(CLIPTextModel(config), "last_hidden_state", "pooler_output"), (input_ids,)


SUITE: dict[str, Callable] = {
    "llama_static_cache": llama_static_cache,
    "gemma": gemma,
    "siglip": siglip,
    "smolvlm_vision_uint8": smolvlm_vision_uint8,
    "gpt2": gpt2,
    "gemma3_vlm": gemma3_vlm,
    "smolvlm": smolvlm,
    "whisper": whisper,
    "qwen3": qwen3,
    "phi3": phi3,
    "mistral": mistral,
    "bert": bert,
    "t5_encoder": t5_encoder,
    "clip_text": clip_text,
}
