"""`compiler.locate` names the stage and the node where a fault injected in one stage makes the
program's numbers leave eager's: a Core ML conversion fix switched off (inside the payload), a
wrong rewrite of the partition stage (an fx program), a wrong rewrite inside XNNPACK payloads
(found by cutting the delegate), and a payload's own intermediate values where the backend reads
them (the hook)."""

from __future__ import annotations

import contextlib
import inspect
from unittest import mock

import pytest
import torch

import compiler
from compiler import backends

class LinearGelu(torch.nn.Module):
    """Linear, GELU(tanh), Linear, as issue 31 measured it on Core ML."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


class LinearGeluRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.g(self.a(x)))))


def model(cls=LinearGeluRelu):
    torch.manual_seed(0)
    return cls().eval(), (torch.randn(4, 16) * 3,)


def _at_forward(divergence, cls=LinearGeluRelu) -> bool:
    """Whether the node's source line is the model's forward line (the last line of forward)."""
    lines, first = inspect.getsourcelines(cls.forward)
    return divergence.source is not None and divergence.source.startswith(f"{__file__}:{first + len(lines) - 1}:")


def test_coreml_tanh_gelu_fix_off_is_located_at_the_gelu_inside_the_payload():
    from compiler.backends.coreml.fixes import fixes_off

    module, inputs = model(LinearGelu)
    with fixes_off("tanh_gelu"):
        location = compiler.locate(module, inputs, "coreml", backend_options={"compute_precision": "float32"})
    assert location.stage == "lower"
    d = location.divergence
    assert (d.node, d.op, d.module) == ("aten_gelu_default", "aten.gelu.default", "g (GELU)")
    # Read through the Core ML hook, which names the MIL op: the exact GELU stock converts it to.
    assert d.payload_op == "gelu (mode EXACT)"
    assert _at_forward(d, LinearGelu), d.source
    assert d.delegate.endswith("(CoreMLBackend)") and d.found_by == "the CoreMLBackend payload's intermediate values"
    assert d.output_error > d.tolerance and all(e is not None and e <= d.tolerance for _, e in d.input_errors)
    assert [s.node for s in location.path][-1] == "aten_gelu_default" and location.path[0].node == "x"
    text = location.describe()
    assert "first diverging node: aten_gelu_default (aten.gelu.default)" in text and "g (GELU)" in text
    assert "payload op: gelu (mode EXACT)" in text


def test_without_a_fault_every_stage_agrees():
    module, inputs = model(LinearGelu)
    location = compiler.locate(module, inputs, "coreml", backend_options={"compute_precision": "float32"})
    assert location.stage is None and location.divergence is None
    assert all(row.passed in (True, None) for row in location.stages)
    assert {row.stage for row in location.stages if row.passed} >= {"capture", "decompose", "partition", "lower", "emit"}


class _AbsForRelu(backends.load("xnnpack")):
    """XNNPACK whose partition stage rewrites relu into abs: a wrong pass in an fx stage."""

    def partition(self, program):
        from executorch.exir.dialects._ops import ops as exir_ops

        result = super().partition(program)
        for node in program.graph.nodes:
            if node.op == "call_function" and node.target == exir_ops.edge.aten.relu.default:
                node.target = exir_ops.edge.aten.abs.default
        program.graph_module.recompile()
        return result


def test_a_wrong_rewrite_in_the_partition_stage_is_located_at_its_node():
    module, inputs = model()
    location = compiler.locate(module, inputs, _AbsForRelu())
    assert location.stage == "partition"
    assert [row.stage for row in location.stages if row.passed is False][0] == "partition"
    d = location.divergence
    assert (d.node, d.op, d.found_by, d.delegate) == ("aten_relu_default", "aten.abs.default", "node values", None)
    assert _at_forward(d) and d.module == "(the model) (LinearGeluRelu)"
    assert d.input_errors == (("aten_linear_default_1", d.input_errors[0][1]),) and d.input_errors[0][1] <= d.tolerance


class _SigmoidForTanh(backends.load("xnnpack")):
    """XNNPACK whose payloads compute sigmoid where the program says tanh: a wrong rewrite inside
    the delegate, where the runtime shows no values."""

    @contextlib.contextmanager
    def lowering(self, dependency_checks=False):
        from executorch.backends.xnnpack import xnnpack_preprocess
        from executorch.exir.dialects._ops import ops as exir_ops

        original = xnnpack_preprocess.XnnpackBackend.preprocess

        def wrong(program, specs):
            for node in program.graph.nodes:
                if node.op == "call_function" and node.target == exir_ops.edge.aten.tanh.default:
                    node.target = exir_ops.edge.aten.sigmoid.default
            program.graph_module.recompile()
            return original(program, specs)

        with mock.patch.object(xnnpack_preprocess.XnnpackBackend, "preprocess", staticmethod(wrong)):
            with super().lowering(dependency_checks):
                yield


def test_a_wrong_rewrite_inside_xnnpack_payloads_is_located_by_cutting_the_delegate():
    module, inputs = model()
    location = compiler.locate(module, inputs, _SigmoidForTanh())
    assert location.stage == "lower"
    d = location.divergence
    # The tanh of XNNPACK's tanh-GELU rewrite (partition stage): its origin is the GELU it replaced.
    assert (d.node, d.op, d.module) == ("aten_tanh_default", "aten.tanh.default", "g (GELU)")
    assert _at_forward(d), d.source
    assert d.delegate.endswith("(XnnpackBackend)") and d.found_by.startswith("cutting the delegate: ")
    assert [s.node for s in location.path if s.over] == ["aten_tanh_default"]


def test_a_backend_that_reads_its_payload_values_is_asked_instead_of_cut(monkeypatch):
    module, inputs = model()
    asked = []

    def values(processed, given, named_data, program=None):
        """As a payload whose tanh computes sigmoid would report its values."""
        asked.append((len(processed), len(given)))
        x = given[0] @ module.a.weight.T + module.a.bias
        inner = (x + 0.044715 * x**3) * (2 / torch.pi) ** 0.5
        return {"aten_linear_default": x, "aten_tanh_default": torch.sigmoid(inner)}

    monkeypatch.setattr(backends, "intermediate_values", lambda delegate_id: values)
    location = compiler.locate(module, inputs, _SigmoidForTanh())
    assert asked and location.divergence.node == "aten_tanh_default"
    assert location.divergence.found_by == "the XnnpackBackend payload's intermediate values"
