"""Where a wrong result of ours goes wrong: `compiler.locate` run on the fuzzed program.

A wrong result the campaign finds (ours compiled and ran, and an output is off eager's) is
compiled again the way the oracle compiled it and located: the stage whose program first
leaves eager's outputs and the node there (`compiler.tools.locate`). The finding keeps the
Location as JSON and one paragraph saying it; a locate that raises keeps the error instead, so
the finding is never lost to it.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

import compiler
from compiler.tools.fuzz import oracle
from compiler.tools.fuzz.programs import Program, Reproducer

ON_ITSELF = "this program"  # a finding located on its own program (not on a shrunk one of its kind)


@attrs.frozen
class Placed:
    """What locate said of one program: its Location as JSON and in a paragraph, or the error it raised."""

    location: dict | None
    error: str | None
    paragraph: str
    seconds: float


def locate(program: Program | Reproducer, backend: str) -> Placed:
    """Compile `program` as `oracle.ours` does and locate where its outputs leave eager's."""
    start = time.perf_counter()
    try:
        model, inputs = program.build()
        options: dict[str, Any] = {}
        if program.quantization:
            options = program.quantization.options() | {"calibration": oracle._calibration(program, inputs)}
        with oracle._quiet():
            location = compiler.locate(model, inputs, backend, backend_options=oracle.backend_options(backend), **options)
    except Exception as error:  # the finding stands; what locate could not do is recorded
        text = oracle._first_line(error)
        return Placed(None, text, f"locate failed: {text}", time.perf_counter() - start)
    return Placed(location.to_json(), None, paragraph(location), time.perf_counter() - start)


def _error(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3g}"


def paragraph(location: Any) -> str:
    """A Location in one paragraph: the stage, the node, its op and errors, where it came from."""
    if location.stage is None:
        return (f"locate: every stage's outputs agree with eager on the program's inputs (located in "
                f"{location.seconds:.1f} s): the wrong result shows only past its first call, or the stages' runs "
                "differ from the oracle's.")
    text = f"locate: the outputs first diverge from eager at stage {location.stage!r}"
    d = location.divergence
    if d is None:
        return f"{text}; no node named: {location.note or 'no reason given'}; located in {location.seconds:.1f} s."
    inside = f", inside delegate {d.delegate}" if d.delegate else ""
    text += (f", at node {d.node} ({d.op}){inside}: output error {d.output_error:.3g} over the tolerance "
             f"{d.tolerance:.3g} ({d.reference})")
    if d.input_errors:
        text += "; input errors " + ", ".join(f"{name} {_error(e)}" for name, e in d.input_errors)
    if d.source:
        text += f"; source {d.source}"
    if d.module:
        text += f"; module {d.module}"
    return f"{text}; found by {d.found_by}; located in {location.seconds:.1f} s."
