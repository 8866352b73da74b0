"""A delegate whose payload its reference runner refuses to run (a MIL op whose operands do not
fit it, an output bound to an input, an MLX instruction reading a slot nothing wrote): there is
no value to compare, and the refusal is itself the divergence. The lowered stage is named, and
the Edge node whose payload op the runner refused: the backend's `refused_node` (beside its
`intermediate_values` hook, `compiler/backends/<backend>/taps.py`) maps the op, var or slot the
runner's error names back to the node of the delegate's original program, as the hook maps its
values."""

from __future__ import annotations

import importlib
import logging
from typing import Any, Sequence

import attrs

from compiler import backends
from compiler.ir.errors import CompileError
from compiler.tools.locate import nodes
from compiler.tools.locate.programs import PayloadRefused
from compiler.tools.locate.report import Divergence, Step
from compiler.ir.private_api import delegate_named_data

logger = logging.getLogger(__name__)


def _mapper(backend_id: str) -> Any:
    hook = backends.intermediate_values(backend_id)
    if hook is None:
        return None
    return getattr(importlib.import_module(hook.__module__), "refused_node", None)


def located(refused: PayloadRefused, sources: Sequence[Any]) -> tuple[Divergence | None, tuple[Step, ...], str | None]:
    """The divergence a payload's refusal makes: at the Edge node whose payload op was refused
    (a multi-output op's item named as the op), the refusal as its output."""
    lowered, refusal = refused.lowered, refused.refusal
    program = lowered.original_module
    delegate = f"{refused.call} ({lowered.backend_id})"
    reason = f"the payload cannot run: {refusal.reason}"
    mapper = _mapper(lowered.backend_id)
    found = None
    if mapper is not None:
        data = delegate_named_data(lowered)
        try:
            found = mapper(lowered.processed_bytes, refusal, data, program=program)
        except CompileError as exc:
            logger.info("locate: the %s refusal names no node (%s)", lowered.backend_id, exc.reason)
    by_name = {n.name: n for n in program.graph.nodes}
    if found is None or found[0] not in by_name:
        note = f"delegate call {delegate}: {reason}; which of its nodes the refused payload op came from is not known"
        return None, (), note
    node = nodes.producer(by_name[found[0]])
    errors = nodes.NodeErrors({node.name: float("inf")}, {node.name: 0.0})
    route = nodes.path_to(node, errors, nodes.weights(program))
    divergence = nodes.divergence_at(
        node, errors, [program, *sources], "", f"the {lowered.backend_id} reference runner's refusal", delegate,
    )
    return attrs.evolve(divergence, payload_op=found[1], reason=reason), nodes.steps(route, errors), None
