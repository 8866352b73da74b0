import logging
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("torchao").setLevel(logging.ERROR)


class AddMul(torch.nn.Module):
    """Tiny model: a Linear (XNNPACK takes it) and a cumsum (stays on the CPU)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.linear(x) * 2.0, dim=-1)


@pytest.fixture
def small_model():
    torch.manual_seed(0)
    return AddMul().eval(), (torch.randn(2, 8),)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when a -m expression asks for them (`-m slow`)."""
    if config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
