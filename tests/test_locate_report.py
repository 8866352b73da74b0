"""What `locate` reports: on a Core ML program computing in float16 (whose tolerance hides the
fault) it locates the float32 conversion of the same partitions; the HTML report marks the
diverging node and its path on the graph; the CLI command prints the stage table and the
finding and exits 1 when a stage diverges."""

from __future__ import annotations

import argparse
import html
import json
import re


import pytest

import compiler
from compiler.backends.coreml.fixes import fixes_off
from test_locate import LinearGelu, _AbsForRelu, model


def test_a_float16_core_ml_program_is_located_through_its_float32_conversion():
    module, inputs = model(LinearGelu)
    with fixes_off("tanh_gelu"):
        result = compiler.compile(module, inputs, "coreml")
        assert compiler.compare_with_eager(result.stages["emit"], module, inputs).passed  # float16 hides it
        location = compiler.locate_result(result, module, inputs)
    assert location.stage == "lower" and location.divergence.node == "aten_gelu_default"
    assert "computing in float32" in location.note


def test_the_html_report_marks_the_diverging_node_and_its_path():
    module, inputs = model()
    backend = _AbsForRelu()
    result = compiler.compile(module, inputs, backend)
    location = compiler.locate_result(result, module, inputs, backend=backend)
    page = _render(result, location)
    graph = json.loads(re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', page).group(1))
    marked = {n["data"]["id"]: n["data"].get("located") for n in graph["nodes"] if n["data"].get("located")}
    assert marked["aten_relu_default"] == "diverging"
    assert {name for name, how in marked.items() if how == "path"} >= {"x", "aten_linear_default_1"}
    assert "first diverging node: aten_relu_default" in html.unescape(re.search(r'<pre id="located">(.*?)</pre>', page, re.S).group(1))
    assert json.loads(json.dumps(location.to_json()))["divergence"]["node"] == "aten_relu_default"


def _render(result, location) -> str:
    from compiler.reporting.html_report import render_html

    return render_html(result.report, result.stages["partition"], located=location.highlight())


def test_the_locate_command_prints_the_stages_and_exits_0_when_all_agree(capsys):
    from compiler.cli import locate
    from compiler.cli.terminal import Terminal

    terminal = Terminal(0)
    try:
        args = argparse.Namespace(model="mlp", backend="portable", backend_option=[], report_html=None, report_json=None,
                                  tolerance=None)
        assert locate.run(args, terminal) == 0
    finally:
        terminal.close()
    out = capsys.readouterr().out
    assert "locate: every stage's outputs agree with eager" in out
    assert re.search(r"^decompose\s+fx interpreter\s+0\s+0\.0001\s+ok", out, re.M), out


def test_locate_without_check_is_refused(capsys):
    from compiler.cli.main import main

    assert main(["compile", "mlp", "--locate"]) == 2
    err = capsys.readouterr().err
    assert "--locate locates a failed --check" in err and "add --check" in err


@pytest.mark.slow
def test_compile_check_locate_names_the_node_and_marks_it_in_the_html(tmp_path, capsys):
    from compiler.cli.main import main

    source = tmp_path / "gelu.py"
    source.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)\n"
        "    def forward(self, x):\n"
        "        return self.down(nn.functional.gelu(self.up(x), approximate='tanh'))\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return M().eval(), (torch.randn(4, 16) * 3,)\n"
    )
    page = tmp_path / "report.html"
    with fixes_off("tanh_gelu"):
        status = main([
            "compile", f"{source}:make", "--backend", "coreml", "--no-verify", "--no-cache",
            "--check", "--locate", "--report-html", str(page),
        ])
    assert status == 1
    out = capsys.readouterr().out
    assert "the outputs first diverge from eager at stage 'lower'" in out
    assert "first diverging node: aten_gelu_default (aten.gelu.default" in out
    assert f"{source}:8" in out  # the forward's line
    assert '"located": "diverging"' in page.read_text()
