"""The random-program differential test: the generator, the oracle, a small campaign per
backend, and every shrunk program a campaign found, kept as a regression test."""

import glob
import math
import os

import pytest
import torch

from compiler.tools.fuzz import campaign, oracle
from compiler.tools.fuzz.programs import MODEL, MODEL_WIDTHS, Program, Reproducer, Value, programs

CASES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "cases", "*.py")))
# A campaign per backend: small and fixed (the seed replays it exactly). The default run
# takes the first programs of it; CI's slow job the whole campaign, those first ones included.
CI_EXAMPLES = {"portable": 20, "xnnpack": 20, "mlx": 20, "coreml": 12}
DEFAULT_RUN_SHARE = 4  # the default run takes 1 / this of each campaign


def _campaigns():
    for backend, examples in CI_EXAMPLES.items():
        yield pytest.param(backend, examples // DEFAULT_RUN_SHARE, id=f"{backend}-first")
        yield pytest.param(backend, examples, id=f"{backend}-whole", marks=pytest.mark.slow)


@pytest.mark.parametrize(("backend", "examples"), _campaigns())
def test_random_programs_compile_or_are_refused_by_name_and_match_eager(backend, examples, tmp_path):
    run = campaign.fuzz(backend, examples, campaign_seed=11, out_dir=str(tmp_path), with_stock=False)
    assert len(run.cases) == examples
    shrunk = "\n\n".join(open(c.reproducer).read() for c in run.shrunk)
    assert not run.failures, f"{run.table()}\n{run.details()}\n\nshrunk:\n{shrunk}"


@pytest.mark.parametrize("path", CASES, ids=[os.path.basename(p)[:-3] for p in CASES])
def test_what_fuzzing_found_stays_fixed(path):
    program = Reproducer.load(path)
    outcome = oracle.ours(program, program.backend, oracle.eager_outputs(program))
    assert outcome.kind == oracle.OK, f"{outcome.kind}: {outcome.detail}"  # compiled, ran and matched eager


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_a_campaign_at_model_sizes_has_no_wrong_result_and_no_node_over_its_tolerance(backend, tmp_path):
    """Widths to 2048 and 512 tokens: the tolerances that hold at a few elements hold at a model's
    sizes (sums over long float16 rows included), the outputs' and every node's."""
    run = campaign.fuzz(backend, 6, campaign_seed=31, out_dir=str(tmp_path), with_stock=False, check_nodes=True,
                        sizes=MODEL)
    assert not run.failures, f"{run.table()}\n{run.details()}"


def test_model_sizes_draw_a_models_activation_and_keep_every_value_within_the_bound():
    drawn = _draw(30, sizes=MODEL)
    widest = 0
    for program in drawn:
        model, inputs = program.build()
        assert inputs[0].dim() == 3 and inputs[0].shape[-1] in MODEL_WIDTHS  # (batch, tokens, hidden)
        assert all(0 < v.numel() <= MODEL.max_elements for v in inputs)
        assert all(math.prod(v.shape) <= MODEL.max_elements for v in program.outputs if not v.data_dependent)
        widest = max(widest, inputs[0].shape[-1])
    assert widest == 2048


def _draw(count: int, seed: int = 3, sizes=None) -> list[Program]:
    drawn: list[Program] = []
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    @with_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs() if sizes is None else programs(sizes=sizes))
    def collect(program):
        drawn.append(program)

    collect()
    return drawn


@pytest.mark.slow  # draws and exports a whole campaign; the sampled campaigns below run by default
def test_every_drawn_program_exports_and_every_step_kind_is_drawn():
    drawn = _draw(250)
    for program in drawn[:20]:
        model, inputs = program.build()
        torch.export.export(model, inputs)
    text = "\n".join(line for p in drawn for line in p.lines)
    for needle in ("index_put", "masked_fill", "scaled_dot_product_attention", "conv", "layer_norm", "rms_norm",
                   "F.linear", "gelu", "softmax", ".to(", "split", "torch.cat", "add_(", "copy_("):
        assert needle in text, needle


def test_the_same_seed_draws_the_same_programs():
    assert [p.source() for p in _draw(5, seed=7)] == [p.source() for p in _draw(5, seed=7)]


def _program(dtype=torch.float32, noise=0.0) -> Program:
    return Program(("torch.ones(3)",), (), ("v1 = x0 * 2",), (Value("v1", (3,), dtype, noise),))


def test_the_oracle_finds_a_wrong_value_shape_and_dtype():
    program = _program()
    want = [[torch.tensor([1.0, 2.0, 3.0])]]
    assert oracle.compare(program, [[torch.tensor([1.0, 2.0, 3.0])]], want) is None
    assert "max abs error" in oracle.compare(program, [[torch.tensor([1.0, 2.0, 3.1])]], want)
    assert "shape" in oracle.compare(program, [[torch.tensor([[1.0, 2.0, 3.0]])]], want)
    assert "dtype" in oracle.compare(program, [[torch.tensor([1, 2, 3])]], want)
    assert "NaN" in oracle.compare(program, [[torch.tensor([1.0, float("nan"), 3.0])]], want)


def test_the_oracle_tolerance_follows_dtype_and_noise():
    want = [[torch.tensor([1000.0, 0.0])]]
    got = [[torch.tensor([1000.5, 0.0])]]
    assert oracle.compare(_program(torch.float32), got, want) is not None
    assert oracle.compare(_program(torch.float16, noise=1e-3), got, want) is None


def test_a_wrapped_dependency_error_is_a_failure_and_a_named_one_is_not():
    assert oracle.WRAPPED in oracle.FAILURES and oracle.NAMED not in oracle.FAILURES


def test_a_campaign_counts_every_program_once_shrinks_a_failure_and_writes_reproducers(tmp_path, monkeypatch):
    """A stand-in pipeline that gets every program using softmax wrong: the campaign
    counts each drawn program once, shrinks the first such failure to a small program
    still using softmax, and writes standalone reproducers that replay it."""

    def fake_ours(program, backend, want, check_nodes=False):
        if any("softmax" in line for line in program.source().splitlines()):
            return oracle.Outcome(oracle.WRONG, "call 0 output 0: max abs error 1")
        return oracle.Outcome(oracle.OK)

    monkeypatch.setattr(oracle, "ours", fake_ours)
    run = campaign.fuzz("portable", 80, campaign_seed=5, out_dir=str(tmp_path), with_stock=False)
    assert len(run.cases) == 80
    assert run.failures, "80 programs hold a softmax"
    assert all(os.path.exists(c.reproducer) for c in run.failures)
    (smallest,) = run.shrunk
    assert "softmax" in smallest.program.source()
    assert len(smallest.program.lines) <= min(len(c.program.lines) for c in run.failures)
    replayed = Reproducer.load(smallest.reproducer)
    assert replayed.backend == "portable" and replayed.calls == smallest.program.calls
    assert "wrong result" in run.table().splitlines()[0]
