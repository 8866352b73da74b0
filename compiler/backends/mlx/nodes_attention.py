"""Node functions for the MLX payload's attention node types: SDPA, RoPE and the
off-graph KV cache's update-and-attend, with `mlx.core.fast` as the runtime does."""

from __future__ import annotations

import mlx.core as mx

from compiler.backends.mlx.interpreter import Interpreter, MLXNodeFailure, Tid, mx_dtype, node, to_mx, to_torch


@node("SdpaNode")
def _sdpa(it: Interpreter, f: dict) -> None:
    """A mask that is neither bool nor q's dtype is cast to q's dtype first, as the
    runtime does; a mask and `causal` together are refused, as mlx's SDPA refuses them."""
    q = it.t(f["q"])
    mask = it.t(f["mask"])
    if mask is not None and f["causal"]:
        raise MLXNodeFailure("scaled_dot_product_attention: no array mask may be passed with mask_mode 'causal'")
    if mask is not None and mask.dtype not in (mx.bool_, q.dtype):
        mask = mask.astype(q.dtype)
    if f["causal"]:
        mask = "causal"
    out = mx.fast.scaled_dot_product_attention(q, it.t(f["k"]), it.t(f["v"]), scale=f["scale"], mask=mask)
    it.set(f["out"], out)


@node("RopeNode")
def _rope(it: Interpreter, f: dict) -> None:
    """mlx::fast::rope takes exactly one of base and freqs; the offset is a scalar
    (Vid) or a tensor of positions (Tid)."""
    freqs = it.t(f["freqs"])
    offset = f["offset"]
    offset = it.t(offset) if isinstance(offset, Tid) else int(it.v(offset))
    out = mx.fast.rope(
        it.t(f["x"]),
        f["dims"],
        traditional=bool(f["traditional"]),
        base=None if freqs is not None else f["base"],
        scale=f["scale"],
        offset=offset,
        freqs=freqs,
    )
    it.set(f["out"], out)


def _mask(spec) -> str | mx.array | None:
    """The cache's AttendSpec as MLX's SDPA mask: none, "causal", or a bool tensor (true = attend)."""
    kind = str(getattr(spec.kind, "value", spec.kind)).lower()
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if spec.mask is None:
        raise MLXNodeFailure("update_and_attend: Explicit mask kind with no mask tensor")
    return to_mx(spec.mask)


@node("UpdateAndAttendNode")
def _update_and_attend(it: Interpreter, f: dict) -> None:
    """The cache writes this step's K/V and returns the window to attend over and how
    to mask it; the node casts K/V to q's dtype, runs SDPA and casts to out_dtype.
    Without a cache the runtime fails the same way: the runner must install one."""
    if it.kv_cache is None:
        raise MLXNodeFailure(
            "update_and_attend: no cache installed",
            nodes=["UpdateAndAttendNode"],
            hint="the MLX runtime takes the off-graph KV cache from the runner; here pass one to "
            "ReferenceExecutor(pte, kv_cache=...) (e.g. an ExecuTorch ContiguousReferenceCache)",
        )
    if f["layer_id"] is None or f["scale"] is None:
        raise MLXNodeFailure("update_and_attend: layer_id or scale is not set in the payload")
    q, position = it.t(f["q"]), it.t(f["position"])
    if position.dtype not in (mx.int32, mx.int64):
        raise MLXNodeFailure(f"update_and_attend: position must be int32 or int64, got {position.dtype}")
    k_hist, v_hist, spec = it.kv_cache.update_and_fetch(
        f["layer_id"], to_torch(it.t(f["k"])), to_torch(it.t(f["v"])), to_torch(position)
    )
    keys, values = to_mx(k_hist).astype(q.dtype), to_mx(v_hist).astype(q.dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=f["scale"], mask=_mask(spec))
    if f["out_dtype"] is not None:
        out = out.astype(mx_dtype(f["out_dtype"]))
    it.set(f["out"], out)
