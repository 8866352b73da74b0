"""A Whisper-style encoder-decoder as a program of two methods, in the conventions of ExecuTorch's
ASR runner (extension/asr/runner/seq2seq_runner.cpp): `encoder(features)` -> the encoder's states,
and `text_decoder(tokens[1, 1], encoder_output, cache_position[1])` -> logits[1, 1, vocab].

Both methods are methods of one module, so the state they share is one buffer in the program:
`encoder` fills each decoder layer's cross-attention keys and values, which `text_decoder` reads
on every step (so it does not project the encoder's states again); `text_decoder` alone writes the
self-attention KV cache. Needs the `models` extra.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.models import llm

# The methods ExecuTorch's ASR runner calls.
METHODS = ("encoder", "text_decoder")
# Special ids of the built-in config (random weights): the decoder starts at START and stops at EOS.
PAD, EOS, START = 0, 1, 2


def whisper_config(vocab: int = 256):
    """The built-in tiny Whisper: two encoder and two decoder layers of width 64, 80 mel bins,
    16 encoder positions (32 feature frames), 64 decoder positions."""
    from transformers import WhisperConfig

    return WhisperConfig(
        vocab_size=vocab, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=16, max_target_positions=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=START,
        decoder_start_token_id=START, begin_suppress_tokens=None, suppress_tokens=None,
        tie_word_embeddings=False,  # tied, random weights make every step repeat its input token
    )


class WhisperMethods(torch.nn.Module):
    """The encoder and the decoder step of a Whisper model, with the caches as buffers."""

    def __init__(self, model: Any, max_cache_len: int) -> None:
        super().__init__()
        from transformers.cache_utils import EncoderDecoderCache, StaticCache

        self.model = model
        config = model.config
        heads, layers = config.decoder_attention_heads, config.decoder_layers
        self.head_dim = config.d_model // heads
        frames = config.max_source_positions
        self_attention = StaticCache(config=config, max_cache_len=max_cache_len)
        cross_attention = StaticCache(config=config, max_cache_len=frames)
        for cache in (self_attention, cross_attention):
            cache.early_initialization(1, heads, self.head_dim, torch.float32, torch.device("cpu"))
        for index in range(layers):
            for kind, cache in (("self", self_attention), ("cross", cross_attention)):
                layer = cache.layers[index]
                self.register_buffer(f"{kind}_keys_{index}", layer.keys, persistent=False)
                self.register_buffer(f"{kind}_values_{index}", layer.values, persistent=False)
                self.register_buffer(f"{kind}_length_{index}", layer.cumulative_length, persistent=False)
        self.cache = EncoderDecoderCache(self_attention, cross_attention)

    def encoder(self, features: torch.Tensor) -> torch.Tensor:
        states = self.model.model.encoder(features).last_hidden_state
        for index, layer in enumerate(self.model.model.decoder.layers):
            attention = layer.encoder_attn
            shape = (1, -1, attention.num_heads, self.head_dim)
            cross = self.cache.cross_attention_cache.layers[index]
            cross.keys.copy_(attention.k_proj(states).view(shape).transpose(1, 2))
            cross.values.copy_(attention.v_proj(states).view(shape).transpose(1, 2))
        return states

    def text_decoder(self, tokens: torch.Tensor, encoder_output: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.cache.self_attention_cache.layers):
            layer.cumulative_length.copy_(cache_position[0:1])
            self.cache.is_updated[index] = True  # cross-attention reads what `encoder` stored
        out = self.model.model.decoder(
            input_ids=tokens, encoder_hidden_states=encoder_output, past_key_values=self.cache,
            cache_position=cache_position, use_cache=True,
        )
        return self.model.proj_out(out.last_hidden_state)


@attrs.frozen
class SpeechModel:
    """A Whisper model made ready for the ASR runner: its two methods and what the check needs."""

    name: str
    hf_model: Any
    methods: WhisperMethods
    vocab: int
    max_cache_len: int
    start: int  # decoder_start_token_id
    eos: tuple[int, ...]
    features: torch.Tensor  # example log-mel features [1, mel bins, frames]
    initial_state: dict[str, torch.Tensor]

    @property
    def method_inputs(self) -> dict[str, tuple]:
        """`compile_methods`' methods: each with its example inputs."""
        encoder_output = torch.zeros(1, self.hf_model.config.max_source_positions, self.hf_model.config.d_model)
        return {
            "encoder": (self.methods.encoder, (self.features,)),
            "text_decoder": (
                self.methods.text_decoder, (torch.tensor([[self.start]]), encoder_output, torch.tensor([0]))
            ),
        }

    @property
    def constant_methods(self) -> tuple[str, ...]:
        return (
            f"get_max_seq_len={self.max_cache_len}", f"get_vocab_size={self.vocab}",
            llm.eos_ids_metadata(self.eos),
            f"decoder_start_token_id={self.start}",
        )

    def reset(self) -> None:
        """Empty both caches: each transcription, and the compile's capture, start from the model as built."""
        llm.restore_state(self.methods, self.initial_state)


def speech_model(max_cache_len: int = 64, vocab: int = 256, seed: int = 0) -> SpeechModel:
    """The built-in tiny Whisper (random weights drawn with `seed`) and features drawn with it."""
    try:
        from transformers import WhisperForConditionalGeneration
    except ImportError as exc:
        raise UserInputError(
            "the Whisper model needs Hugging Face transformers, which is not installed", hint="pip install -e '.[models]'"
        ) from exc
    config = whisper_config(vocab)
    if max_cache_len > config.max_target_positions:
        raise UserInputError(
            f"a cache of {max_cache_len} positions is longer than the decoder's {config.max_target_positions}",
            hint=f"give a cache length of at most {config.max_target_positions}",
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config._attn_implementation = "sdpa"
        hf_model = WhisperForConditionalGeneration(config).eval()
        features = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions)
    methods = WhisperMethods(hf_model, max_cache_len).eval()
    initial = {name: buffer.clone() for name, buffer in methods.named_buffers()}
    return SpeechModel("whisper", hf_model, methods, vocab, max_cache_len, START, (EOS,), features, initial)
