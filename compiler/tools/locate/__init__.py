"""`locate`: when a program's numbers differ from eager, the first stage and the first node
that diverge, inside a delegate too, and the chain of errors from the inputs to it.

    location = compiler.locate(model, (x,), backend="coreml")
    print(location.describe())

By stage (`stages.py`): eager and every kept stage's program on the same inputs, each held
to the tolerance for what it computes in. By node (`nodes.py`): the diverging stage's program
and the last good stage's, node by node, matched through provenance. Inside a delegate: the
backend's `intermediate_values` hook (`compiler.backends.intermediate_values`) where it has
one, else a cut (`cut.py`): the partition lowered again with the suspect node as an output.
Inside the emitted program (a runtime CPU kernel computing otherwise than torch): a cut too
(`emitted.py`), the lowered program emitted again with the suspect node as an output.
A `.pte` compiled elsewhere (`locate_program`, `pte.py`): run whole against eager, and node by
node against the model exported and lowered as stock does, through the reference executor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import torch

from compiler import backends
from compiler.ir.errors import CompileError
from compiler.tools.locate import compare, cut, emitted, nodes, refused, stages
from compiler.tools.locate.programs import run_eager, run_exported, user_leaves
from compiler.tools.locate.report import Divergence, Location, StageError, Step
from compiler.tools.locate.pte import locate_program
from compiler.ir.private_api import delegate_named_data

logger = logging.getLogger(__name__)

__all__ = ["Divergence", "Location", "StageError", "Step", "locate", "locate_program", "locate_result"]


def locate(model: torch.nn.Module, inputs: Any, backend: Any = None, *, tolerance: float | None = None,
           **options: Any) -> Location:
    """Compile `model` for `backend` (a name or a Backend object; options as `compiler.compile`
    takes them) and locate where its program's outputs first leave eager's (by more than
    `tolerance`, absolute, when given: else each stage's own)."""
    from compiler.api import compile

    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    result = compile(model, inputs, backend, **options)
    return locate_result(result, model, inputs, backend=backend if isinstance(backend, backends.Backend) else None,
                         tolerance=tolerance)


def _sources(result: Any) -> list:
    """The kept programs, earliest first: where a node's source line is looked up."""
    from compiler.stages import STAGE_NAMES

    programs = []
    for name in STAGE_NAMES:
        program = getattr(result.stages.get(name), "program", None)
        if hasattr(program, "graph_signature") and all(program is not p for p in programs):
            programs.append(program)
    return programs


def locate_result(
    result: Any, model: torch.nn.Module, inputs: Any, *, backend: Any = None, tolerance: float | None = None
) -> Location:
    """Locate the divergence of an existing CompileResult's stages from `model` on `inputs`.
    `backend`: the Backend object it was compiled with, when not the one its configuration names
    (the cut inside a delegate lowers again with it)."""
    from compiler.process.dependency_output import DependencyOutput

    with DependencyOutput() as output:
        location = _locate(result, model, inputs, backend, tolerance)
        # A Core ML program computing in float16 hides a conversion fault below float16's noise:
        # the same partitions converted computing in float32 (as the check does) are located too.
        remake = getattr(result, "at_float32", None)
        variant = remake() if not location.found and callable(remake) else None
        if variant is not None:
            at_float32 = _locate(variant, model, inputs, None, tolerance)
            if at_float32.found:
                note = ("found in the same partitions converted computing in float32 (the float16 program's "
                        "outputs are within float16's tolerance)")
                location = attrs.evolve(at_float32, note=f"{at_float32.note}; {note}" if at_float32.note else note,
                                        seconds=location.seconds + at_float32.seconds)
    logger.debug("while locating, dependencies printed: %s", output.leftover)
    return location


def _locate(result: Any, model: torch.nn.Module, inputs: Any, backend: Any, tolerance: float | None) -> Location:
    start = time.perf_counter()
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    quantized = result.stages.quantize
    reference = quantized.module if getattr(quantized, "float_module", None) is not None else model
    dtype = compare.model_dtype(reference, user_leaves(inputs))
    expected = run_eager(reference, inputs)
    found = stages.by_stage(result.stages, expected, inputs, dtype, tolerance)
    name = result.config.backend
    if found.first_bad is None:
        return Location(name, found.rows, seconds=time.perf_counter() - start)
    if found.refused is not None:  # a payload its runner refuses to run: the refusal is the divergence
        divergence, path, note = refused.located(found.refused, _sources(result))
        return Location(name, found.rows, found.first_bad, divergence, path, note, time.perf_counter() - start)
    if found.last_good is None:
        note = (
            f"the first kept program ({found.first_bad}) already differs from eager: node values are compared "
            "between programs, and eager has none to compare with"
        )
        return Location(name, found.rows, found.first_bad, note=note, seconds=time.perf_counter() - start)
    if found.first_bad == "emit":  # the runtime's own CPU kernels, or the emitter: cut the emitted program
        backend_obj = backend or backends.resolve(name, result.config.backend_options)
        divergence, path, note = emitted.inside(result, backend_obj, inputs, dtype, _sources(result))
        return Location(name, found.rows, "emit", divergence, path, note, time.perf_counter() - start)
    good = result.stages[found.last_good].program
    bad = result.stages[found.first_bad].program
    good_run = run_exported(good, inputs, keep=True)
    bad_run = run_exported(bad, inputs, keep=True)
    sources = _sources(result)
    finding = nodes.by_node(found.last_good, good, good_run, bad, bad_run, dtype, sources)
    divergence, path, note = finding.divergence, finding.path, finding.note
    if finding.delegate_call is not None:
        backend_obj = backend or backends.resolve(name, result.config.backend_options)
        divergence, path, note = _inside_delegate(
            finding, result, backend_obj, good, good_run, bad, bad_run, inputs, dtype, sources, found.last_good
        )
    return Location(name, found.rows, found.first_bad, divergence, path, note, time.perf_counter() - start)


def _inside_delegate(finding, result, backend, good, good_run, bad, bad_run, inputs, dtype, sources, good_name):
    """The payload op whose value diverges first inside the delegate call the node bisection named:
    through the backend's hook when it has one, else by cutting the delegate."""
    call = next(n for n in bad.graph.nodes if n.name == finding.delegate_call)
    lowered = getattr(bad.graph_module, call.args[0].target)
    delegate = f"{call.name} ({lowered.backend_id})"
    outputs = nodes.delegate_outputs(bad)
    diverging = [outputs[s.node] for s in finding.path if s.over and s.node in outputs]
    inside = [n.name for n in lowered.original_module.graph.nodes if n.op == "call_function"]
    hook = backends.intermediate_values(lowered.backend_id)
    if hook is not None:
        given = [bad_run.values[a.name] for a in call.args[1:] if isinstance(a, torch.fx.Node)]
        data = delegate_named_data(lowered)
        try:
            values = hook(lowered.processed_bytes, given, data, program=lowered.original_module)
            found_by = f"the {lowered.backend_id} payload's intermediate values"
        except CompileError as exc:  # the hook cannot read this payload: cut it instead
            logger.info("locate: %s cannot read its payload's values (%s); cutting it", lowered.backend_id, exc.reason)
            values, found_by = None, None
    else:
        values, found_by = None, None
    split = result.stages.split_constants
    if values is None:
        if split is None or split.program is not good or not diverging:
            return None, finding.path, (finding.note or "") + "; the split_constants program is not kept: no cut"
        tag = cut.tag_of(good, inside)
        order = cut.candidates(good, tag, diverging[0])
        cutter = cut.Cut(split, backend, result.config, inputs)
        try:
            suspect = cut.first_over(order, lambda name: cutter.diverges(name, good_run.values, bad_run, dtype))
            errors0 = nodes.NodeErrors({}, {})
            route = [n.name for n in nodes.path_to(suspect, errors0, nodes.weights(good))]
            inside_names = {c.name for c in order}
            probed = [n for n in route if n in inside_names] + [n.name for n in suspect.all_input_nodes if n.name in inside_names]
            values = cutter.observable_values(list(dict.fromkeys(probed)))
        except CompileError as exc:  # the backend cannot lower the partition with that value leaving it
            names = ", ".join(cutter.failed or ("?",))
            return None, finding.path, (f"{finding.note}; the delegate could not be cut: lowering it again with {names} "
                                        f"as an extra output failed ({exc.reason.splitlines()[0]})")
        found_by = (f"cutting the delegate: {len(cutter.lowerings)} lowerings of the partition with a node's value "
                    f"as an extra output ({sum(s for _, s in cutter.lowerings):.1f} s)")
        if cutter.fused:
            found_by += (f"; {', '.join(dict.fromkeys(cutter.fused))} could not leave the delegate (the backend fuses "
                         "them into the ops that read them): no value of their own")
    # Values inside the payload (and those the lowered program gave at its boundary) against the
    # program before lowering, node by node in its order.
    measured = {**{outputs[k]: v for k, v in bad_run.values.items() if k in outputs},
                **{n: bad_run.values[n] for n in bad_run.values if n in good_run.values and n not in outputs},
                **values}
    same = {n: n for n in measured}
    errors = nodes.node_errors(good.graph.nodes, same, measured, good_run.values, bad_run, dtype)
    node = nodes.first_diverging(good, errors)
    if node is None:
        return None, finding.path, f"{finding.note}; no node inside it measured over its tolerance"
    route = nodes.path_to(node, errors, nodes.weights(good))
    divergence = nodes.divergence_at(
        node, errors, [good, *sources], f"against the {good_name} program's {node.name}", found_by, delegate,
    )
    ops = getattr(values, "ops", {})  # what the hook says computes it (the op an item came from)
    payload_op = ops.get(divergence.node) or ops.get(node.name)
    return attrs.evolve(divergence, payload_op=payload_op), nodes.steps(route, errors), None
