"""The quantize axis of the differential fuzzer: random programs holding Linear (and
Embedding) layers, quantized by a random scheme the backend takes, compiled by ours and
compared with the eager quantized model."""

import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as with_seed

from compiler.stages import schemes
from compiler.tools.fuzz import campaign, oracle
from compiler.tools.fuzz.programs import Quantization, Reproducer, quantized_programs

# Fixed campaigns (the seed replays them exactly): the default run takes a few programs per
# backend (xnnpack's: a PT2E dynamic, a PT2E static and a TorchAO scheme), the slow job more.
FIRST = {"xnnpack": (11, 3), "mlx": (14, 3)}
WHOLE = {"xnnpack": (0, 20), "mlx": (0, 20)}


def _campaigns():
    for backend, (seed, examples) in FIRST.items():
        yield pytest.param(backend, seed, examples, id=f"{backend}-first")
    for backend, (seed, examples) in WHOLE.items():
        yield pytest.param(backend, seed, examples, id=f"{backend}-whole", marks=pytest.mark.slow)


@pytest.mark.parametrize(("backend", "seed", "examples"), _campaigns())
def test_quantized_random_programs_compile_or_are_refused_by_name_and_match_the_eager_quantized_model(
    backend, seed, examples, tmp_path
):
    run = campaign.fuzz(backend, examples, seed, out_dir=str(tmp_path), with_stock=False, shrink=False, quantize=True)
    assert len(run.cases) == examples
    assert all(c.program.quantization for c in run.cases)
    assert any(c.ours.kind == oracle.OK for c in run.cases), run.table()
    found = "\n\n".join(open(c.reproducer).read() for c in run.failures)
    assert not run.failures, f"{run.table()}\n{run.details()}\n\n{found}"


def _draw(backend: str, count: int) -> list:
    drawn = []

    @with_seed(5)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(quantized_programs(backend))
    def collect(program):
        drawn.append(program)

    collect()
    return drawn


@pytest.mark.parametrize("backend", ["xnnpack", "mlx", "coreml"])
def test_a_quantized_program_holds_the_layers_its_scheme_quantizes_and_a_scheme_its_backend_takes(backend):
    for program in _draw(backend, 30):
        q = program.quantization
        scheme = schemes.BY_NAME[q.scheme]
        assert q.granularity in scheme.granularities(backend)
        model, inputs = program.build()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        assert linears and bool(embeddings) == bool(q.embedding), program.source()
        if q.granularity == schemes.PER_GROUP:
            assert all(m.in_features % q.group_size == 0 for m in linears), program.source()
        if q.embedding and q.embedding_group_size:
            assert all(m.embedding_dim % q.embedding_group_size == 0 for m in embeddings)
        calibration = program.calibration()
        assert len(calibration) == q.calibration_draws and bool(calibration) == scheme.needs_calibration
        assert all([t.shape for t in drawn] == [t.shape for t in inputs] for drawn in calibration)
        # No mutable state: the eager quantized model is checked with one call.
        assert program.calls == 1
        layer_outputs = {line.split(" = ")[0] for line in program.lines if re.search(r"= self\.[le]\d+\(", line)}
        assert layer_outputs & set(program.names), program.source()


def test_a_quantized_reproducer_replays_with_its_scheme_and_calibration(tmp_path):
    program = next(p for p in _draw("xnnpack", 30) if p.quantization.calibration_draws)
    case = campaign.Case(0, program, oracle.Outcome(oracle.OK), None)
    replayed = Reproducer.load(campaign.write_reproducer(str(tmp_path), "case", case, "xnnpack", 5))
    assert replayed.quantization == program.quantization
    assert [[t.tolist() for t in inputs] for inputs in replayed.calibration()] == [
        [t.tolist() for t in inputs] for inputs in program.calibration()
    ]


@pytest.mark.parametrize(
    ("got", "kind"),
    [
        (torch.ones(3), oracle.OK),
        (torch.ones(3) + 0.01, oracle.TOLERANCE),  # off by less than quantizing moved it (0.1)
        (torch.ones(3) + 1, oracle.WRONG),
        (torch.ones(3, dtype=torch.float64), oracle.WRONG),
        (torch.ones(1, 3), oracle.WRONG),
    ],
)
def test_a_quantized_output_off_by_more_than_quantizing_moved_it_is_wrong(monkeypatch, got, kind):
    """The eager quantized model returns ones; the float model 1.1 (quantizing moved it by 0.1)."""
    error = (got.double() - 1).abs().max().item()
    check = SimpleNamespace(passed=error == 0, tolerance=SimpleNamespace(absolute=1e-4, rule="given"),
                            output_errors=((error, error),), max_abs_error=error)
    monkeypatch.setattr(oracle, "_run", lambda artifact, program, inputs: [[got]])
    monkeypatch.setattr(oracle, "compare_with_eager", lambda artifact, module, inputs: check)
    program = SimpleNamespace(names=("v1",), calls=1)
    outcome = oracle._judge_quantized(program, (torch.ones(3),), lambda: None, torch.nn.Identity(), [[torch.ones(3) + 0.1]])
    assert outcome.kind == kind, outcome.detail


def test_every_recipe_the_schemes_name_is_one_executorch_builds():
    for scheme in schemes.SCHEMES:
        for backend, recipes in scheme.backends.items():
            for granularity in recipes:
                quantization = Quantization(scheme.name, granularity, 32)
                recipe = oracle.stock_recipe(quantization, backend)
                assert recipe.quantization_recipe is not None, (scheme.name, backend, granularity)
