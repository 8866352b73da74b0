"""A LLaVA-style vision-language model as a program of three methods, in the conventions of
ExecuTorch's `MultimodalRunner` (extension/llm/runner/multimodal_prefiller.cpp,
multimodal_decoder_runner.h): `vision_encoder(image[1, 3, H, W])` -> image token embeddings
[1, n, hidden], `token_embedding(tokens[1, seq])` -> embeddings [1, seq, hidden], and
`text_decoder(embeddings[1, seq, hidden], cache_position[seq])` -> logits[1, seq, vocab].

The runner prefills each input (BOS, the image, the prompt's text) in one `text_decoder` call of
its whole length, so embeddings and positions share one dynamic length; it then decodes token by
token through `token_embedding` and `text_decoder`. Only `text_decoder` holds the KV cache, so a
delegate may own it (the encoders' module shares the weights, not the cache). Needs the `models` extra.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.models import llm, llm_ops

# The methods MultimodalRunner calls (extension/llm/runner/constants.h).
METHODS = ("vision_encoder", "token_embedding", "text_decoder")
# The image placeholder's id in the built-in config: transformers' own forward puts the image's
# embeddings where these stand (the runner needs no placeholder: it prefills the image itself).
IMAGE = 3
IMAGE_SIZE, PATCH = 32, 8


def llava_config(vocab: int = 256):
    """The built-in tiny LLaVA: a two-layer CLIP tower over 32x32 images in 8x8 patches (16 image
    tokens, the class token dropped), a two-layer MLP projector, the tiny Llama of `llm`."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=64,
    )
    text = LlamaConfig(vocab_size=vocab, num_key_value_heads=2, **llm._sizes())
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE, vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    for sub in (config.vision_config, config.text_config):
        sub._attn_implementation = "sdpa"
    return config


class Encoders(torch.nn.Module):
    """`vision_encoder` and `token_embedding`: LLaVA's vision tower, projector and token embeddings,
    without the language model (each method's capture lifts every buffer of its module: the KV
    cache must not be among these methods' inputs, or a delegate holding it would make it two)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.vision_tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.embed_tokens = model.get_input_embeddings()
        config = model.config
        self.layer, self.drop_class = config.vision_feature_layer, config.vision_feature_select_strategy == "default"

    def vision_encoder(self, image: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(image, output_hidden_states=True).hidden_states[self.layer]
        return self.projector(states[:, 1:] if self.drop_class else states)

    def token_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class TextDecoder(torch.nn.Module):
    """`text_decoder`: LLaVA's language model and head as a causal LM over a static KV cache."""

    def __init__(self, model: Any, max_cache_len: int) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        with torch.device("meta"):  # a shell: its parts are the VLM's own
            language = LlamaForCausalLM(model.config.text_config)
        language.model, language.lm_head = model.model.language_model, model.lm_head
        language.generation_config = model.generation_config
        self.exportable = TorchExportableModuleWithStaticCache(language, batch_size=1, max_cache_len=max_cache_len)

    def text_decoder(self, embeddings: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """The exportable module's forward, with the positions given: not derived from the cache's
        length, which a backend's own cache (`llm_ops`) may count otherwise."""
        cache = self.exportable.static_cache
        for layer in cache.layers:
            layer.cumulative_length.copy_(cache_position[0:1])
        positions = cache_position[0] + torch.arange(embeddings.shape[1])
        out = self.exportable.model(
            inputs_embeds=embeddings, past_key_values=cache, use_cache=True, cache_position=positions,
            position_ids=positions.unsqueeze(0),
        )
        return out.logits


class VisionLanguageMethods(torch.nn.Module):
    """The runner's three methods over one LLaVA model: the encoders' and the decoder's."""

    def __init__(self, model: Any, max_cache_len: int, ops: llm_ops.BackendOps | None = None) -> None:
        super().__init__()
        self.encoders = Encoders(model)
        self.decoder = TextDecoder(model, max_cache_len)
        if ops is not None:
            ops.rewrite(self.decoder.exportable.model, self.decoder.exportable, max_cache_len)

    @property
    def methods(self) -> dict[str, Any]:
        return {
            "vision_encoder": self.encoders.vision_encoder, "token_embedding": self.encoders.token_embedding,
            "text_decoder": self.decoder.text_decoder,
        }

    def vision_encoder(self, image: torch.Tensor) -> torch.Tensor:
        return self.encoders.vision_encoder(image)

    def token_embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoders.token_embedding(tokens)

    def text_decoder(self, embeddings: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.decoder.text_decoder(embeddings, cache_position)


@attrs.frozen
class VisionLanguageModel:
    """A LLaVA model made ready for MultimodalRunner: its methods and what the check needs."""

    name: str
    hf_model: Any
    methods: VisionLanguageMethods
    vocab: int
    max_cache_len: int
    bos: int
    eos: tuple[int, ...]
    pad: int | None
    image: torch.Tensor  # an example image [1, 3, H, W], already normalised
    image_tokens: int  # embeddings the vision encoder makes of one image
    initial_state: dict[str, torch.Tensor]

    @property
    def method_inputs(self) -> dict[str, tuple]:
        return self.inputs_of(self.methods)

    def inputs_of(self, methods: VisionLanguageMethods) -> dict[str, tuple]:
        """`compile_methods`' methods with example inputs; token_embedding and text_decoder take any
        length up to the cache (two tokens as the example: one would fix it at 1)."""
        seq = torch.export.Dim("seq", min=1, max=self.max_cache_len)
        tokens = torch.export.Dim("tokens", min=1, max=self.max_cache_len)
        hidden = self.hf_model.config.text_config.hidden_size
        bound = methods.methods
        return {
            "vision_encoder": (bound["vision_encoder"], (self.image,)),
            "token_embedding": (bound["token_embedding"], (torch.tensor([[self.bos, self.bos]]),), ({1: tokens},)),
            "text_decoder": (
                bound["text_decoder"], (torch.zeros(1, 2, hidden), torch.tensor([0, 1])), ({1: seq}, {0: seq})
            ),
        }

    def rewritten(self, ops: llm_ops.BackendOps) -> VisionLanguageMethods:
        """The methods of a copy of the model whose decoder calls the backend's LLM ops, its cache empty
        (the eager model stays as given: the check compares the program with it)."""
        return VisionLanguageMethods(copy.deepcopy(self.hf_model), self.max_cache_len, ops).eval()

    @property
    def constant_methods(self) -> tuple[str, ...]:
        """The metadata the runner reads (llm_runner_helper.cpp); BOS and the vocabulary it takes
        from the tokenizer."""
        return llm.runner_metadata(self.max_cache_len, self.vocab, self.bos, self.eos, dynamic=True)

    def reset(self) -> None:
        """Empty the KV cache: each generation, and the compile's capture, start from the model as built."""
        llm.restore_state(self.methods, self.initial_state)


def vision_language_model(max_cache_len: int = 64, vocab: int = 256, seed: int = 0) -> VisionLanguageModel:
    """The built-in tiny LLaVA (random weights drawn with `seed`) and an image drawn with it."""
    try:
        from transformers import GenerationConfig, LlavaForConditionalGeneration
    except ImportError as exc:
        raise UserInputError(
            "the vision-language model needs Hugging Face transformers, which is not installed",
            hint="pip install -e '.[models]'",
        ) from exc
    config = llava_config(vocab)
    limit = config.text_config.max_position_embeddings
    if max_cache_len > limit:
        raise UserInputError(
            f"a cache of {max_cache_len} positions is longer than the model's {limit} positions",
            hint=f"give a cache length of at most {limit}",
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf_model = LlavaForConditionalGeneration(config).eval()
        image = torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE)
    hf_model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", bos_token_id=llm.BOS, eos_token_id=[llm.EOS],
        pad_token_id=llm.PAD, cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    methods = VisionLanguageMethods(hf_model, max_cache_len).eval()
    initial = {name: buffer.clone() for name, buffer in methods.named_buffers()}
    return VisionLanguageModel(
        "llava", hf_model, methods, vocab, max_cache_len, llm.BOS, (llm.EOS,), llm.PAD, image,
        (IMAGE_SIZE // PATCH) ** 2, initial,
    )
