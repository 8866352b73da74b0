"""XNNPACK's preprocess runs 17 passes on each partition, each ending with a retrace of the whole
partition; the lower skips the retraces of graphs no pass changed since the last one
(`unchanged_graphs_not_retraced`). The program must be byte for byte the one stock's retraces
make, for models where every one of those passes has something to do."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import compiler
import compiler.backends.xnnpack as xnnpack_backend
from compiler.models.examples import EXAMPLES


class EveryPass(nn.Module):
    """Ops each of XNNPACK's passes rewrites: a Conv1d (unsqueezed to 2-D), a BatchNorm after a conv
    (fused) and one alone (decomposed), PReLU (reshaped), a max pool with indices (getitem removed),
    a bilinear resize (its decomposition recognised), a pad, a cat of many inputs (split), ReLU
    after a conv (fused), clones and dtype round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(4, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.fused_norm = nn.BatchNorm2d(8)
        self.lone_norm = nn.BatchNorm2d(8)
        self.prelu = nn.PReLU(8)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.head = nn.Linear(8, 4)

    def forward(self, signal, image):
        line = self.conv1d(signal)  # [1, 8, 16]
        grid = line.reshape(1, 8, 4, 4) + image
        grid = torch.relu(self.fused_norm(self.conv(grid)))
        grid = self.prelu(self.lone_norm(grid + 1.0))
        pooled, _ = self.pool(grid)
        resized = nn.functional.interpolate(pooled, size=(4, 4), mode="bilinear", align_corners=False)
        padded = nn.functional.pad(resized, (1, 1, 1, 1))[..., 1:5, 1:5]
        joined = torch.cat([padded, grid, resized.clone(), grid * 2, grid - 1, resized], dim=1)
        return self.head(joined.mean(dim=(2, 3)).reshape(6, 8)), joined.to(torch.float16).to(torch.float32)


def _every_pass():
    torch.manual_seed(0)
    return EveryPass().eval(), (torch.randn(1, 4, 16), torch.randn(1, 8, 4, 4))


def _retraces(monkeypatch) -> list[int]:
    """Counts the retraces XNNPACK's passes run (each runs the partition through `call_submodule`)."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.pass_base import _ExportPassBase

    counted, inside = [0], [False]
    call_submodule, transform = _ExportPassBase.call_submodule, XNNPACKPassManager.transform

    def counting(self, graph_module, inputs):
        counted[0] += inside[0]
        return call_submodule(self, graph_module, inputs)

    def passes(self):
        inside[0] = True
        try:
            return transform(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(_ExportPassBase, "call_submodule", counting)
    monkeypatch.setattr(XNNPACKPassManager, "transform", passes)
    return counted


CASES = {
    "every_pass": (_every_pass, {}),
    "convnet": (EXAMPLES["convnet"], {}),
    "transformer": (EXAMPLES["transformer"], {}),
    "transformer_8da4w": (EXAMPLES["transformer"], {"quantize": "8da4w", "quantize_group_size": 32}),
    "every_pass_int8_static": (_every_pass, {"quantize": "int8_static"}),
}


# A sample in the default run; every case with -m slow.
SAMPLE = ("every_pass",)


@pytest.mark.parametrize(
    "case", [c if c in SAMPLE else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_skipping_unchanged_retraces_makes_the_same_program(case, monkeypatch):
    factory, options = CASES[case]
    model, inputs = factory()
    if options.get("quantize") == "int8_static":
        options = {**options, "calibration": [inputs]}
    compiler.compile(model, inputs, "xnnpack", **options)  # the first compile of a process runs more passes
    counted = _retraces(monkeypatch)
    ours = compiler.compile(model, inputs, "xnnpack", **options)
    ours_retraces = counted[0]
    with monkeypatch.context() as stock:
        stock.setattr(xnnpack_backend, "unchanged_graphs_not_retraced", contextlib.nullcontext)
        counted[0] = 0
        every = compiler.compile(model, inputs, "xnnpack", **options)
    assert ours.report.stage("partition").delegates >= 1
    assert ours.pte == every.pte
    assert ours_retraces < counted[0] / 2, (ours_retraces, counted[0])
    assert compiler.compare_with_eager(ours, model, inputs).passed
