import logging
import warnings

import pytest
import torch
from tiny_models import AddMul  # tests/tiny_models.py: test modules import it from there

warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("torchao").setLevel(logging.ERROR)


@pytest.fixture
def small_model():
    torch.manual_seed(0)
    return AddMul().eval(), (torch.randn(2, 8),)


ON_REQUEST = ("slow", "models")


@pytest.fixture(autouse=True)
def cache_folder_of_the_test(tmp_path_factory, monkeypatch):
    """The CLI keeps its stage cache and crash reproducers under the user's cache folder:
    each test gets a temporary one of its own (a stage cached by one test would skip the
    stage another test patches or watches)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


def pytest_collection_modifyitems(config, items):
    """Tests marked slow or models run only when a -m expression asks for them (`-m slow`, `-m models`)."""
    if config.getoption("markexpr"):
        return
    held = [item for item in items if any(item.get_closest_marker(m) for m in ON_REQUEST)]
    if held:
        config.hook.pytest_deselected(items=held)
        items[:] = [item for item in items if item not in held]
