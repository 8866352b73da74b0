"""torch remakes its list of decomposable ops (walking every op of every namespace) at each
`run_decompositions`; a compile lists them once per set of registered ops."""

import torch
from torch._export import utils as export_utils
from torch.export import decomp_utils, exported_program

from compiler.ir.private_api import decomposable_ops_listed_once


def test_the_list_is_torchs_made_once_and_torchs_function_is_back_after_the_block(monkeypatch):
    want = export_utils._collect_all_valid_cia_ops()
    calls = []
    original = export_utils._collect_all_valid_cia_ops
    monkeypatch.setattr(export_utils, "_collect_all_valid_cia_ops", lambda: calls.append(1) or original())
    with decomposable_ops_listed_once():
        first = exported_program._collect_all_valid_cia_ops()
        again = decomp_utils._collect_all_valid_cia_ops()
    with decomposable_ops_listed_once():
        later = exported_program._collect_all_valid_cia_ops()
    assert set(first) == set(again) == set(later) == want
    assert len(calls) <= 1
    assert exported_program._collect_all_valid_cia_ops is decomp_utils._collect_all_valid_cia_ops is original


def test_an_op_defined_inside_the_block_is_listed():
    with decomposable_ops_listed_once():
        before = exported_program._collect_all_valid_cia_ops()
        lib = torch.library.Library("listed_once_test", "DEF")
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        after = exported_program._collect_all_valid_cia_ops()
    twice = torch.ops.listed_once_test.twice.default
    assert twice not in before and twice in after
