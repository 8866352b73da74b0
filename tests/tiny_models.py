"""Small models the tests share, importable as `tiny_models` from any test module.

pytest puts this folder on sys.path (tests/conftest.py lives here and tests/ is no package),
so `from tiny_models import AddMul` works wherever pytest is started from; `from
tests.conftest import ...` needed the checkout's root on sys.path (`python -m pytest` from it).
"""

import torch


class AddMul(torch.nn.Module):
    """Tiny model: a Linear (XNNPACK takes it) and a cumsum (stays on the CPU)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.linear(x) * 2.0, dim=-1)
