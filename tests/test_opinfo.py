"""PyTorch's OpInfo as a differential suite (`compiler/tools/fuzz/opinfo.py`): ours on every
backend, each case compiled, run here and compared with eager by the fuzz oracle. Ours must pass
or refuse by name at compile time: never a wrong result, a raw exception, a wrapped library error
or a refusal when the program runs.

The default run takes the head of the draw (its first ops, the same cases the table starts
with); -m slow the whole draw (`python -m benchmarks.opinfo` adds stock beside it).
"""

import pytest
import torch

from compiler.tools.fuzz import opinfo

BACKENDS = ("portable", "xnnpack", "coreml", "mlx")
DEFAULT_RUN_OPS = 2  # the draw's first ops, every sample the whole draw takes of them


def _failures(cases: list[opinfo.OpSample], backend: str) -> dict[str, str]:
    """Every case ours neither passes nor refuses by name at compile time (a refusal when the
    program runs is one)."""
    judged = opinfo.run(cases, (backend,), with_stock=False)
    return {j.case.id: f"{j.ours.kind}: {j.ours.detail}" for j in judged
            if opinfo.outcome_class(j.ours) != opinfo.PASS
            and not (opinfo.outcome_class(j.ours) == opinfo.NAMED and not j.ours.detail.startswith("run:"))}


def test_the_head_of_the_draw_passes_or_is_refused_by_name_on_every_backend():
    cases = opinfo.draw(ops=DEFAULT_RUN_OPS)
    assert len({c.op for c in cases}) == DEFAULT_RUN_OPS
    failures = {backend: _failures(cases, backend) for backend in BACKENDS}
    assert not any(failures.values()), failures


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_whole_draw_passes_or_is_refused_by_name(backend):
    cases = opinfo.draw()
    assert len({c.op for c in cases}) == opinfo.OPS
    failures = _failures(cases, backend)
    assert not failures, "\n".join(f"{case}: {why}" for case, why in failures.items())


def test_the_draw_is_the_same_on_every_run():
    first, again = opinfo.draw(ops=3), opinfo.draw(ops=3)
    assert [c.id for c in first] == [c.id for c in again]
    for a, b in zip(first, again):
        inputs_a, inputs_b = a.build()[1], b.build()[1]
        assert all(torch.equal(x, y) for x, y in zip(inputs_a, inputs_b, strict=True))


def test_a_case_calls_the_op_on_its_sample_with_the_tensors_as_inputs():
    [case] = opinfo.draw(ops=1, samples_per_op=1, only=("clamp",))
    model, inputs = case.build()
    sample_input, args, kwargs = torch.utils._pytree.tree_unflatten(list(case.leaves), case.spec)
    assert torch.equal(model(*inputs), torch.clamp(sample_input, *args, **kwargs))
    assert len(inputs) == sum(isinstance(leaf, torch.Tensor) for leaf in case.leaves)


def test_an_op_writing_into_its_input_gets_fresh_inputs_on_every_build():
    [case] = opinfo.draw(ops=1, samples_per_op=1, only=("clamp",))
    _, inputs = case.build()
    inputs[0].fill_(0)
    assert not torch.equal(case.build()[1][0], inputs[0])


def test_random_ops_are_no_case():
    """OpInfo reseeds them inside the call, so eager repeats itself; no compiled program can."""
    random_ops = ("uniform", "normal", "bernoulli", "multinomial", "rand_like")
    assert set(random_ops) <= set(opinfo.op_names())
    assert not opinfo.draw(only=random_ops)


def test_a_complex_output_is_compared_in_both_parts():
    """The oracle compared complex outputs through .to(float64), which drops the imaginary part:
    an rfft wrong only there passed."""
    [case] = opinfo.draw(ops=1, samples_per_op=1, only=("fft.rfft",))
    (want,) = opinfo.oracle.eager_outputs(case)
    wrong = [t + 1j for t in want]
    assert opinfo.oracle.compare(case, [want], [want]) is None
    assert "max abs error 1" in opinfo.oracle.compare(case, [wrong], [want])


def test_a_stock_program_calling_an_operator_the_runtime_lacks_fails_as_it_would_load():
    """Stock's ihfft leaves `_conj_copy` on the CPU, which the runtime has no kernel for: on a device
    the program would not load, though the reference executor (Core ML, MLX) ran it with torch."""
    from executorch.exir import to_edge_transform_and_lower

    [case] = opinfo.draw(ops=1, samples_per_op=1, only=("fft.ihfft",))
    model, inputs = case.build()
    pte = to_edge_transform_and_lower(torch.export.export(model, inputs)).to_executorch().buffer
    assert opinfo.oracle.missing_kernels(pte) == ["aten::_conj_copy.out"]
    stock = opinfo.oracle.stock(case, "portable", opinfo.oracle.eager_outputs(case))
    assert stock.kind == opinfo.oracle.NAMED and "no kernel for aten::_conj_copy.out" in stock.detail
