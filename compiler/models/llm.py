"""Hugging Face causal LMs as ExecuTorch text-generation programs: the decoder step, its
metadata and a tokenizer, in the conventions of ExecuTorch's `TextLLMRunner`.

The runner calls one method, `forward(tokens[1, seq], input_pos)`, and reads its settings
from constant methods of the `.pte` (`get_max_seq_len`, `get_eos_ids`, `use_kv_cache`, ...):
`TextModel.constant_methods` gives them as the emit stage's option. Its tokenizer is a
`tokenizer.json` it loads with its own HFTokenizer (C++), which takes only part of Hugging
Face's format: `tokenizer()` makes one from the vocabulary size and the special ids alone, so a
model from a config with random weights needs nothing downloaded. Needs the `models` extra.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.models.model_suite import DecoderStep

# The special tokens' ids of the built-in configs (Gemma's order); a local model keeps its own.
PAD, EOS, BOS = 0, 1, 2


def _llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(vocab_size=vocab, num_key_value_heads=2, **_sizes())


def _qwen3(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(vocab_size=vocab, num_key_value_heads=2, head_dim=16, **_sizes())


def _gemma(vocab: int):
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM, GemmaConfig(
        vocab_size=vocab, num_key_value_heads=1, head_dim=16, hidden_activation="gelu_pytorch_tanh", **_sizes()
    )


def _sizes() -> dict:
    """What the tiny built-in LMs share: two blocks of width 64, four heads, room for 256 positions."""
    return dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )


# Built-in tiny LMs (random weights, from configs): name -> (vocab -> (model class, config)).
BUILT_IN = {"llama": _llama, "qwen3": _qwen3, "gemma": _gemma}


def eos_ids_metadata(eos: Sequence[int]) -> str:
    """`get_eos_ids` as emit_constant_methods takes it (one id keeps its comma: a list, not an int)."""
    return "get_eos_ids=" + ",".join(map(str, eos)) + ("," if len(eos) == 1 else "")


def runner_metadata(max_cache_len: int, vocab: int, bos: int, eos: Sequence[int], dynamic: bool) -> tuple[str, ...]:
    """The metadata ExecuTorch's LLM runners read (llm_runner_helper.cpp), as emit_constant_methods.
    A call's sequence and the whole context are both bounded by the cache (a shorter
    get_max_seq_len would make the runner treat the cache as a sliding window)."""
    return (
        f"get_max_seq_len={max_cache_len}",
        f"get_max_context_len={max_cache_len}",
        f"get_vocab_size={vocab}",
        f"get_bos_id={bos}",
        eos_ids_metadata(eos),
        "use_kv_cache=true",
        f"enable_dynamic_shape={str(dynamic).lower()}",
        "use_sdpa_with_kv_cache=false",
    )


def restore_state(module: torch.nn.Module, initial_state: Mapping[str, torch.Tensor]) -> None:
    """Put the module's buffers back to the state it was built with (an empty KV cache)."""
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in initial_state.items():
            buffers[name].copy_(value)


@attrs.frozen
class TextModel:
    """A causal LM made ready for the runner: the decoder step to compile and what the runner
    needs to know about it."""

    name: str
    hf_model: Any  # the transformers model (eager `generate` is its reference)
    step: DecoderStep  # forward(tokens[1, seq], input_pos[seq]) -> logits[1, seq, vocab]; holds the KV cache
    vocab: int
    max_cache_len: int
    bos: int
    eos: tuple[int, ...]
    pad: int | None
    initial_state: dict[str, torch.Tensor]  # the step's buffers as built: the cache before any token
    # Whether a call takes any number of tokens (the runner then prefills a prompt in one call),
    # else one (it prefills token by token).
    dynamic_prefill: bool = False

    @property
    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dynamic_prefill:  # two tokens: an example of one would fix the sequence at 1
            return torch.tensor([[self.bos, self.bos]]), torch.tensor([0, 1])
        return torch.tensor([[self.bos]]), torch.tensor([0])

    @property
    def dynamic_shapes(self) -> tuple[dict, dict] | None:
        """The tokens' and positions' shared sequence length, up to the whole cache, with dynamic prefill."""
        if not self.dynamic_prefill:
            return None
        seq = torch.export.Dim("seq", min=1, max=self.max_cache_len)
        return {1: seq}, {0: seq}

    @property
    def constant_methods(self) -> tuple[str, ...]:
        return runner_metadata(self.max_cache_len, self.vocab, self.bos, self.eos, self.dynamic_prefill)

    def reset(self) -> None:
        """Empty the KV cache: each generation, and the compile's capture, start from the model as built."""
        restore_state(self.step, self.initial_state)


def _from_folder(folder: str, dtype: torch.dtype):
    """A local `save_pretrained` folder: its weights when it has them, else its config's random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    has_weights = any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))
    if has_weights:
        from compiler.models.checkpoint import read_whole
        from compiler.models.mapped_checkpoint import mapped_model

        mapped = mapped_model(AutoModelForCausalLM, folder, config, dtype)
        return mapped if mapped is not None else read_whole(AutoModelForCausalLM, folder, dtype, config=config)
    return AutoModelForCausalLM.from_config(config)


def _special(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def text_model(
    model: Any, max_cache_len: int = 64, vocab: int = 256, seed: int = 0, dynamic_prefill: bool = False,
    dtype: torch.dtype | None = None,
) -> TextModel:
    """`model`: a built-in name (llama, qwen3, gemma: tiny, random weights drawn with `seed`), a local
    `save_pretrained` folder (its weights read as `dtype`, by default the checkpoint's own: a bfloat16
    checkpoint is not doubled into float32 before the compile decides what each backend computes in),
    a transformers config (random weights drawn with `seed`) or `*ForCausalLM`."""
    try:
        from transformers import GenerationConfig, PretrainedConfig
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM
    except ImportError as exc:
        raise UserInputError(
            "text generation needs Hugging Face transformers, which is not installed", hint="pip install -e '.[models]'"
        ) from exc
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if isinstance(model, str) and model in BUILT_IN:
            name = model
            model_class, config = BUILT_IN[model](vocab)
            config._attn_implementation = "sdpa"
            hf_model = model_class(config)
        elif isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
            from compiler.models.checkpoint import checkpoint_dtype

            folder = os.fspath(model)
            name, hf_model = os.path.basename(os.path.normpath(model)), _from_folder(folder, dtype or checkpoint_dtype(folder))
        elif isinstance(model, torch.nn.Module) and hasattr(model, "generation_config"):
            name, hf_model = type(model).__name__, model
        elif isinstance(model, PretrainedConfig):
            from transformers import AutoModelForCausalLM

            name, hf_model = model.model_type, AutoModelForCausalLM.from_config(model)
        else:
            raise UserInputError(
                f"{model!r} is neither a built-in language model nor a save_pretrained folder",
                hint=f"give one of {', '.join(BUILT_IN)}, a folder holding config.json, a transformers config or "
                "*ForCausalLM",
            )
    hf_model.eval()
    config = hf_model.config.get_text_config()
    bos, eos = _special(config.bos_token_id), _special(config.eos_token_id)
    if len(bos) != 1 or not eos:
        raise UserInputError(
            f"the model's config names no single BOS id ({config.bos_token_id!r}) or no EOS id ({config.eos_token_id!r})",
            hint="set bos_token_id and eos_token_id in its config.json: the runner starts with BOS and stops at EOS",
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_cache_len > limit:
        raise UserInputError(
            f"a cache of {max_cache_len} positions is longer than the model's {limit} positions",
            hint=f"give a cache length of at most {limit}",
        )
    hf_model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", bos_token_id=bos[0], eos_token_id=list(eos),
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else eos[0],
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    step = DecoderStep(TorchExportableModuleForDecoderOnlyLM(hf_model, batch_size=1, max_cache_len=max_cache_len)).eval()
    initial = {name: buffer.clone() for name, buffer in step.named_buffers()}
    return TextModel(
        name, hf_model, step, config.vocab_size, max_cache_len, bos[0], eos, config.pad_token_id, initial,
        dynamic_prefill,
    )


def piece(token: int) -> str:
    """The text of an ordinary token: unique, printable, without spaces (the runner's tokenizer
    splits a prompt at spaces and looks each piece up whole)."""
    return f"t{token}"


def special_names(model: TextModel) -> dict[int, str]:
    """Names the runner's HFTokenizer recognises: it finds BOS and EOS among the special tokens by
    'bos' and 'eos' in their names when no tokenizer_config.json says which they are."""
    names = {model.bos: "<bos>"}
    for index, eos in enumerate(model.eos):
        names.setdefault(eos, "<eos>" if index == 0 else f"<eos{index}>")
    if model.pad is not None:
        names.setdefault(model.pad, "<pad>")
    return names


def tokenizer(model: TextModel):
    """A `tokenizers.Tokenizer` over the model's whole vocabulary, in the subset of the format
    the runner's C++ HFTokenizer reads: a BPE model without merges that looks each piece up
    whole (`ignore_merges`; the C++ one needs a `merges` list, which WordLevel lacks), a split at
    spaces (it has no WhitespaceSplit), and BOS added by a template when the runner asks for it
    (`num_bos`)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    specials = special_names(model)
    vocab = {specials.get(token, piece(token)): token for token in range(model.vocab)}
    made = Tokenizer(models.BPE(vocab, merges=[], ignore_merges=True))
    made.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    made.add_special_tokens([AddedToken(name, special=True) for name in specials.values()])
    bos = specials[model.bos]
    made.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, model.bos)])
    return made


def prompt_text(tokens: list[int]) -> str:
    """The prompt whose pieces are these ordinary tokens."""
    return " ".join(piece(token) for token in tokens)
