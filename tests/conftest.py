import logging
import os
import random
import warnings

import numpy
import pytest
import torch
from tiny_models import AddMul  # tests/tiny_models.py: test modules import it from there

warnings.filterwarnings("ignore", category=FutureWarning)
# One torch thread per pytest-xdist worker: the workers already fill the cores, and two threads each
# on two cores only wait on one another.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
logging.getLogger("torchao").setLevel(logging.ERROR)


def _seed_every_draw() -> None:
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)


# torch seeds its generator afresh in each process: the values test modules draw when imported
# would differ from run to run.
_seed_every_draw()


@pytest.fixture(autouse=True)
def seeded_draws():
    """Each test draws the same numbers on every run, whichever tests its worker ran before
    it: a comparison through Core ML's float16 of two nearly equal values must not pass on
    one run and fail on the next by the draw."""
    _seed_every_draw()


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
