"""The optimum-executorch comparison's committed table: rendered from its committed results, and
every program in it generating eager's tokens under TextLLMRunner."""

import json
import pathlib

from benchmarks import optimum_comparison as benchmark  # light: builds no model, runs no venv
from compiler.tools import readme

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _results() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "optimum_comparison.json").read_text())


def test_the_docs_table_is_the_committed_results():
    text = (ROOT / readme.document(benchmark.SECTION)).read_text()
    assert readme.section(text, benchmark.SECTION) == benchmark.table(_results()["results"]), (
        "regenerate it: python -m benchmarks.optimum_comparison"
    )


def test_both_exporters_programs_generate_eagers_tokens_under_the_runner():
    rows = _results()["results"]
    assert set(rows) == set(benchmark.OPTIMUM) | set(benchmark.OURS)
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["runner"] == "TextLLMRunner" and row["passed"] and row["first_difference"] is None, name
