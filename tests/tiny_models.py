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


class RandomProgram(torch.nn.Module):
    """Found by the fuzz campaign: XNNPACK's copy rule sent the clone of `b0 * 2.0` to the
    CPU while the multiply before it and the slice after it stayed in one group."""

    def __init__(self):
        super().__init__()
        self.p0 = torch.nn.Parameter(torch.randn(4, 5) * 0.5)
        self.register_buffer("b0", torch.ones(4, 4))
        self.m0 = torch.nn.RMSNorm([1, 4], eps=None)

    def forward(self, x0, x1):
        v1 = x0 @ self.p0[:, 1:5].t()
        v2, v3 = torch.chunk(v1, 2, dim=1)
        self.b0.copy_(x1 * 0.5)
        v5 = (self.b0 * 2.0).clone()
        v5[0:1] = -1.25
        v6 = self.m0(v3)
        v7 = v5 + v5
        return v6, v7 != -0.2, v5 < 0.05, torch.cat([torch.ones(4, dtype=torch.int64)] * 2), v6


class MatmulInBfloat16(torch.nn.Module):
    """An enabled autocast region in a float32 model: its matmul computes in bfloat16 as eager's does."""

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = x @ y
        return z.float() + 1
