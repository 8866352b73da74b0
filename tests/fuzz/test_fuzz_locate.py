"""The fuzzer reports every wrong result of ours with where `locate` puts it (issue 31, item 5):
the finding's record holds the Location's JSON, its reproducer file and the campaign's details
a paragraph naming the stage and node, and a locate that fails leaves the finding with its error.

The wrong result is made real by letting the portable runtime's truncating integer remainder
through (`kernel_fixes.fixes_off("integer_remainder")`): seed 109's second program ends in
`v1 % -3`, which only the emitted program gets wrong, so locate names the node inside emit."""

from __future__ import annotations

import json
import os

import pytest

import compiler
from compiler.ir import kernel_fixes
from compiler.tools.fuzz import campaign, oracle, place

SEED, EXAMPLES = 109, 2  # the second program drawn with this seed computes an integer % -3
NODE, OP = "aten_remainder_scalar", "aten.remainder.Scalar"


def _fuzz(out_dir, shrink: bool = False):
    with kernel_fixes.fixes_off("integer_remainder"):
        return campaign.fuzz("portable", EXAMPLES, SEED, out_dir=str(out_dir), with_stock=False, shrink=shrink)


def _named(location: dict) -> tuple:
    d = location["divergence"]
    return location["stage"], d["node"], d["op"]


def test_a_wrong_result_is_reported_with_the_located_stage_and_node(tmp_path):
    run = _fuzz(tmp_path)
    (case,) = run.failures
    assert case.ours.kind == oracle.WRONG
    assert case.locate_error is None and case.located_on == place.ON_ITSELF
    assert _named(case.location) == ("emit", NODE, OP)
    assert case.location["divergence"]["found_by"].startswith("cutting the emitted program")
    assert f"at stage 'emit', at node {NODE} ({OP})" in case.place
    text = open(case.reproducer).read()
    assert text.splitlines()[2].startswith("# locate: the outputs first diverge from eager at stage 'emit'")
    assert NODE in text
    assert f"on this program: {case.place}" in run.details()  # what `python -m compiler fuzz` prints
    with open(tmp_path / f"portable-{SEED}-findings.json") as f:
        (record,) = json.load(f)["failures"]
    assert record["reproducer"] == case.reproducer and _named(record["location"]) == ("emit", NODE, OP)
    assert record["ours"]["kind"] == oracle.WRONG


def test_a_locate_that_fails_keeps_the_finding_and_records_the_error(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("locate broke")

    monkeypatch.setattr(compiler, "locate", broken)
    run = _fuzz(tmp_path)
    (case,) = run.failures
    assert case.ours.kind == oracle.WRONG and case.location is None
    assert case.locate_error == "RuntimeError: locate broke"
    assert case.place == "locate failed: RuntimeError: locate broke"
    assert "# locate failed: RuntimeError: locate broke" in open(case.reproducer).read()
    with open(tmp_path / f"portable-{SEED}-findings.json") as f:
        (record,) = json.load(f)["failures"]
    assert record["location"] is None and record["locate_error"] == "RuntimeError: locate broke"


@pytest.mark.slow
def test_a_shrunk_wrong_result_is_located_and_the_drawn_one_takes_its_place(tmp_path):
    """Shrinking (3 to 6 minutes): the shrunk program is located; the drawn one points to it."""
    run = _fuzz(tmp_path, shrink=True)
    (drawn,) = run.failures
    (shrunk,) = run.shrunk
    assert _named(shrunk.location) == ("emit", NODE, OP) and shrunk.located_on == place.ON_ITSELF
    assert NODE in open(shrunk.reproducer).read()
    assert drawn.location == shrunk.location and drawn.located_on.startswith("the shrunk program 0")
    assert os.path.basename(shrunk.reproducer) in open(drawn.reproducer).read()
