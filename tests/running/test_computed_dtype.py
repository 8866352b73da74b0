"""A float32 model computing a value in bfloat16 (an enabled autocast region) is judged at bfloat16's
tolerance where a delegate computes it in float32: the same on every path. The compile took that
dtype from its captured program, which `run` of a `.pte` does not have: the program the compile
passed failed there."""

import pytest
import torch

import compiler
from tiny_models import MatmulInBfloat16


class MatmulInFloat32(torch.nn.Module):
    def forward(self, x, y):
        return x @ y + 1


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 64), torch.randn(64, 4)


@pytest.mark.parametrize("backend", ["xnnpack", "coreml"])
def test_a_pte_computing_an_autocast_region_wider_passes_as_its_compile_did(tmp_path, backend):
    result = compiler.compile(MatmulInBfloat16(), _inputs(), backend, cache=False)
    compiled = compiler.compare_with_eager(result, MatmulInBfloat16(), _inputs())
    path = tmp_path / "m.pte"
    result.save(path)
    ran = compiler.compare_with_eager(str(path), MatmulInBfloat16(), _inputs())
    assert compiled.passed and ran.passed, ran.describe()
    assert ran.tolerance.rule == compiled.tolerance.rule


def test_a_float32_model_is_judged_at_float32s_tolerance_on_every_path(tmp_path):
    result = compiler.compile(MatmulInFloat32(), _inputs(), "xnnpack", cache=False)
    path = tmp_path / "m.pte"
    result.save(path)
    compiled = compiler.compare_with_eager(result, MatmulInFloat32(), _inputs())
    ran = compiler.compare_with_eager(str(path), MatmulInFloat32(), _inputs())
    widened = compiler.compare_with_eager(str(path), MatmulInBfloat16(), _inputs())
    assert compiled.passed and ran.passed
    assert compiled.tolerance.rule == ran.tolerance.rule and "float32" in ran.tolerance.rule
    assert widened.tolerance.absolute > 10 * ran.tolerance.absolute
