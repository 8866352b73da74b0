"""The report a user reads: every node's placement in words, each backend's share of the
ops, stage notes without `key=value`, and a JSON report that holds all of it."""

import json

import attrs
import pytest

import compiler
from compiler.ir.placement import BackendShare, NodePlacement, PlacementPlan
from compiler.ir.errors import PipelineError
from compiler.reporting.report import Report, StageRecord, plain_phrase
from compiler.stages import STAGES
from compiler.stages import STAGE_NAMES
from executorch.exir.backend.partitioner import DelegationSpec


@pytest.fixture(scope="module")
def compiled():
    """tests/tiny_models.py's Linear * 2 -> cumsum for XNNPACK: XNNPACK has no cumsum."""
    import torch
    from tiny_models import AddMul

    torch.manual_seed(0)
    model, inputs = AddMul().eval(), (torch.randn(2, 8),)
    artifact = compiler.compile(model, inputs, "xnnpack")
    check = compiler.compare_with_eager(artifact, model, inputs)
    report = attrs.evolve(
        artifact.report, plan=artifact.stages["partition"].plan, model="AddMul", check=check.to_json()
    )
    return artifact, report


def test_every_node_says_where_it_runs_and_why_in_words(compiled):
    _, report = compiled
    described = {n.op: n for n in report.plan.described()}
    cumsum = described["aten.cumsum.default"]
    assert (cumsum.where, cumsum.backend_id, cumsum.tag) == ("CPU (portable kernel)", None, None)
    assert cumsum.reason == "XNNPACK does not support cumsum.default"
    linear = described["aten.linear.default"]
    assert (linear.where, linear.backend_id) == ("XNNPACK delegate 1", "XnnpackBackend")
    assert linear.tag and linear.reason == "the XNNPACK partitioner took it"

    header, rows = report.placement_rows()
    assert header == ["node", "op", "runs on", "delegate", "precision", "reason"]
    assert len(rows) == len(report.plan.nodes)  # a small program: one row per node
    (cpu_row,) = [row for row in rows if row[2].startswith("CPU")]
    assert cpu_row[1:] == ["aten.cumsum.default", "CPU (portable kernel)", "-", "float32", cumsum.reason]
    assert linear.precision == "float32"  # XNNPACK computes in the node's dtype
    text = report.format_placement()
    assert "XNNPACK does not support cumsum.default" in text and f"XnnpackBackend/{linear.tag}" in text


def test_shares_count_the_ops_of_each_backend_and_the_cpu(compiled):
    _, report = compiled
    plan = report.plan
    delegated, cpu = plan.shares()
    total = len(plan.nodes)
    assert (delegated.name, delegated.ops, delegated.total) == ("XNNPACK", total - 1, total)
    assert (cpu.name, cpu.backend_id, cpu.ops) == ("CPU", None, 1)
    assert report.format_shares() == (
        f"XNNPACK: {total - 1} of {total} ops ({round(100 * (total - 1) / total)}%); "
        f"CPU: 1 of {total} ops ({round(100 / total)}%)"
    )


def test_a_share_rounds_to_0_or_100_only_when_it_is():
    assert BackendShare(None, "CPU", 1, 600).percent == 1
    assert BackendShare("CoreMLBackend", "Core ML", 599, 600).percent == 99
    assert str(BackendShare("CoreMLBackend", "Core ML", 57, 60)) == "Core ML: 57 of 60 ops (95%)"
    assert BackendShare(None, "CPU", 0, 60).percent == 0 and BackendShare(None, "CPU", 60, 60).percent == 100


def test_stage_notes_are_words(compiled):
    _, report = compiled
    header, rows = report.stage_rows()
    assert header[-1] == "notes" and [row[0] for row in rows] == [*STAGE_NAMES, "total"]
    notes = {row[0]: row[-1] for row in rows}
    assert notes["fold"] == "folded nothing"
    assert notes["split_constants"] == "no constant copies needed"
    assert all("=" not in note for note in notes.values()), notes
    assert report.stage("fold").metrics == {"folded": 0}  # machine-readable as before


@pytest.mark.parametrize("row", STAGES, ids=lambda row: row.name)
def test_each_stage_declares_its_metrics_with_unit_and_wording(row):
    stage = row.load()()
    names = [metric.name for metric in stage.metrics]
    assert len(names) == len(set(names))
    for metric in stage.metrics:
        assert metric.unit in ("count", "bytes", "s", "text", "flag")
        value = {"count": 2, "bytes": 4096, "s": 1.5, "text": "aten.matmul.default", "flag": True}[metric.unit]
        assert metric.phrase(value) and "=" not in metric.phrase(value)


def test_a_metric_a_stage_does_not_declare_is_a_named_error():
    stage = STAGES[3].load()()
    assert stage.phrase("folded", 4) == "folded 4 nodes into constants"
    with pytest.raises(PipelineError, match="reported the metric 'cache_hits', which it does not declare"):
        stage.phrase("cache_hits", 3)


def test_an_instruments_own_key_shows_as_key_and_value():
    assert plain_phrase("cache_hits", 3) == "cache hits: 3"
    assert plain_phrase("reusable_s", 1.5) == "reusable s: 1.500"


def test_json_report_holds_the_whole_report(compiled):
    artifact, report = compiled
    data = json.loads(json.dumps(report.to_json()))
    assert data["model"] == "AddMul" and data["config"]["backend"] == "xnnpack"
    assert data["check"]["passed"] is True and data["check"]["tolerance_kind"] == "absolute"
    assert len(data["check"]["per_output"]) == data["check"]["outputs"] == 1
    assert [n["node"] for n in data["nodes"]] == [p.node for p in report.plan.nodes]
    assert set(data["nodes"][0]) == {"node", "op", "where", "backend_id", "tag", "reason", "precision"}
    assert [s["name"] for s in data["shares"]] == ["XNNPACK", "CPU"]
    assert [s["stage"] for s in data["stages"]] == list(STAGE_NAMES)
    assert all("messages" in s and "notes" in s for s in data["stages"])
    assert data["versions"] and data["overrides"] == []


def _plan(ops: int) -> PlacementPlan:
    """`ops` Core ML adds, then one CPU cumsum, all of float32 values."""
    nodes = [NodePlacement(f"add_{i}", "aten.add.Tensor", "tag0", dtype="float32") for i in range(ops)]
    nodes.append(NodePlacement("cumsum", "aten.cumsum.default", None, "Core ML cannot convert aten.cumsum.default", "float32"))
    return PlacementPlan(tuple(nodes), {"tag0": DelegationSpec("CoreMLBackend", [])})


def test_a_long_program_is_grouped_and_says_where_every_node_is():
    report = Report(plan=_plan(Report.PER_NODE_LIMIT))
    header, rows = report.placement_rows()
    assert header == ["op", "count", "runs on", "precision", "reason"]
    assert rows == [  # Core ML computes in its default compute precision, float16
        ["aten.add.Tensor", str(Report.PER_NODE_LIMIT), "Core ML", "float16", "the Core ML partitioner took it"],
        ["aten.cumsum.default", "1", "CPU (portable kernel)", "float32", "Core ML cannot convert aten.cumsum.default"],
    ]
    text = report.format_placement()
    assert text.splitlines()[0] == "Core ML: 60 of 61 ops (98%); CPU: 1 of 61 ops (2%)"
    assert text.splitlines()[-1] == "61 op nodes, grouped by op; the JSON report (--report-json) lists every node"
    assert len(report.to_json()["nodes"]) == 61


def test_a_report_without_a_plan_keeps_the_grouped_summary():
    plan = _plan(2)
    report = Report(stages=(StageRecord("partition", 0.1),), placement=plan.summary())
    header, rows = report.placement_rows()
    assert header == ["op", "count", "runs on", "precision", "reason"]
    assert rows[0][:3] == ["aten.add.Tensor", "2", "CoreMLBackend"]
    assert report.to_json()["nodes"] == [] and report.format_shares() == ""


def test_the_plan_reloads_from_its_json():
    plan = _plan(3)
    again = PlacementPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.described() == plan.described() and again.where(again.nodes[0]) == "CoreMLBackend/tag0"
