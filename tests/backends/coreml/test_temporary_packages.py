"""coremltools writes each conversion to a temporary `.mlpackage` folder and deletes it only at exit:
a compile kept every partition's package, weights included, until it ended, and a process leaving
by `os._exit` (a pytest-xdist worker) or killed left them in the temporary folder (743 of them here
after a day's test runs)."""

import glob
import os
import tempfile

import pytest
import torch

import compiler
from compiler.ir.private_api import coreml_temporary_packages_removed


@pytest.fixture
def own_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _packages(folder) -> list[str]:
    return glob.glob(os.path.join(folder, "*.mlpackage"))


@pytest.mark.parametrize("quantize", [None, "8w"])
def test_a_core_ml_compile_leaves_no_converted_package_behind(own_temporary_folder, quantize):
    torch.manual_seed(0)
    model, inputs = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval(), (torch.randn(2, 64),)
    result = compiler.compile(model, inputs, "coreml", quantize=quantize, cache=False)
    assert _packages(own_temporary_folder) == []
    [out] = result.run(*inputs)
    torch.testing.assert_close(out, model(*inputs), atol=0.05, rtol=0.05)


def test_packages_made_outside_the_block_are_left_alone(own_temporary_folder):
    import coremltools as ct

    model = torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(1, 4),)).run_decompositions({})
    kept = ct.convert(model, convert_to="mlprogram", skip_model_load=True)
    with coreml_temporary_packages_removed():
        pass
    assert _packages(own_temporary_folder) == [kept.package_path]
