"""The quantization benchmark (`python -m benchmarks.quantization`): its quick subset runs and
our programs pass their checks; the table in docs/quantization.md is the committed results'."""

import json
import pathlib

import pytest

from compiler.tools import readme

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 30-80 s of compiles; the default run keeps the doc-table test below
def test_quick_subset_measures_every_column_and_ours_passes(tmp_path):
    from benchmarks import quantization

    results_file, tables = tmp_path / "quantization.json", tmp_path / "quantization.md"
    quantization.main(["--quick", "--json", str(results_file), "--markdown", str(tables)])

    cells = json.loads(results_file.read_text())["cells"]
    expected = {
        quantization.key(quantization.QUICK_MODEL, backend, scheme, granularity)
        for backend, quick in quantization.QUICK_CELLS.items() for scheme, granularity in quick
    }
    assert set(cells) == expected
    header = "| " + " | ".join(quantization.COLUMNS) + " |"
    assert header in tables.read_text()
    for name, cell in cells.items():
        ours = cell["ours"]
        assert ours["status"] == "ok", (name, ours)
        assert ours["max_abs_error"] <= ours["tolerance"], name
        assert ours["pte_bytes"] > 0 and 0 < ours["delegated"] <= 1
        if cell["scheme"] != quantization.FLOAT:
            assert ours["error_vs_float"] is not None, name
        if cell["backend"] == "xnnpack":
            assert ours["run_ms"] > 0
        assert ("stock" in cell) == (cell["recipe"] is not None)


def test_the_doc_table_is_the_committed_results():
    from benchmarks import quantization

    results = json.loads((ROOT / "benchmarks" / "results" / "quantization.json").read_text())
    text = (ROOT / readme.document(quantization.SECTION)).read_text()
    assert readme.section(text, quantization.SECTION) == quantization.table(results).strip(), (
        "regenerate it: python -m benchmarks.quantization"
    )
