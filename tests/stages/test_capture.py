"""Capture: the model's own constants that are views get their own storage."""

import torch

from compiler.ir.artifacts import EagerModel
from compiler.stages.base import StageContext
from compiler.stages.capture import Capture


class ViewBuffers(torch.nn.Module):
    """The model's own buffers are views into one table (as a rotary cache slice would be)."""

    def __init__(self):
        super().__init__()
        table = torch.randn(16, 8)
        self.register_buffer("low", table[:8])
        self.register_buffer("high", table[8:])

    def forward(self, x):
        return x @ self.low + x @ self.high


class TransposedParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16).t())  # all of its storage, in another layout

    def forward(self, x):
        return x @ self.w


def _capture(module, inputs):
    ctx = StageContext(backend=None)
    return Capture().run(EagerModel(module, inputs), ctx).program, ctx.metrics


def _owns_its_bytes(tensor):
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_model_views_get_their_own_storage_and_the_module_keeps_its_tensors():
    model = ViewBuffers()
    program, metrics = _capture(model, (torch.randn(4, 8),))
    assert metrics["views_owned"] == 2
    for name in ("low", "high"):
        assert _owns_its_bytes(program.state_dict[name])
        torch.testing.assert_close(program.state_dict[name], getattr(model, name))
    assert not _owns_its_bytes(model.high)  # the user's module is left as it was


def test_a_transposed_parameter_is_not_a_view():
    model = TransposedParameter()
    program, metrics = _capture(model, (torch.randn(4, 16),))
    assert "views_owned" not in metrics
    assert program.state_dict["w"] is model.w
