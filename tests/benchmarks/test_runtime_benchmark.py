"""The run-time benchmark (`python -m benchmarks.runtime`): ExecuTorch's event tracing is read for
both programs of a row, and its counts are right. No timing is asserted: the machines are noisy."""

import json

import pytest
import torch

from benchmarks import runtime
from compiler.models import examples


def _tiny():
    torch.manual_seed(0)
    return examples.mlp(features=8, hidden=16, layers=2, batch=2)[:2]


def _checked(side: dict) -> None:
    for field in ("runs", "median_ms", "delegate_calls", "cpu_kernel_calls", "cpu_share", "top_cpu_ops", "wall_median_ms"):
        assert field in side, field
    assert side["runs"] >= 20
    assert side["median_ms"] > 0
    assert 0 <= side["cpu_share"] <= 1


@pytest.mark.slow  # the whole command, files included; the default run measures one XNNPACK pair below
def test_a_portable_row_has_every_field_and_no_delegate_call(tmp_path):
    results = tmp_path / "runtime.json"
    rows = runtime.main(["--models", "--model", "mlp:features=8,hidden=16,layers=2,batch=2",
                         "--backends", "portable", "--seconds", "0.1", "--json", str(results)])
    assert json.loads(results.read_text())["rows"] == json.loads(json.dumps(rows))
    (row,) = rows
    assert "error" not in row, row.get("error")
    for side in ("ours", "stock"):
        _checked(row[side])
        assert row[side]["delegate_calls"] == 0
        assert row[side]["cpu_kernel_calls"] > 0
        assert row[side]["cpu_share"] > 0
        assert {op["op"] for op in row[side]["top_cpu_ops"]} & {"addmm.out", "linear.out", "mm.out"}
    assert row["ratio"] > 0
    assert row["max_abs_difference"] < 1e-4
    assert "| `mlp:features=8,hidden=16,layers=2,batch=2` | portable |" in (tmp_path / "runtime.md").read_text()


def test_an_xnnpack_mlp_makes_at_least_one_delegate_call():
    module, inputs = _tiny()
    ours = runtime.our_pte(module, inputs, "xnnpack")
    stock = runtime.stock_pte(*_tiny(), "xnnpack")
    row = runtime.measure_pair(ours, stock, inputs, seconds=0.05)
    for side in ("ours", "stock"):
        _checked(row[side])
        assert row[side]["delegate_calls"] >= 1


def test_the_docs_run_time_table_is_the_committed_results():
    from compiler.tools import readme

    with open(runtime.ROOT + "/benchmarks/results/runtime.json") as f:
        rows = json.load(f)["rows"]
    with open(runtime.ROOT + "/docs/benchmarks.md") as f:
        text = f.read()
    assert readme.section(text, runtime.DOC_SECTION) == runtime.doc_text(rows).strip(), (
        "regenerate it: python -m benchmarks.runtime --doc docs/benchmarks.md"
    )
