"""Bisection by node inside the emitted program, when the lowered program agrees with eager and
the `.pte` does not.

Every stage before emit ran its CPU ops as torch ops; the `.pte` runs the runtime's own kernels
(the portable kernels), so a kernel that computes otherwise than torch shows first here. The
runtime shows no values between instructions, so the emitted program is cut (`cut.py`, span
EMIT): the lowered program with a suspect node's value as an extra output is emitted again and
run whole under the runtime, and its value compared with the lowered program's node, run in the
fx interpreter. A binary search over the diverging output's ancestors (topological order) finds
the first node over its tolerance in about log2(n) emits; one more, with the path to it and its
inputs as outputs, gives the chain of errors.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch.export.graph_signature import OutputKind

from compiler.tools.locate import compare, cut, nodes
from compiler.tools.locate.programs import run_exported, run_pte
from compiler.tools.locate.report import Divergence, Step

logger = logging.getLogger(__name__)

STAGE = "lower"  # the program the emitted one is compared with, node by node


def _user_outputs(program: Any) -> list[torch.fx.Node | None]:
    """The program's user outputs' nodes, in order (None: a constant output)."""
    returned = program.graph.output_node().args[0]
    specs = program.graph_signature.output_specs
    return [
        value if isinstance(value, torch.fx.Node) else None
        for value, spec in zip(returned, specs) if spec.kind == OutputKind.USER_OUTPUT
    ]


def _computed(node: torch.fx.Node) -> bool:
    """A node the emitted program computes with its own instruction: a CPU op (a kernel call) or
    a value a delegate call returns (the call itself returns several)."""
    return getattr(node.target, "__name__", None) != nodes.DELEGATE_CALL


def inside(
    result: Any, backend: Any, inputs: Sequence[Any], dtype: torch.dtype, sources: Sequence[Any]
) -> tuple[Divergence | None, tuple[Step, ...], str | None]:
    """The first node of the lowered program whose value, as the emitted program computes it under
    the runtime, leaves the tolerance against the lowered program's own (run in the fx interpreter);
    the path to it; or why none was named."""
    lowered, emitted = result.stages.get(STAGE), result.stages.emit
    if lowered is None or emitted is None or not hasattr(lowered, "program"):
        return None, (), "the lowered program is not kept: the emitted program cannot be cut"
    good = lowered.program
    good_run = run_exported(good, inputs, keep=True)
    bad_run = run_pte(emitted, inputs)
    returned = _user_outputs(good)
    if len(returned) != len(bad_run.outputs):
        return None, (), (f"the emitted program returns {len(bad_run.outputs)} outputs where the lowered one "
                          f"returns {len(returned)}: the emitter changed the program's outputs")
    diverging = None
    for node, got, want in zip(returned, bad_run.outputs, good_run.outputs):
        e = compare.error(got, want)
        if node is not None and (e is None or e > compare.tolerance(bad_run, dtype, [got], [want]).absolute):
            diverging = node
            break
    if diverging is None:
        return None, (), ("the emitted program's outputs agree with the lowered program's here, though not with "
                          "eager's: no output to cut at")
    order = cut.ancestors(good, diverging.name, _computed)
    if not order:
        return None, (), f"the diverging output {diverging.name} is computed by no instruction of the program"
    cutter = cut.Cut(lowered, backend, result.config, tuple(inputs), span=cut.EMIT)
    suspect = cut.first_over(order, lambda name: cutter.diverges(name, good_run.values, bad_run, dtype))
    # One more emit: the suspect, its inputs and the path from the inputs to it, so the chain of
    # errors is measured and the suspect's inputs are seen within their tolerance.
    probed_from = {n.name for n in order}
    route = [n.name for n in nodes.path_to(suspect, nodes.NodeErrors({}, {}), nodes.weights(good))]
    probed = [n for n in route if n in probed_from] + [n.name for n in suspect.all_input_nodes if n.name in probed_from]
    values = cutter.values(list(dict.fromkeys(probed)))
    same = {n: n for n in values}
    errors = nodes.node_errors(good.graph.nodes, same, values, good_run.values, bad_run, dtype)
    node = nodes.first_diverging(good, errors)
    if node is None:
        return None, (), (f"cutting the emitted program at {suspect.name} and the path to it measured no node over "
                          "its tolerance: the divergence shows only in the whole program (memory planning?)")
    seconds = sum(s for _, s in cutter.lowerings)
    found_by = (f"cutting the emitted program: {len(cutter.lowerings)} emits of the lowered program with a node's "
                f"value as an extra output, each run under the runtime ({seconds:.1f} s)")
    divergence = nodes.divergence_at(
        node, errors, [good, *sources], f"against the {STAGE} program's {node.name} (fx interpreter)", found_by,
    )
    return divergence, nodes.steps(nodes.path_to(node, errors, nodes.weights(good)), errors), None
