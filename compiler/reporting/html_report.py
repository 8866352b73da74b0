"""The compile report as one self-contained HTML page: the stage table, where every node
runs and why, and the partitioned graph coloured by placement.

The page needs no network: Cytoscape.js and its dagre layout (vendored in
`compiler/assets`, see its README) are inlined, and the graph travels as JSON in a
non-executed script element. Nothing here imports torch, so the CLI can import it
at startup; the program's nodes are read by duck typing.
"""

from __future__ import annotations

import collections
import html
import importlib.resources
import json
import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import attrs

if TYPE_CHECKING:
    from compiler.ir.artifacts import PartitionedProgram
    from compiler.reporting.report import Report

# Inlined in this order: the dagre extension registers itself with the global cytoscape.
_SCRIPTS = ("cytoscape.min.js", "cytoscape-dagre.min.js")

CPU_COLOR = "#9e9e9e"
INPUT_COLOR = "#f9a825"
WEIGHT_COLOR = "#d7ccc8"
OUTPUT_COLOR = "#37474f"
# One colour per delegate partition, in the order the plan first meets its tag.
DELEGATE_COLORS = ("#2e7d32", "#1565c0", "#6a1b9a", "#00838f", "#ad1457", "#ef6c00", "#558b2f", "#283593")


def render_html(
    report: Report, partitioned: PartitionedProgram | None, *, title: str | None = None,
    located: Mapping[str, Any] | None = None,
) -> str:
    """The page for one compile run; without `partitioned` (a run stopped before the
    partition stage) it holds the stage table only. `located` (`Location.highlight()` of
    `compiler.locate`): where the numbers diverge, said above the graph and marked on it."""
    backend = report.config.get("backend")
    heading = title or f"Compile report{f' ({backend})' if backend else ''}"
    sections = [_header(report, heading), _stage_table(report)]
    if located:
        sections.append(f'<h2>Where the numbers diverge</h2>\n<pre id="located">{_text(located["summary"])}</pre>\n')
    if partitioned is not None:
        report = attrs.evolve(report, plan=partitioned.plan)  # the tables and the graph show one plan
        graph = _graph_elements(partitioned, located)
        sections += [_graph_section(graph["legend"]), _placement_table(report), _summary_table(report)]
        scripts = (
            f'<script type="application/json" id="graph-data">{_script_json(graph)}</script>\n'
            + "".join(f"<script>{_asset(name)}</script>\n" for name in _SCRIPTS)
            + f"<script>{_PAGE_SCRIPT}</script>"
        )
    else:
        sections.append('<p class="note">The run stopped before the partition stage: there is no placement to show.</p>')
        scripts = ""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_text(heading)}</title><style>{_STYLE}</style></head>\n"
        f"<body>\n{''.join(sections)}\n{scripts}\n</body></html>\n"
    )


def _asset(name: str) -> str:
    source = importlib.resources.files("compiler").joinpath("assets", name).read_text(encoding="utf-8")
    # The page is one file: a source map it names would be looked for beside it.
    return re.sub(r"//# sourceMappingURL=\S+", "", source)


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _script_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `<`, `>` or `&` can end or open a tag."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _row(cells: Iterable[str], attributes: str = "") -> str:
    return f"<tr{attributes}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>\n"


def _table(table_id: str, header: Iterable[str], rows: str, footer: str = "") -> str:
    head = "".join(f"<th>{_text(h)}</th>" for h in header)
    foot = f"<tfoot>{footer}</tfoot>" if footer else ""
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>\n{rows}</tbody>{foot}</table>\n'


def _header(report: Report, heading: str) -> str:
    facts = []
    if report.config.get("backend"):
        facts.append(("backend", report.config["backend"]))
    if report.config.get("backend_options"):
        facts.append(("backend options", json.dumps(report.config["backend_options"], sort_keys=True)))
    facts += [(name, version) for name, version in report.versions.items()]
    if report.resumed_from:
        facts.append(("resumed from", report.resumed_from))
    facts += [(f"overridden {o.option}", f"{o.recorded!r} -> {o.given!r}") for o in report.overrides]
    items = "".join(f"<dt>{_text(k)}</dt><dd>{_text(v)}</dd>" for k, v in facts)
    return f'<header><h1>{_text(heading)}</h1><dl id="run-facts">{items}</dl></header>\n'


def _stage_table(report: Report) -> str:
    header, rows = report.stage_rows()
    *stage_rows, total = rows
    html = ""
    for record, cells in zip(report.stages, stage_rows):
        messages = (
            f"<details><summary>{len(record.messages)} message(s)</summary><pre>{_text(chr(10).join(record.messages))}</pre></details>"
            if record.messages
            else ""
        )
        html += _row([_text(c) for c in cells] + [messages], f' data-stage="{_text(record.stage)}"')
    footer = "<tr>" + "".join(f"<td>{_text(c)}</td>" for c in total) + "<td></td></tr>"
    return "<h2>Stages</h2>\n" + _table("stages", [*header, "messages"], html, footer)


def _placement_table(report: Report) -> str:
    header, rows = report.node_rows()
    html = "".join(
        _row([_text(c) for c in cells], f' data-node="{_text(cells[0])}" class="{"delegated" if cells[3] != "-" else "cpu"}"')
        for cells in rows
    )
    return (
        f"<h2>Where each op runs</h2>\n<p>{_text(report.format_shares())}</p>\n"
        '<p class="note">Click a row to show the node in the graph.</p>\n'
        + _table("placement", header, html)
    )


def _summary_table(report: Report) -> str:
    header, rows = report.grouped_rows()
    if not rows:
        return ""
    html = "".join(_row(_text(c) for c in cells) for cells in rows)
    return "<h2>Per op</h2>\n" + _table("placement-summary", header, html)


def _graph_section(legend: list[dict[str, str]]) -> str:
    items = "".join(
        f'<li><span class="swatch" style="background:{_text(item["color"])}"></span>{_text(item["label"])}</li>'
        for item in legend
    )
    return (
        "<h2>Graph</h2>\n"
        '<div id="graph-tools"><label><input type="checkbox" id="show-weights" checked> weights and constants</label>'
        '<input type="search" id="graph-search" placeholder="find a node by name (Enter)">'
        '<button type="button" id="graph-fit">fit</button>'
        f'<ul id="legend">{items}</ul></div>\n'
        '<div id="graph-area"><div id="graph"></div>'
        '<aside id="details"><p class="note">Click a node for its op, placement, reason and shape.</p></aside></div>\n'
        '<div id="tooltip" hidden></div>\n'
        '<pre id="rendered-nodes" hidden></pre>\n'
    )


def short_op(op: str) -> str:
    """`aten.convolution.default` -> `convolution`: the op's name without namespace and overload."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 else op


def value_summary(value: Any) -> str:
    """A node's value in brief: dtype and shape of each tensor it holds."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(value_summary(v) for v in value) + ")"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(d) for d in value.shape)}]"
    return "" if value is None else type(value).__name__


def placeholder_kinds(program: Any) -> dict[str, str]:
    """Placeholder name -> "input" (given by the caller) or "weight" (parameter, buffer, constant)."""
    signature = program.graph_signature
    return {spec.arg.name: "input" if spec.kind.name == "USER_INPUT" else "weight" for spec in signature.input_specs}


def _delegate_colors(plan: Any) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Tag -> colour, and the legend's delegate entries: a colour per delegate while the
    palette has one for each, else one per backend (a program can have hundreds of
    delegates; the node's panel still names its own)."""
    from compiler.ir.placement import backend_name

    numbers = plan.delegate_numbers()
    tags = list(numbers)
    backend_of = {tag: backend_name(plan.partitions[tag].backend_id) for tag in tags}
    if len(tags) <= len(DELEGATE_COLORS):
        colors = {tag: DELEGATE_COLORS[i] for i, tag in enumerate(tags)}
        return colors, [{"label": f"{backend_of[tag]} delegate {numbers[tag]}", "color": colors[tag]} for tag in tags]
    backends = list(dict.fromkeys(backend_of.values()))
    backend_colors = {b: DELEGATE_COLORS[i % len(DELEGATE_COLORS)] for i, b in enumerate(backends)}
    delegates = collections.Counter(backend_of.values())
    legend = [{"label": f"{b} ({delegates[b]} delegates)", "color": backend_colors[b]} for b in backends]
    return {tag: backend_colors[backend_of[tag]] for tag in tags}, legend


def _graph_elements(partitioned: PartitionedProgram, located: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Cytoscape's elements for the program, each node coloured by where it runs, and the legend;
    the diverging node `located` names and its path from the inputs marked, with their errors."""
    path = {step["node"]: step for step in (located or {}).get("path", ())}
    diverging = (located or {}).get("node")
    plan = partitioned.plan
    placed = {n.node: n for n in plan.described()}
    words = {n.tag: n.where for n in placed.values() if n.tag}
    tags = plan.tags()
    colors, legend = _delegate_colors(plan)
    kinds = placeholder_kinds(partitioned.program)

    nodes, edges = [], []
    for node in partitioned.program.graph.nodes:
        data: dict[str, Any] = {"id": node.name, "value": value_summary(node.meta.get("val"))}
        tag = tags.get(node.name)
        if node.op == "placeholder":
            kind = kinds.get(node.name, "input")
            data |= {"label": node.name, "kind": kind, "op": kind, "color": INPUT_COLOR if kind == "input" else WEIGHT_COLOR}
            data["where"] = f"taken over by {words[tag]}" if tag in words else (
                "given at run time" if kind == "input" else "CPU (stored in the program)"
            )
            data["border"] = colors.get(tag, "#555")
        elif node.op == "output":
            data |= {"label": "output", "kind": "output", "op": "output", "where": "", "color": OUTPUT_COLOR}
        else:
            placement = placed.get(node.name)
            op = placement.op if placement else str(getattr(node.target, "__name__", node.target))
            data |= {"label": short_op(op), "kind": "op", "op": op, "color": colors.get(tag, CPU_COLOR)}
            data["where"] = placement.where if placement else words.get(tag, "CPU")
            if placement and placement.tag:
                data["delegate"] = f"{placement.backend_id}/{placement.tag}"
            if placement and placement.reason and not placement.tag:
                data["reason"] = placement.reason
        if node.name in path or node.name == diverging:
            data["located"] = "diverging" if node.name == diverging else "path"
            step = path.get(node.name, {})
            if step.get("error") is not None:
                data["error"] = f"{step['error']:.3g} (tolerance {step['tolerance']:.3g})"
        data["w"] = max(40, 7 * len(data["label"]) + 16)
        nodes.append({"data": data})
        edges += [
            {"data": {"id": f"{source.name}->{node.name}", "source": source.name, "target": node.name}}
            for source in node.all_input_nodes
        ]
    if diverging:
        legend.append({"label": "diverges first (red border; its path from the inputs: orange)", "color": "#d50000"})
    legend += [
        {"label": "CPU", "color": CPU_COLOR},
        {"label": "input", "color": INPUT_COLOR},
        {"label": "weight / constant (border: the delegate that takes it over)", "color": WEIGHT_COLOR},
        {"label": "output", "color": OUTPUT_COLOR},
    ]
    return {"nodes": nodes, "edges": edges, "legend": legend}


_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 16px 24px; color: #212121; }
h1 { font-size: 20px; margin: 0 0 6px; } h2 { font-size: 16px; margin: 22px 0 8px; }
dl#run-facts { display: flex; flex-wrap: wrap; gap: 2px 18px; margin: 0; color: #555; }
dl#run-facts dt { font-weight: 600; } dl#run-facts dt::after { content: ":"; } dl#run-facts dd { margin: 0 0 0 -14px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #e0e0e0; padding: 3px 10px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; position: sticky; top: 0; }
tfoot td { font-weight: 600; }
#placement tbody tr { cursor: pointer; } #placement tbody tr:hover { background: #fffde7; }
#placement tr.cpu td:nth-child(3) { color: #b71c1c; }
#placement tr.selected { background: #fff59d; }
.note { color: #666; font-size: 12px; margin: 4px 0; }
pre { white-space: pre-wrap; font-size: 12px; margin: 4px 0; }
#graph-tools { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 16px; margin-bottom: 6px; }
#graph-search { width: 260px; }
#legend { list-style: none; display: flex; flex-wrap: wrap; gap: 4px 14px; padding: 0; margin: 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 3px; margin-right: 5px; vertical-align: -1px; border: 1px solid #0003; }
#graph-area { display: flex; gap: 10px; height: 600px; }
#graph { flex: 1; border: 1px solid #ccc; border-radius: 4px; min-width: 0; }
#details { width: 320px; overflow: auto; border: 1px solid #ccc; border-radius: 4px; padding: 8px 10px; font-size: 13px; }
#details dt { font-weight: 600; margin-top: 6px; } #details dd { margin: 0; word-break: break-word; }
#tooltip { position: fixed; pointer-events: none; background: #263238; color: #fff; padding: 4px 8px;
  border-radius: 4px; font-size: 12px; max-width: 420px; z-index: 10; white-space: pre-line; }
"""

# Builds the graph from #graph-data, lays it out with dagre, and wires hover, click and
# the placement table. After layout it records what it drew (body data attributes and
# #rendered-nodes), which the tests read from the DOM.
_PAGE_SCRIPT = """
(function () {
  const graph = JSON.parse(document.getElementById('graph-data').textContent);
  const started = performance.now();
  const large = graph.nodes.length > 1500;
  const cy = window.cy = cytoscape({
    container: document.getElementById('graph'),
    elements: { nodes: graph.nodes, edges: graph.edges },
    wheelSensitivity: 0.3, pixelRatio: 1,
    textureOnViewport: large, hideEdgesOnViewport: large,
    style: [
      { selector: 'node', style: {
          'shape': 'round-rectangle', 'width': 'data(w)', 'height': 24,
          'background-color': 'data(color)', 'label': 'data(label)', 'color': '#fff',
          'font-size': 11, 'text-valign': 'center', 'text-halign': 'center', 'min-zoomed-font-size': 6,
          'border-width': 1, 'border-color': '#0004' } },
      { selector: 'node[kind = "input"]', style: { 'shape': 'ellipse', 'color': '#212121' } },
      { selector: 'node[kind = "weight"]', style: {
          'width': 14, 'height': 14, 'shape': 'ellipse', 'label': '', 'border-width': 2, 'border-color': 'data(border)' } },
      { selector: 'node[kind = "output"]', style: { 'shape': 'ellipse' } },
      { selector: 'node[reason]', style: { 'border-width': 2, 'border-color': '#b71c1c' } },
      { selector: 'node[located = "path"]', style: { 'border-width': 3, 'border-color': '#ff6d00' } },
      { selector: 'node[located = "diverging"]', style: { 'border-width': 5, 'border-color': '#d50000' } },
      { selector: 'edge', style: {
          'width': 1, 'line-color': '#b0bec5', 'target-arrow-color': '#b0bec5',
          'target-arrow-shape': 'triangle', 'arrow-scale': 0.7, 'curve-style': 'bezier' } },
      { selector: ':selected', style: { 'underlay-color': '#ffd600', 'underlay-opacity': 0.9, 'underlay-padding': 5 } },
      { selector: '.hidden', style: { 'display': 'none' } },
    ],
  });

  cy.one('layoutstop', function () {
    initialView();
    document.getElementById('rendered-nodes').textContent = JSON.stringify(cy.nodes().map(n => n.id()));
    document.body.dataset.graphNodes = cy.nodes().length;
    document.body.dataset.graphEdges = cy.edges().length;
    document.body.dataset.layoutMs = Math.round(performance.now() - started);
  });
  cy.layout({ name: 'dagre', rankDir: 'TB', nodeSep: 12, rankSep: 28, animate: false }).run();

  // The whole graph when it is readable so, else its top (the inputs) at a readable zoom.
  function initialView() {
    cy.fit(undefined, 20);
    if (cy.zoom() >= 0.5) return;
    const top = cy.nodes().min(n => n.position('y')).ele;
    cy.zoom(0.8);
    cy.pan({ x: cy.width() / 2 - top.position('x') * 0.8, y: 30 - top.position('y') * 0.8 });
  }

  const fields = [['node', 'id'], ['op', 'op'], ['runs on', 'where'], ['delegate', 'delegate'], ['why on the CPU', 'reason'], ['value', 'value'], ['error against the last good stage', 'error']];
  function describe(node) {
    return fields.filter(([, key]) => node.data(key)).map(([name, key]) => name + ': ' + node.data(key)).join('\\n');
  }
  function show(node) {
    const panel = document.getElementById('details');
    panel.replaceChildren();
    const list = document.createElement('dl');
    const names = nodes => nodes.map(n => n.id()).join(', ') || '-';
    for (const [name, text] of fields.map(([n, k]) => [n, node.data(k)]).concat(
        [['inputs', names(node.incomers('node'))], ['users', names(node.outgoers('node'))]])) {
      if (!text) continue;
      const dt = document.createElement('dt'); dt.textContent = name;
      const dd = document.createElement('dd'); dd.textContent = text;
      list.append(dt, dd);
    }
    panel.append(list);
    document.querySelectorAll('#placement tr.selected').forEach(r => r.classList.remove('selected'));
    const row = document.querySelector('#placement tr[data-node="' + CSS.escape(node.id()) + '"]');
    if (row) row.classList.add('selected');
  }
  function focus(node) {
    cy.elements().unselect();
    node.select();
    cy.animate({ center: { eles: node }, zoom: Math.max(cy.zoom(), 1) }, { duration: 250 });
    show(node);
  }

  const tooltip = document.getElementById('tooltip');
  cy.on('mouseover', 'node', e => { tooltip.textContent = describe(e.target); tooltip.hidden = false; });
  cy.on('mouseout', 'node', () => { tooltip.hidden = true; });
  cy.on('mousemove', e => {
    tooltip.style.left = (e.originalEvent.clientX + 14) + 'px';
    tooltip.style.top = (e.originalEvent.clientY + 14) + 'px';
  });
  cy.on('tap', 'node', e => show(e.target));

  document.querySelectorAll('#placement tbody tr').forEach(row => row.addEventListener('click', () => {
    const node = cy.getElementById(row.dataset.node);
    if (node.nonempty()) { document.getElementById('graph').scrollIntoView({ behavior: 'smooth' }); focus(node); }
  }));
  document.getElementById('graph-search').addEventListener('keydown', e => {
    if (e.key !== 'Enter' || !e.target.value) return;
    const wanted = e.target.value.toLowerCase();
    const node = cy.nodes().filter(n => n.id().toLowerCase().includes(wanted)).first();
    if (node.nonempty()) focus(node);
  });
  document.getElementById('show-weights').addEventListener('change', e => {
    cy.nodes('[kind = "weight"]').toggleClass('hidden', !e.target.checked);
  });
  document.getElementById('graph-fit').addEventListener('click', () => cy.fit(undefined, 20));
  // The diverging node (else the first CPU op) explains itself in the panel before anything is clicked.
  const first = cy.nodes('[located = "diverging"]').first().nonempty() ? cy.nodes('[located = "diverging"]').first() : cy.nodes('[reason]').first();
  if (first.nonempty()) { first.select(); show(first); }
})();
"""
