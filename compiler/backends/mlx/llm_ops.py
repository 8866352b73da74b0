"""MLX's own LLM ops: `mlx::kv_cache_update` and `mlx::custom_sdpa`, which its payload handlers
lower to a SliceUpdate of the cache and Slice + SDPA nodes (the cache and attention of
ExecuTorch's `backends/mlx/llm`, installed as its LLM export does)."""

from __future__ import annotations

from compiler.models.llm_ops import BackendOps, count_cache_writes

# The attention implementation name ExecuTorch's `register_mlx_attention` registers with transformers.
MLX_ATTENTION = "mlx"


def _rewrite_mlx(hf_model, exportable, cache_len: int) -> None:
    from executorch.backends.mlx.llm.hf_attention import register_mlx_attention
    from executorch.backends.mlx.llm.source_transformation import replace_hf_cache_with_mlx

    register_mlx_attention(MLX_ATTENTION)
    hf_model.config._attn_implementation = MLX_ATTENTION
    dtype = exportable.static_cache.layers[0].keys.dtype
    replace_hf_cache_with_mlx(exportable, hf_model.config, max_batch_size=1, max_cache_len=cache_len, dtype=dtype)
    count_cache_writes(exportable.static_cache)



MLX = BackendOps("mlx", ("kv_cache_update", "custom_sdpa"), _rewrite_mlx)
