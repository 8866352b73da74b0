"""Every built-in example compiles for both runnable backends and matches eager."""

import pytest

import compiler
from compiler.models.examples import EXAMPLES


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_matches_eager(name, backend):
    model, inputs = EXAMPLES[name]()
    artifact = compiler.compile(model, inputs, backend)
    check = compiler.compare_with_eager(artifact, model, inputs)
    assert check.max_abs_error < 1e-4, check
    if backend == "xnnpack":
        assert artifact.report.stage("lower").delegates >= 1
    else:
        assert not artifact.program.delegates


def test_shared_buffer_is_read_by_a_delegate_and_the_cpu():
    model, inputs = EXAMPLES["shared_buffer"]()
    artifact = compiler.compile(model, inputs, "xnnpack")
    partitioned = artifact.stages["partition"].program
    scale = next(n for n in partitioned.graph.nodes if n.name == "b_scale")
    tags = {u.meta.get("delegation_tag") for u in scale.users}
    assert None in tags and len(tags) >= 2
