"""Open a `.pte` or a `.stage` file in Google's Model Explorer (a local web app).

A `.pte` goes through ExecuTorch's PTE adapter. A stage file is converted here, one
Model Explorer node per FX node, each coloured by where it runs when the artifact
carries a placement plan (the plan's reason shown among the node's attributes).
Model Explorer is an optional dependency (`pip install -e '.[explorer]'`) and is
imported only when used; so is torch, so the CLI can import this module at startup.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import webbrowser
from pathlib import Path
from typing import Any

from compiler.reporting.html_report import (
    CPU_COLOR,
    DELEGATE_COLORS,
    INPUT_COLOR,
    WEIGHT_COLOR,
    placeholder_kinds,
    short_op,
    value_summary,
)
from compiler.ir.errors import UserInputError


logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[explorer]'"
PTE_ADAPTER = "pte_adapter_model_explorer"


def visualize(path: str | os.PathLike, *, port: int | None = None, open_browser: bool = True) -> None:
    """Serve `path` (a `.pte` or a `.stage` file) in Model Explorer until interrupted.

    Opens a browser tab when asked and one exists; else the server prints its URL.
    `port=None` lets Model Explorer take the first free port from 8080.
    """
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"no such file: {path}", hint="give the path of a .pte or a .stage file")
    if path.suffix not in (".pte", ".stage"):
        raise UserInputError(
            f"Model Explorer is for .pte and .stage files, not {path.suffix or 'a file without suffix'}: {path}",
            hint="compile with -o model.pte, or save stage files with --dump-dir",
        )
    model_explorer = _import_model_explorer()
    config = model_explorer.config()
    extensions: list[str] = []
    if path.suffix == ".pte":
        _require_module(PTE_ADAPTER, "the PTE adapter of Model Explorer")
        config.add_model_from_path(str(path), adapterId=PTE_ADAPTER)
        extensions.append(PTE_ADAPTER)
    else:
        from compiler.driver.stage_files import load_stage_file

        stage_file = load_stage_file(path)
        graph = explorer_graph(stage_file.artifact, graph_id=f"{path.stem} (after {stage_file.stage})")
        # Model Explorer's own route for an in-memory graph (as `add_model_from_pytorch` does).
        config.graphs_list.append({"graphs": [graph]})
        config.model_sources.append({"url": f"graphs://{path.stem}/{len(config.graphs_list) - 1}"})
    show = open_browser and browser_available()
    if open_browser and not show:
        logger.warning("no browser here (no display): open the address Model Explorer prints below")
    options: dict[str, Any] = {"port": port} if port is not None else {}
    model_explorer.visualize_from_config(config=config, extensions=extensions, no_open_in_browser=not show, **options)


def browser_available() -> bool:
    """Whether `webbrowser` can open a graphical browser: on Linux without a display it
    would fall back to a terminal browser, which would take over the server's terminal."""
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return False
    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


def explorer_graph(artifact: Any, graph_id: str = "program") -> Any:
    """Model Explorer's graph (`model_explorer.graph_builder.Graph`) of a stage file's
    artifact: a node per FX node, with edges from its inputs, attributes naming the op,
    the value's dtype and shape and, with a placement plan, where it runs and why."""
    from executorch.exir.delegate import executorch_call_delegate

    from compiler.ir.dialect import op_name

    graph_builder = _import_model_explorer().graph_builder
    program = artifact.program
    plan = getattr(artifact, "plan", None)
    placements = {p.node: p for p in plan.nodes} if plan else {}
    tags = plan.tags() if plan else {}
    kinds = placeholder_kinds(program)
    backend_colors: dict[str, str] = {}

    def backend_color(backend_id: str) -> str:
        return backend_colors.setdefault(backend_id, DELEGATE_COLORS[len(backend_colors) % len(DELEGATE_COLORS)])

    def tag_backend(tag: str) -> str:
        return plan.partitions[tag].backend_id

    graph = graph_builder.Graph(id=graph_id)
    for node in program.graph.nodes:
        attributes: dict[str, str] = {}
        color = None
        tag = tags.get(node.name)
        if node.op == "placeholder":
            kind = kinds.get(node.name, "input")
            label = node.name
            attributes["kind"] = kind
            color = INPUT_COLOR if kind == "input" else WEIGHT_COLOR
            if tag:
                attributes["placement"] = f"taken over by {tag_backend(tag)}/{tag}"
        elif node.op == "output":
            label = "output"
        elif node.op == "get_attr":
            backend_id = getattr(getattr(program.graph_module, node.target, None), "backend_id", None)
            label = backend_id or node.target
            if backend_id:
                attributes["placement"] = backend_id
                color = backend_color(backend_id)
        elif node.target is executorch_call_delegate:
            backend_id = getattr(getattr(program.graph_module, node.args[0].target, None), "backend_id", "delegate")
            label, attributes["placement"], color = f"{backend_id} call", backend_id, backend_color(backend_id)
        else:
            placement = placements.get(node.name)
            op = placement.op if placement else op_name(node.target)
            label, attributes["op"] = short_op(op), op
            if placement:
                attributes["placement"] = plan.where(placement)
                if placement.reason:
                    attributes["reason"] = placement.reason
            elif tag:
                attributes["placement"] = f"{tag_backend(tag)}/{tag}"
            if plan:
                color = backend_color(tag_backend(tag)) if tag else CPU_COLOR
        if tag:
            attributes["tag"] = tag
        value = value_summary(node.meta.get("val"))
        graph.nodes.append(
            graph_builder.GraphNode(
                id=node.name,
                label=label,
                attrs=[graph_builder.KeyValue(key=k, value=v) for k, v in attributes.items()],
                incomingEdges=[
                    graph_builder.IncomingEdge(sourceNodeId=source.name, targetNodeInputId=str(i))
                    for i, source in enumerate(node.all_input_nodes)
                ],
                outputsMetadata=[
                    graph_builder.MetadataItem(id="0", attrs=[graph_builder.KeyValue(key="tensor_shape", value=value)])
                ]
                if value
                else [],
                style=graph_builder.GraphNodeStyle(backgroundColor=color, borderColor="#555") if color else None,
            )
        )
    return graph


def _import_model_explorer() -> Any:
    return _require_module("model_explorer", "Google's Model Explorer (ai-edge-model-explorer)")


def _require_module(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise UserInputError(f"{what} is not installed ({error})", hint=INSTALL_HINT) from error
