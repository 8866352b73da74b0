"""The backends' own LLM ops in a text model's decoder step: the attention and the KV-cache
update rewritten, before capture, into the custom ops a backend's runtime has a kernel for,
as ExecuTorch's own LLM exports do.

- `llama`: ExecuTorch's `llama::update_cache` and `llama::custom_sdpa` (the CPU kernels of
  `extension/llm/custom_ops`, which the portable and XNNPACK programs call on the CPU). The cache
  is kept as [batch, positions, kv heads, head dim], the ops' layout, and written in place at the
  call's first position; the attention reads the cache up to the call's last position with a
  causal mask, and repeats kv heads itself.
- a backend's own (MLX's `mlx::kv_cache_update` and `mlx::custom_sdpa`: `compiler.backends.mlx.llm_ops`),
  a `BackendOps` its package defines.

Which backend calls which is its `Backend.llm_ops` (with `no_llm_ops`, why it has none).

The eager model is not touched: the rewritten step is built on a copy, so the check still
compares the program with the model as given.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import attrs
import torch

from compiler.ir.errors import UserInputError
from compiler.models import llm
from compiler.models.model_suite import DecoderStep

# The attention implementation name registered with transformers for the rewritten step.
LLAMA_ATTENTION = "staged_compiler_llama_ops"


@attrs.frozen
class BackendOps:
    """One backend's LLM ops: what they are, and how a decoder step is rewritten to call them."""

    name: str
    ops: tuple[str, ...]
    rewrite: Callable[[Any, Any, int], None]  # (hf model copy, TorchExportableModuleWithStaticCache, cache length)

    def describe(self) -> str:
        return f"{self.name}:: ops ({', '.join(self.ops)})"


def _start(position: torch.Tensor, length: int, cache: int) -> Any:
    """The call's first position as a number export keeps symbolic, bounded so the ops' shape checks hold."""
    start = position.reshape(-1)[0].item()
    torch._check(start >= 0)
    torch._check(start + length <= cache)
    return start


def _llama_ops_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """A static cache layer whose cache is in the llama ops' layout, written by `llama::update_cache`
    at the position the exportable module sets in `cumulative_length` before each call."""
    from transformers.cache_utils import StaticLayer

    class LlamaOpsLayer(StaticLayer):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            start = _start(self.cumulative_length, key_states.shape[2], self.keys.shape[1])
            torch.ops.llama.update_cache(key_states.transpose(1, 2), self.keys, start)
            torch.ops.llama.update_cache(value_states.transpose(1, 2), self.values, start)
            self.cumulative_length.add_(key_states.shape[2])  # see _counted
            return self.keys, self.values

    made = LlamaOpsLayer.__new__(LlamaOpsLayer)
    made.__dict__.update(layer.__dict__, keys=keys, values=values)
    return made


def _llama_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention over the whole llama-layout cache: `llama::custom_sdpa` masks causally from
    the call's first position (the mask transformers would build is not made: see `_no_mask`)."""
    if dropout:
        raise ValueError("llama::custom_sdpa has no dropout")
    position = kwargs.get("position_ids")
    if position is None:
        raise ValueError("llama::custom_sdpa needs position_ids for the call's first position")
    start = _start(position, query.shape[2], key.shape[1])
    out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, start, None, 0.0, True, scaling)
    return out, None


def _no_mask(*args, **kwargs) -> None:
    """The custom attention masks itself; a mask tensor would be traced at one size."""
    return None


def _register(name: str, attention: Callable) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, _no_mask)


def _rewrite_llama(hf_model, exportable, cache_len: int) -> None:
    from compiler.ir.kernels import load_llm_kernels

    load_llm_kernels()
    _register(LLAMA_ATTENTION, _llama_attention)
    hf_model.config._attn_implementation = LLAMA_ATTENTION
    cache = exportable.static_cache
    for index, layer in enumerate(cache.layers):
        batch, heads, positions, dim = layer.keys.shape
        keys = torch.zeros(batch, positions, heads, dim, dtype=layer.keys.dtype)
        values = torch.zeros_like(keys)
        cache.layers[index] = _llama_ops_layer(layer, keys, values)
        setattr(exportable, f"key_cache_{index}", keys)
        setattr(exportable, f"value_cache_{index}", values)


def count_cache_writes(cache: Any) -> None:
    """Each layer's update adds the tokens it wrote to its `cumulative_length`, as transformers'
    StaticLayer does. A length the call only sets is a buffer whose new value is a one-token call's
    no-op slice of `cache_position`, which the Edge passes make the input itself, and the program
    fails validation ("User output cache_position is not in the correct order")."""
    update = cache.update

    def counting(key_states, value_states, layer_idx, cache_kwargs=None):
        written = update(key_states, value_states, layer_idx, cache_kwargs)
        cache.layers[layer_idx].cumulative_length.add_(key_states.shape[2])
        return written

    cache.update = counting


LLAMA = BackendOps("llama", ("update_cache", "custom_sdpa"), _rewrite_llama)


def register_ops() -> None:
    """Make torch know every op set here (a stage file that calls them is read only then: else its
    nodes deserialize as stand-ins the verifier refuses): ExecuTorch's LLM custom-ops library, with
    its runtime kernels, and MLX's op definitions."""
    from compiler.ir.kernels import load_llm_kernels

    load_llm_kernels()
    try:
        import executorch.backends.mlx.custom_ops  # noqa: F401
    except ImportError:  # an ExecuTorch without the MLX backend: no program here calls its ops
        pass


def _hybrid_cache(model: llm.TextModel | None) -> bool:
    """Whether transformers exports the model with its hybrid (sliding-window) cache, as
    TorchExportableModuleForDecoderOnlyLM decides: the rewrites replace a static cache only."""
    if model is None:
        return False
    config = model.hf_model.config.get_text_config()
    return hasattr(config, "layer_types") and getattr(config, "sliding_window", None) is not None


def choose(
    backend_class: Any, wanted: bool | None, model: llm.TextModel | None = None
) -> tuple[BackendOps | None, str]:
    """The ops a generation program of the backend (its `Backend` class) calls, and why: the
    backend's own when it has them, the model's cache is one they replace, and they are not
    turned off (`wanted=False`); `wanted=True` where they do not apply is an error."""
    backend, ops = backend_class.name, backend_class.llm_ops
    if ops is not None and _hybrid_cache(model):
        ops, why = None, (
            f"the model has sliding-window layers, exported with transformers' hybrid cache, which the "
            f"{backend} LLM ops' rewrite (of a static cache) does not cover"
        )
    elif ops is None:
        why = backend_class.no_llm_ops or f"{backend} has no LLM ops of its own"
    if ops is None:
        if wanted:
            raise UserInputError(f"backend LLM ops asked for on {backend}: {why}", hint="leave them off here")
        return None, f"plain attention and cache update: {why}"
    if wanted is False:
        return None, f"plain attention and cache update: the backend's {ops.describe()} turned off"
    return ops, (f"{ops.describe()}: {backend} has kernels for them ({backend_class.llm_ops_where}), replacing the "
                 "cache's index_copy and SDPA")


def rewritten_step(model: llm.TextModel, ops: BackendOps) -> DecoderStep:
    """A decoder step of a copy of the model that calls `ops`, its caches empty."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    hf_model = copy.deepcopy(model.hf_model)
    exportable = TorchExportableModuleForDecoderOnlyLM(hf_model, batch_size=1, max_cache_len=model.max_cache_len)
    ops.rewrite(hf_model, exportable.model, model.max_cache_len)
    return DecoderStep(exportable).eval()
