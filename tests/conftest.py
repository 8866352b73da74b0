import hashlib
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


# Parametrized families the default run samples: (file, test) -> every how-many-th case stays in it;
# the others run with -m slow (the whole family: `-m "slow or not slow"`).
SAMPLED = {
    ("tests/backends/mlx/test_mlx_support_table.py", "test_op_lowers_and_matches_eager"): 3,
    ("tests/backends/xnnpack/test_xnnpack_support_table.py", "test_op_lowers_and_matches_eager"): 3,
    ("tests/running/test_quantized_check.py", "test_a_quantized_program_is_checked_against_the_eager_quantized_model"): 2,
    ("tests/test_locate_faults.py", "test_the_fault_is_real"): 2,
    ("tests/test_check_nodes.py", "test_a_fault_the_outputs_hide_fails_the_node_check_at_the_fixs_node"): 10,
    ("tests/backends/test_rms_norm_epsilon.py", "test_rms_norm_matches_eager_at_every_magnitude"): 8,
    ("tests/test_check_nodes.py", "test_no_false_alarm_where_an_earlier_node_check_raised_one"): 3,
    ("tests/fuzz/test_fuzz_quantize.py",
     "test_quantized_random_programs_compile_or_are_refused_by_name_and_match_the_eager_quantized_model"): 2,
    ("tests/backends/coreml/test_coreml_quantize.py", "test_scheme_runs_in_core_ml_and_matches_the_eager_quantized_model"): 2,
    ("tests/backends/xnnpack/test_xnnpack_cpu_moves.py", "test_the_op_runs_in_one_delegate_and_matches_eager"): 3,
    ("tests/backends/xnnpack/test_stock_visitors.py", "test_stock_is_wrong_and_we_are_right"): 2,
    ("tests/backends/mlx/test_mlx_quantize.py", "test_linear_and_embedding_stay_quantized"): 2,
    ("tests/backends/test_preprocess_copies.py", "test_shared_weights_give_the_same_payload_and_stay_unchanged"): 2,
    ("tests/stages/test_capture.py", "test_indexing_by_a_zero_dim_tensor_reads_no_value_at_run_time"): 2,
    ("tests/stages/test_non_core_ops.py", "test_adaptive_max_pool"): 6,
    ("tests/stages/test_capture.py", "test_a_returned_mutated_buffer_compiles_on_every_backend_and_carries_state"): 3,
    ("tests/backends/coreml/test_rules.py", "test_more_index_put_forms"): 3,
    ("tests/backends/coreml/test_rules.py", "test_stock_runs_a_zero_dim_full_or_zeros_right"): 3,
    ("tests/backends/coreml/test_rules.py", "test_gathers_and_scatters_of_bool_stay_off_core_ml"): 3,
    ("tests/backends/coreml/test_fix_switches.py", "test_unary_ops_without_the_default_epsilon"): 2,
    ("tests/test_cli_messages.py", "test_a_run_prints_only_what_our_code_wrote"): 3,
}


# A parametrized family not in SAMPLED keeps about half of its cases from HALVED_FROM cases, about a
# third from THIRDED_FROM (each case by a hash of its id, so a family over four backends keeps a mix of
# them, the same on every run).
HALVED_FROM = 2
THIRDED_FROM = 4


def _family(item) -> tuple[str, str]:
    return item.nodeid.split("::")[0], getattr(item, "originalname", item.name)


def _sample(items) -> None:
    """Marks slow all but a sample of each parametrized family: every n-th case of a family in
    SAMPLED, about half of any other of HALVED_FROM cases or more and a third from THIRDED_FROM
    (at least one stays)."""
    families: dict[tuple[str, str], list] = {}
    for item in items:
        held = any(item.get_closest_marker(m) for m in ON_REQUEST)
        if getattr(item, "callspec", None) is not None and not held:
            families.setdefault(_family(item), []).append(item)
    for family, cases in families.items():
        every = SAMPLED.get(family)
        if every is not None:
            kept = cases[::every]
        elif len(cases) >= HALVED_FROM:
            share = 3 if len(cases) >= THIRDED_FROM else 2
            kept = [c for c in cases if hashlib.sha256(c.nodeid.encode()).digest()[0] % share == 0] or cases[:1]
        else:
            continue
        for item in set(cases) - set(kept):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked slow or models run only when a -m expression asks for them (`-m slow`, `-m models`)."""
    _sample(items)
    if config.getoption("markexpr"):
        return
    held = [item for item in items if any(item.get_closest_marker(m) for m in ON_REQUEST)]
    if held:
        config.hook.pytest_deselected(items=held)
        items[:] = [item for item in items if item not in held]
