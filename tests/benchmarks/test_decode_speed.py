"""The decode-speed benchmark (`python -m benchmarks.decode_speed`): its committed table is rendered
from its results, and (with -m slow) one tiny program is compiled, loaded and timed end to end."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import decode_speed

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_table_is_the_committed_results():
    rows = json.loads((ROOT / "benchmarks" / "results" / "decode_speed.json").read_text())["rows"]
    assert (ROOT / "benchmarks" / "results" / "decode_speed.md").read_text() == decode_speed.render(rows)
    assert {(r["way"], r["scheme"]) for r in rows} == {tuple(p.split(":")) for p in decode_speed.PROGRAMS}


@pytest.mark.slow  # a compile and a timing process, about a minute
def test_a_tiny_program_is_compiled_loaded_and_timed(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    results = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "argv", [
        "decode_speed", "--size", "tiny", "--programs", "ours:float", "--steps", "4", "--folders", str(tmp_path),
        "--json", str(results), "--markdown", str(tmp_path / "decode.md"),
    ])
    decode_speed.main()
    (row,) = json.loads(results.read_text())["rows"]
    assert row["status"] == "ok", row.get("error")
    assert row["llm_ops"] == "llama" and len(row["tokens"]) == 4
    assert 0 < row["step_s"] and 0 < row["bound_s"] < row["step_bytes"] / 1e9  # more than 1 GB/s measured
    assert "| tiny | ours | float | ok |" in (tmp_path / "decode.md").read_text()
