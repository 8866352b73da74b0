"""TorchAO's quantization of a model whose weights are mapped files, a piece at a time.

`quantize_` over a whole model makes every quantized weight at once, in memory: an 8B model's
4-bit codes, held as TorchAO holds them (a byte a weight), are 7 GB. For a mapped model
(`compiler.models.mapped_checkpoint`) the layers are quantized in chunks of about `CHUNK_BYTES`
of weights; each chunk's codes and scales are written to a mapped file before the next is made,
and what the chunk read of the checkpoint is dropped. A layer larger than a chunk (an
embedding table, an lm_head: 1 GB in bfloat16 at 8B) is quantized a block of rows at a time
where its scheme's groups lie within a row, each block's codes written into their place in
one file; TorchAO's float32 temporaries are then a block's, not the table's. The result is
equal, byte for byte, to quantizing the whole model at once.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterable

import torch

from compiler.ir.mapped import SPILL_TENSOR_BYTES, RowsFile, is_mapped, release_mapped_pages, spilled

logger = logging.getLogger(__name__)

# Layers are quantized in chunks of about this many bytes of weights; a larger one in blocks of
# rows of about `ROWS_BYTES` (TorchAO's temporaries are several float32 copies of what it quantizes).
CHUNK_BYTES = 64 << 20
ROWS_BYTES = 32 << 20


def quantize_layers(module: torch.nn.Module, config: Any, fqns: list[str]) -> None:
    """TorchAO's `config` on the layers `fqns` names, their quantized weights left as plain
    tensors (parametrized), as ExecuTorch's recipes leave them: capture then lifts ordinary
    constants, which the stage cache and stage files can hash and save."""
    from torchao.quantization import quantize_
    from torchao.utils import unwrap_tensor_subclass

    layers = dict(module.named_modules())
    mapped = any(is_mapped(layers[fqn].weight) for fqn in fqns)
    # A model held in memory gains nothing from chunks: one pass, as TorchAO does it.
    for chunk in _chunks(fqns, layers) if mapped else [fqns] if fqns else []:
        whole = [fqn for fqn in chunk if not _by_rows(layers[fqn], config)]
        if whole:
            chosen = frozenset(whole)
            quantize_(module, config, filter_fn=lambda layer, fqn: fqn in chosen)
        unwrap_tensor_subclass(module)
        if mapped:
            _spill_new_tensors(layers[fqn] for fqn in chunk)
            release_mapped_pages()


def _chunks(fqns: list[str], layers: dict[str, torch.nn.Module]) -> list[list[str]]:
    """The layers in order, grouped into chunks of about `CHUNK_BYTES` of weights."""
    chunks: list[list[str]] = [[]]
    size = 0
    for fqn in fqns:
        if size >= CHUNK_BYTES:
            chunks.append([])
            size = 0
        weight = layers[fqn].weight
        chunks[-1].append(fqn)
        size += weight.numel() * weight.element_size()
    return [chunk for chunk in chunks if chunk]


def _quantized_piece(layer: torch.nn.Module, rows: torch.Tensor, config: Any) -> torch.Tensor:
    """`config` applied to a copy of `layer` holding only these rows of its weight: the piece's
    TorchAO tensor."""
    from torchao.quantization import quantize_

    piece = copy.copy(layer)
    piece._parameters = dict.fromkeys(layer._parameters)  # a bias stays the layer's: not the piece's to hold
    piece._parameters["weight"] = torch.nn.Parameter(rows, requires_grad=False)
    quantize_(piece, config, filter_fn=lambda module, fqn: module is piece)
    return piece.weight


def _by_rows(layer: torch.nn.Module, config: Any) -> bool:
    """Quantize a layer larger than a chunk a block of rows at a time, each block's tensors
    written into their place in one mapped file; False (nothing done) for a small layer or a
    scheme whose groups span rows (its pieces would not be the whole's)."""
    weight = layer.weight
    row_bytes = weight[0].numel() * weight.element_size() if weight.dim() else 0
    if weight.dim() != 2 or not row_bytes or weight.numel() * weight.element_size() <= CHUNK_BYTES or not is_mapped(weight):
        return False
    block = max(1, ROWS_BYTES // row_bytes)
    first = _quantized_piece(layer, weight[:block], config)
    names, context = first.__tensor_flatten__()
    pieces = {name: getattr(first, name) for name in names}
    if tuple(getattr(first, "block_size", (0,)))[0] != 1 or any(t.shape[0] != first.shape[0] for t in pieces.values()):
        return False
    rows = weight.shape[0]
    out = RowsFile({name: (t.dtype, (rows, *t.shape[1:])) for name, t in pieces.items()})
    try:
        for start in range(0, rows, block):
            if start:
                piece = _quantized_piece(layer, weight[start : start + block], config)
                if piece.__tensor_flatten__()[1] != context:
                    raise ValueError(f"rows {start}.. quantized with another setting than the first ({context})")
                pieces = {name: getattr(piece, name) for name in names}
            for name, tensor in pieces.items():
                out.write(name, start, tensor)
            release_mapped_pages()
    except BaseException:
        out.discard()
        raise
    whole = type(first).__tensor_unflatten__(out.mapped(), context, weight.shape, weight.stride())
    layer.weight = torch.nn.Parameter(whole, requires_grad=False)
    logger.debug("quantized a %s weight %s a block of %d rows at a time", type(layer).__name__, list(weight.shape), block)
    return True


def _spill_new_tensors(layers: Iterable[torch.nn.Module]) -> None:
    """Every large tensor the layers hold in memory (their new codes and scales) moved to a
    mapped file."""
    places = []
    for layer in layers:
        for owner in layer.modules():
            for store in (owner._parameters, owner._buffers):
                for name, tensor in store.items():
                    if tensor is not None and not is_mapped(tensor) and tensor.numel() * tensor.element_size() >= SPILL_TENSOR_BYTES:
                        places.append((store, name, tensor))
    if not places:
        return
    for (store, name, tensor), moved in zip(places, spilled([t for _, _, t in places])):
        store[name] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else moved
