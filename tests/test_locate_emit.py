"""`locate` inside the emitted program: a divergence first seen at stage emit (a portable CPU
kernel computing otherwise than torch, which only the runtime runs) is named at its node, by
emitting the lowered program again with a suspect node's value as an extra output and running
it under the runtime (`compiler/tools/locate/emitted.py`, the cut's EMIT span)."""

from __future__ import annotations

import torch

import compiler
from compiler.ir import kernel_fixes
from compiler.tools.locate import cut


class _Remainder(torch.nn.Module):
    def forward(self, a, b):
        return torch.remainder(a * 2, b) + 1


def _inputs():
    return torch.arange(-4, 4).reshape(2, 4), torch.tensor([3])


def test_a_wrong_portable_kernel_is_located_at_its_node_in_the_emitted_program():
    model, inputs = _Remainder().eval(), _inputs()
    with kernel_fixes.fixes_off("integer_remainder"):  # the runtime's truncating remainder let through
        result = compiler.compile(model, inputs, "portable", verify=False, reproducer=False)
        location = compiler.locate_result(result, model, inputs)
    assert location.stage == "emit", location.describe()
    assert [row.stage for row in location.stages if row.passed is False] == ["emit"]
    d = location.divergence
    assert d is not None, location.describe()
    assert (d.node, d.op, d.delegate) == ("aten_remainder_tensor", "aten.remainder.Tensor", None)
    assert d.found_by.startswith("cutting the emitted program")
    assert dict(d.input_errors)["aten_mul_tensor"] == 0.0  # its computed input agrees under the runtime
    assert d.source.endswith("return torch.remainder(a * 2, b) + 1")
    assert [s.node for s in location.path] == ["a", "aten_mul_tensor", "aten_remainder_tensor"]
    assert location.path[-1].over and not location.path[1].over


def test_the_emit_cut_returns_a_cpu_nodes_value_as_the_runtime_computes_it():
    model, inputs = _Remainder().eval(), _inputs()
    with kernel_fixes.fixes_off("integer_remainder"):
        result = compiler.compile(model, inputs, "portable", verify=False, reproducer=False)
        cutter = cut.Cut(result.stages["lower"], compiler.backends.resolve("portable", None), result.config, inputs,
                         span=cut.EMIT)
        values = cutter.values(["aten_mul_tensor", "aten_remainder_tensor"])
    a, b = inputs
    assert torch.equal(values["aten_mul_tensor"], a * 2)
    assert torch.equal(values["aten_remainder_tensor"], torch.fmod(a * 2, b))  # C's %, not torch's remainder
    assert not torch.equal(values["aten_remainder_tensor"], torch.remainder(a * 2, b))
    assert len(cutter.lowerings) == 1
    # the lowered artifact the cut starts from is left as it was
    assert len(result.stages["lower"].program.graph.output_node().args[0]) == 1
