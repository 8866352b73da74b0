"""The Core ML, MLX and XNNPACK lowers hand the backend's preprocess a copy of each partition that shares
its weights instead of cloning them (`preprocess_copies_share_tensors`): the conversion only
reads them. The payload must be the same as with stock's cloned copy, and the lower's input
weights the same values after it as before."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import compiler
import compiler.backends.coreml as coreml_backend
import compiler.backends.mlx as mlx_backend
import compiler.backends.xnnpack as xnnpack_backend
from compiler.ir import private_api

MODULES = {"coreml": coreml_backend, "mlx": mlx_backend, "xnnpack": xnnpack_backend}


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _weights(artifact) -> dict[str, torch.Tensor]:
    program = artifact.program
    return {k: v for k, v in {**program.state_dict, **program.constants}.items() if isinstance(v, torch.Tensor)}


class LowerInputWatch(compiler.Instrument):
    """Clones the lower stage's input weights before it runs and compares them after."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.unchanged: bool | None = None

    def before_stage(self, stage, artifact):
        if stage == "lower":
            self.before = {k: v.clone() for k, v in _weights(artifact).items()}

    def after_stage(self, stage, before, after):
        if stage == "lower":
            now = _weights(before)
            self.unchanged = now.keys() == self.before.keys() and all(torch.equal(now[k], self.before[k]) for k in now)


def _compile(backend: str, quantize: str | None, *instruments):
    torch.manual_seed(0)
    model, x = TwoLinears().eval(), torch.randn(3, 16)
    options = {"quantize": quantize, "calibration": [(x,)]} if quantize else {}
    return compiler.compile(model, (x,), backend, instruments=instruments, **options)


@pytest.mark.parametrize("backend, quantize", [
    ("coreml", None), ("coreml", "8w"), ("mlx", None), ("mlx", "8w"), ("xnnpack", None), ("xnnpack", "8da4w"),
])
def test_shared_weights_give_the_same_payload_and_stay_unchanged(backend, quantize, monkeypatch):
    shared_copies = []
    copy = private_api._copied_sharing_tensors

    def counted(original):
        inner = copy(original)

        def call(program, specs):
            made = inner(program, specs)
            shared_copies.append(any(made.state_dict[k] is v for k, v in program.state_dict.items()))
            return made

        return call

    monkeypatch.setattr(private_api, "_copied_sharing_tensors", counted)
    watch = LowerInputWatch()
    sharing = _compile(backend, quantize, watch)
    assert shared_copies and all(shared_copies)
    assert watch.before and watch.unchanged

    monkeypatch.setattr(MODULES[backend], "preprocess_copies_share_tensors", contextlib.nullcontext)
    assert _compile(backend, quantize).pte == sharing.pte
