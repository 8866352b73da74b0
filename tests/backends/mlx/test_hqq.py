"""MLX's HQQ scales, a block of rows at a time, are TorchAO's bit for bit."""

import pytest
import torch
from torchao.quantization import quantize_
from torchao.quantization.granularity import PerAxis, PerGroup
from torchao.quantization.quant_api import IntxWeightOnlyConfig

from compiler.backends.mlx import hqq
from compiler.backends.mlx.hqq import HqqWeightOnlyConfig


def _torchao(layer, bits, group):
    config = IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"),
                                  granularity=PerGroup(group) if group else PerAxis(0),
                                  intx_choose_qparams_algorithm="hqq_scale_only")
    quantize_(layer, config)
    return layer.weight


@pytest.mark.parametrize("bits, group, dtype, shape", [
    (4, 32, torch.bfloat16, (300, 256)),  # rows not a multiple of the block
    (8, 64, torch.float32, (64, 2048)),
    (4, None, torch.float32, (96, 128)),  # per row
])
def test_codes_and_scales_are_torchaos(monkeypatch, bits, group, dtype, shape):
    monkeypatch.setattr(hqq, "BLOCK_ELEMENTS", 4096)  # many blocks
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    ours = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    ours.weight = torch.nn.Parameter(layer.weight.detach().clone())
    quantize_(ours, HqqWeightOnlyConfig(bits, group))
    reference = _torchao(layer, bits, group)
    torch.testing.assert_close(ours.weight.qdata, reference.qdata, rtol=0, atol=0)
    torch.testing.assert_close(ours.weight.scale, reference.scale, rtol=0, atol=0)
    assert ours.weight.scale.dtype == reference.scale.dtype == dtype


@pytest.mark.parametrize("tolerance, rerun", [(0.05, True), (1e-3, False)])
def test_an_early_stop_is_torchaos(monkeypatch, tolerance, rerun):
    # TorchAO stops when no scale moved by more than the tolerance (1e-5 in its configs): with a
    # wider one it stops while some groups still move, and the blocks run again to that update.
    from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq

    monkeypatch.setattr(hqq, "BLOCK_ELEMENTS", 2048)
    monkeypatch.setattr(hqq, "EARLY_STOP", tolerance)
    reruns = []
    real = hqq._updates
    monkeypatch.setattr(hqq, "_updates", lambda *args: reruns.append(args[4]) or real(*args))
    torch.manual_seed(0)
    weight = torch.randn(128, 256)
    codes, scale = hqq.hqq_codes(weight, 32, -8, 7)
    reference_codes, reference_scale = _choose_qparams_and_quantize_scale_only_hqq(
        weight, [1, 32], -8, 7, early_stop_tol=tolerance)
    assert (min(reruns) < hqq.ITERATIONS) == rerun  # a block still moving at the stop ran again to it
    torch.testing.assert_close(codes, reference_codes.to(torch.int8), rtol=0, atol=0)
    torch.testing.assert_close(scale, reference_scale, rtol=0, atol=0)


def test_a_blocks_float32_temporaries_stay_under_the_size_glibc_maps_on_its_own():
    """Once a large compile fixes glibc's threshold (`memory.freed_tensors_returned`), each larger
    temporary is mapped, faulted in and unmapped: the updates ran at 25 ns a weight against 12 (at 1B,
    a 37 s quantize stage against a 29 s float compile)."""
    from compiler.process.memory import MMAP_THRESHOLD

    widest = 8192  # a row of the widest weight: the block takes whole rows
    rows = max(1, hqq.BLOCK_ELEMENTS // widest)
    assert rows * widest * torch.float32.itemsize < MMAP_THRESHOLD
