"""MLX's weight scales: TorchAO's scale-only HQQ, the choice MLX's own LLM export makes, computed
a block of rows at a time.

TorchAO iterates its 20 least-squares updates over the whole weight, each update a handful of
full-size float32 temporaries: at 250M parameters that took longer than the whole float compile
(measured: 32 s against 18 s). Each group's scale evolves on its own; only the early stop looks at
the whole tensor (the largest relative change of any scale). So blocks of rows run their updates
one after another, each update on the groups still moving, recording the largest change per
update; the stop TorchAO would make follows from those, and a block runs again only when the stop
came early. The codes and scales are TorchAO's, bit for bit (tests/backends/mlx/test_hqq.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torchao.core.config import AOBaseConfig
from torchao.quantization import IntxUnpackedToInt8Tensor
from torchao.quantization.transform_module import register_quantize_module_handler

from compiler.process.memory import MMAP_THRESHOLD

ITERATIONS = 20  # TorchAO's defaults
EARLY_STOP = 1e-5
# Rows are taken about a quarter of a million weights at a time: each float32 temporary stays under
# the size glibc maps on its own once a large compile fixed its threshold (`memory.MMAP_THRESHOLD`),
# so the updates reuse heap blocks instead of mapping, faulting in and unmapping about seven fresh
# pages-worth blocks each (at 1B: 25 ns a weight against 12, 37 s of a 29 s float compile), and each
# operation is still large enough that the calls cost little.
BLOCK_ELEMENTS = (MMAP_THRESHOLD - (1 << 14)) // torch.float32.itemsize


@dataclasses.dataclass(frozen=True)
class HqqWeightOnlyConfig(AOBaseConfig):
    """Symmetric integer weights with HQQ scales, one per `group_size` columns of a row (None: per row)."""

    bits: int
    group_size: int | None


def _updates(blocks: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int, count: int,
             changes: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """`count` HQQ updates of `scale` for `blocks` ([rows, groups, group]), and after how many
    updates every scale was fixed (`count` if some still moved); the largest relative change of
    each update goes into `changes` (kept as the largest over every block).

    TorchAO's arithmetic, on the groups still moving: a group whose update gives its scale back
    bit for bit has the same codes next time, so it is fixed from then on and leaves the work
    (on random weights half the groups are fixed after two updates, all after about twelve)."""
    eps = torch.finfo(torch.float32).eps
    group = blocks.shape[-1]
    weights = blocks.reshape(-1, group)
    final = scale.reshape(-1).clone()
    moving = torch.arange(len(final))
    current = final.clone()
    settled = count
    for step in range(count):
        codes = (weights / current.unsqueeze(-1)).round_().clamp_(qmin, qmax)
        num = (weights * codes).sum(dim=1, dtype=torch.float32)
        den = codes.square_().sum(dim=1, dtype=torch.float32)
        updated = torch.where(den > 0, num / den, current).clamp_min(eps).abs()
        if changes is not None:
            change = ((updated - current).abs() / current.clamp_min(eps)).max()
            changes[step] = torch.maximum(changes[step], change)
        still = updated != current
        current = updated
        if not still.any():
            settled = step
            break
        if still.sum() * 2 < len(still):  # keep the moving groups only
            final[moving] = current
            weights, moving, current = weights[still], moving[still], current[still]
    final[moving] = current
    return final.view_as(scale), settled


def hqq_codes(weight: torch.Tensor, group_size: int, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes ([out, in]) and scales ([out, in // group_size], the weight's dtype)."""
    rows, columns = weight.shape
    groups = columns // group_size
    eps = torch.finfo(torch.float32).eps
    step_rows = max(1, BLOCK_ELEMENTS // columns)
    qabs = max(abs(qmin), abs(qmax)) or 1

    def start(block: torch.Tensor) -> torch.Tensor:
        return (block.abs().amax(dim=2) / qabs).clamp_min(eps)

    def blocks():
        for first in range(0, rows, step_rows):
            yield first, weight[first:first + step_rows].to(torch.float32).view(-1, groups, group_size)

    changes = torch.zeros(ITERATIONS)
    scale = torch.empty(rows, groups)
    settled = []
    for first, block in blocks():
        scale[first:first + len(block)], fixed_after = _updates(block, start(block), qmin, qmax, ITERATIONS, changes)
        settled.append(fixed_after)
    stop = next((i + 1 for i, change in enumerate(changes) if change < EARLY_STOP), ITERATIONS)
    codes = torch.empty(rows, columns, dtype=torch.int8)
    for (first, block), fixed_after in zip(blocks(), settled):
        if fixed_after > stop:  # TorchAO stopped while this block still moved: its scales at the stop
            scale[first:first + len(block)] = _updates(block, start(block), qmin, qmax, stop, None)[0]
        block_scale = scale[first:first + len(block)].unsqueeze(-1)
        codes[first:first + len(block)] = (block / block_scale).round().clamp(qmin, qmax).view(len(block), columns)
    return codes, scale.to(weight.dtype)


@register_quantize_module_handler(HqqWeightOnlyConfig)
def _quantize_weight(module: torch.nn.Module, config: HqqWeightOnlyConfig) -> torch.nn.Module:
    weight = module.weight
    group_size = config.group_size or weight.shape[-1]
    dtype = getattr(torch, f"int{config.bits}")
    qmin, qmax = -(2 ** (config.bits - 1)), 2 ** (config.bits - 1) - 1
    codes, scale = hqq_codes(weight.detach(), group_size, qmin, qmax)
    quantized = IntxUnpackedToInt8Tensor(
        qdata=codes, scale=scale, zero_point=torch.zeros_like(scale, dtype=torch.int8), target_dtype=dtype,
        block_size=(1, group_size), dtype=weight.dtype, activation_quantization=None,
    )
    module.weight = torch.nn.Parameter(quantized, requires_grad=False)
    return module
