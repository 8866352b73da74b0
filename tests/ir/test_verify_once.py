"""The verify instrument validates a program once per form: the partition stage's copy of the
Edge program decompose validated is not validated again, and a copy whose form changed is."""

import copy

import pytest
import torch

import compiler
from compiler.driver.instruments import VerifyEach
from compiler.ir.errors import VerificationError


class AddOne(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _edge():
    return compiler.compile(AddOne(), (torch.randn(2, 3),), stop_after="decompose").artifact


def _validations(monkeypatch) -> list:
    calls = []
    validate = torch.export.ExportedProgram.validate

    def counted(program):
        calls.append(program)
        return validate(program)

    monkeypatch.setattr(torch.export.ExportedProgram, "validate", counted)
    return calls


def test_a_copy_of_the_same_form_is_validated_once(monkeypatch):
    edge = _edge()
    calls = _validations(monkeypatch)
    verify = VerifyEach()
    verify.after_stage("decompose", None, edge)
    same = type(edge)(copy.deepcopy(edge.program), edge.preserved_ops)
    verify.after_stage("partition", None, same)
    assert len(calls) == 1


def test_a_changed_form_is_validated_again_and_its_fault_reported(monkeypatch):
    edge = _edge()
    calls = _validations(monkeypatch)
    verify = VerifyEach()
    verify.after_stage("decompose", None, edge)
    broken = type(edge)(copy.deepcopy(edge.program), edge.preserved_ops)
    relu = next(n for n in broken.program.graph.nodes if "relu" in str(n.target))
    relu.meta["val"] = relu.meta["val"].to(torch.int64)  # the add now reads an int64 and a float: refused
    with pytest.raises(VerificationError, match="program_validates"):
        verify.after_stage("partition", None, broken)
    assert len(calls) == 2
