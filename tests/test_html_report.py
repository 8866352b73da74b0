"""The HTML report: its tables, and the graph as headless Chromium draws it (every node of
the partitioned program, after the inlined layout ran), and text escaped wherever it goes."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import types

import pytest
import torch

from executorch.exir.backend.partitioner import DelegationSpec

from compiler.api import compile
from compiler.reporting.html_report import render_html
from compiler.ir.placement import NodePlacement, PlacementPlan
from compiler.reporting.report import Report, StageRecord

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium) to run the page's layout script"
)


class Camera(torch.nn.Module):
    """A camera-like model: uint8 pixels scaled to [0, 1], conv, relu, flatten, linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8 * 30 * 30, 10)

    def forward(self, image):
        x = image.float() / 255
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def camera_run(backend: str):
    torch.manual_seed(0)
    image = torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8)
    return compile(Camera().eval(), (image,), backend)


class PageReader(html.parser.HTMLParser):
    """What the tests look for in a page: table rows by table id, data-node attributes,
    the body's data attributes, and the text of elements with an id."""

    def __init__(self, page: str):
        super().__init__()
        self.rows: dict[str, list[dict[str, str]]] = {}
        self.body: dict[str, str] = {}
        self.text_of: dict[str, str] = {}
        self._table: str | None = None
        self._in_body_rows = False
        self._open_ids: list[str | None] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = attributes
        elif tag == "table":
            self._table = attributes.get("id")
            self.rows.setdefault(self._table, [])
        elif tag == "tbody":
            self._in_body_rows = True
        elif tag == "tr" and self._in_body_rows and self._table:
            self.rows[self._table].append(attributes)
        if tag in ("pre", "script"):
            self._open_ids.append(attributes.get("id"))

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body_rows = False
        elif tag == "table":
            self._table = None
        elif tag in ("pre", "script") and self._open_ids:
            self._open_ids.pop()

    def handle_data(self, data):
        if self._open_ids and self._open_ids[-1]:
            self.text_of[self._open_ids[-1]] = self.text_of.get(self._open_ids[-1], "") + data


def dump_dom(page_path, profile) -> PageReader:
    """The page's DOM after its scripts ran (virtual time lets the layout finish)."""
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         "--virtual-time-budget=10000", "--dump-dom", page_path.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    return PageReader(dom)


@pytest.fixture(scope="module", params=["xnnpack", "coreml"])
def camera(request):
    return camera_run(request.param)


@needs_chromium
def test_the_page_shows_every_stage_placement_and_node(camera, tmp_path):
    partitioned = camera.stages["partition"]
    page = tmp_path / "report.html"
    page.write_text(render_html(camera.report, partitioned), encoding="utf-8")

    dom = dump_dom(page, tmp_path / "profile")

    assert [row["data-stage"] for row in dom.rows["stages"]] == [r.stage for r in camera.report.stages]
    assert [row["data-node"] for row in dom.rows["placement"]] == [p.node for p in partitioned.plan.nodes]
    # The uint8 input is converted on the CPU by both backends: the page shows a mix, and
    # opens with the first CPU op selected (its reason in the side panel).
    classes = [row["class"].split() for row in dom.rows["placement"]]
    assert {c[0] for c in classes} == {"cpu", "delegated"}
    first_on_cpu = next(p.node for p in partitioned.plan.nodes if p.on_cpu)
    assert [row["data-node"] for row in dom.rows["placement"] if "selected" in row["class"]] == [first_on_cpu]
    names = [node.name for node in partitioned.program.graph.nodes]
    assert json.loads(dom.text_of["rendered-nodes"]) == names
    assert dom.body["data-graph-nodes"] == str(len(names))
    edges = sum(len(node.all_input_nodes) for node in partitioned.program.graph.nodes)
    assert dom.body["data-graph-edges"] == str(edges)


def odd_names_program():
    """A stand-in partitioned program whose names and reason would break unescaped HTML."""
    names = ["x<lambda>", "a&b", 'q"</script><script>alert(1)</script>', "output"]

    def node(name, op, inputs):
        return types.SimpleNamespace(
            name=name, op=op, target=name, meta={"val": None}, all_input_nodes=list(inputs)
        )

    x = node(names[0], "placeholder", [])
    first = node(names[1], "call_function", [x])
    second = node(names[2], "call_function", [first])
    out = node(names[3], "output", [second])
    signature = types.SimpleNamespace(
        input_specs=[types.SimpleNamespace(arg=types.SimpleNamespace(name=x.name), kind=types.SimpleNamespace(name="USER_INPUT"))]
    )
    plan = PlacementPlan(
        (
            NodePlacement(first.name, "aten.add<&>.Tensor", "tag<0>"),
            NodePlacement(second.name, "aten.cumsum.default", None, "refuses <b>bold</b> & </script>"),
        ),
        {"tag<0>": DelegationSpec("XnnpackBackend", [])},
    )
    program = types.SimpleNamespace(graph=types.SimpleNamespace(nodes=[x, first, second, out]), graph_signature=signature)
    report = Report(stages=(StageRecord("partition</td>", 0.5, metrics={"why": "<i>&</i>"}, messages=("</pre><b>",)),))
    return report, types.SimpleNamespace(plan=plan, program=program), names


def test_names_are_escaped_in_tables_and_graph_data():
    report, partitioned, names = odd_names_program()
    page = render_html(report, partitioned, title="<title> & </title>")

    assert "<lambda>" not in page and "<b>" not in page and "<i>" not in page
    assert page.count("</script>") == page.count("<script")  # no name closes a script early
    dom = PageReader(page)
    assert [row["data-node"] for row in dom.rows["placement"]] == names[1:3]
    assert [row["data-stage"] for row in dom.rows["stages"]] == ["partition</td>"]
    graph = json.loads(dom.text_of["graph-data"])
    assert [n["data"]["id"] for n in graph["nodes"]] == names
    assert graph["nodes"][2]["data"]["reason"] == "refuses <b>bold</b> & </script>"


@needs_chromium
def test_odd_names_render_in_the_graph(tmp_path):
    report, partitioned, names = odd_names_program()
    page = tmp_path / "odd.html"
    page.write_text(render_html(report, partitioned), encoding="utf-8")

    dom = dump_dom(page, tmp_path / "profile")

    assert json.loads(dom.text_of["rendered-nodes"]) == names


def test_a_run_stopped_before_partition_has_no_graph():
    report = Report(stages=(StageRecord("capture", 0.1, nodes_out=3),), config={"backend": "xnnpack"})
    page = render_html(report, None)

    dom = PageReader(page)
    assert [row["data-stage"] for row in dom.rows["stages"]] == ["capture"]
    assert "placement" not in dom.rows
    assert 'id="graph"' not in page and "cytoscape" not in page


def _graph_section(page: str) -> str:
    return page.split('<script type="application/json" id="graph-data">', 1)[1].split("</script>", 1)[0]


def test_the_page_after_a_whole_stage_cache_hit_has_the_same_graph(tmp_path, capsys):
    """A second run of the same command is served by the stage cache (every stage cached): its
    page draws the same graph as a run without the cache (it said "the run stopped before the
    partition stage")."""
    from compiler.cli.main import main

    pages = {}
    for name, flags in (("first", []), ("cached", []), ("uncached", ["--no-cache"])):
        page = tmp_path / f"{name}.html"
        assert main(["compile", "mlp", "--backend", "xnnpack", "--cache-dir", str(tmp_path / "cache"), "-q",
                     "--report-html", str(page), *flags]) == 0
        pages[name] = page.read_text()
    report = tmp_path / "cached.json"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--cache-dir", str(tmp_path / "cache"), "-q",
                 "--report-json", str(report), "--report-html", str(tmp_path / "again.html")]) == 0
    stages = json.loads(report.read_text())["stages"]
    assert all(stage["cached"] for stage in stages[stages.index(next(s for s in stages if s["stage"] == "capture")) + 1:])
    assert _graph_section(pages["cached"]) == _graph_section(pages["uncached"]) == _graph_section(pages["first"])
