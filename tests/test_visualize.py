"""Model Explorer: a stage file's graph as Model Explorer's graph (no server started), and
the error that names the extra to install when Model Explorer is missing."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

import compiler
from compiler.ir.errors import UserInputError
from compiler.driver.stage_files import load_stage_file
from compiler.tools.visualize import INSTALL_HINT, explorer_graph, visualize
from test_html_report import Camera  # the uint8 camera model of the HTML report's tests

needs_model_explorer = pytest.mark.skipif(
    importlib.util.find_spec("model_explorer") is None,
    reason="Model Explorer is not installed (pip install -e '.[explorer]')",
)


@pytest.fixture(scope="module")
def partition_stage_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stages")
    torch.manual_seed(0)
    image = torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8)
    compiler.compile(Camera().eval(), (image,), "coreml", stop_after="split_constants", dump_dir=str(directory))
    (path,) = directory.glob("*-partition.stage")
    return path


@needs_model_explorer
def test_a_stage_file_becomes_a_model_explorer_graph_coloured_by_placement(partition_stage_file):
    artifact = load_stage_file(partition_stage_file).artifact
    program_nodes = list(artifact.program.graph.nodes)

    graph = explorer_graph(artifact, graph_id="camera")

    assert [n.id for n in graph.nodes] == [n.name for n in program_nodes]
    edges = {(e.sourceNodeId, n.id) for n in graph.nodes for e in n.incomingEdges}
    assert edges == {(source.name, n.name) for n in program_nodes for source in n.all_input_nodes}
    attributes = {n.id: {kv.key: kv.value for kv in n.attrs} for n in graph.nodes}
    for placement in artifact.plan.nodes:
        assert attributes[placement.node]["placement"] == artifact.plan.where(placement)
        assert attributes[placement.node].get("reason") == placement.reason
    on_cpu = [n for n in graph.nodes if n.id in {p.node for p in artifact.plan.cpu_nodes}]
    delegated = [n for n in graph.nodes if n.id in {p.node for p in artifact.plan.delegated_nodes}]
    assert on_cpu and delegated
    assert {n.style.backgroundColor for n in on_cpu}.isdisjoint({n.style.backgroundColor for n in delegated})
    # What the server sends the web app: the graph as plain JSON-able data.
    assert dataclasses.asdict(graph)["nodes"][0]["id"] == program_nodes[0].name


def test_without_model_explorer_the_error_names_the_extra(partition_stage_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_explorer", None)  # makes its import fail
    with pytest.raises(UserInputError) as raised:
        visualize(partition_stage_file, open_browser=False)
    assert raised.value.hint == INSTALL_HINT
    assert "Model Explorer" in raised.value.reason


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"")
    with pytest.raises(UserInputError, match=r"\.pte and \.stage"):
        visualize(path, open_browser=False)
