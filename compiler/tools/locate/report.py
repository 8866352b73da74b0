"""What `locate` found, as a frozen artifact: each stage's error against eager, the first stage
that leaves its tolerance, the first node there whose output does while its inputs do not, and
the chain of errors from the inputs to it. Rendered for the terminal (`describe`), as JSON, and
as the few fields the HTML report highlights on the graph (`highlight`)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class StageError:
    """One stage's outputs against eager: how its program ran, its largest error, the tolerance
    for what it computes in (None for a stage that handed on the program before it)."""

    stage: str
    ran: str  # "fx interpreter", "fx interpreter, delegates on ...", "runtime", "same program as <stage>"
    max_error: float | None = None
    tolerance: float | None = None
    rule: str | None = None
    passed: bool | None = None

    def cells(self) -> tuple[str, ...]:
        if self.passed is None:
            return (self.stage, self.ran, "-", "-", "-")
        error = "n/a" if self.max_error is None else f"{self.max_error:.3g}"
        tolerance = "-" if self.tolerance is None else f"{self.tolerance:.3g}"
        return (self.stage, self.ran, error, tolerance, "ok" if self.passed else "DIVERGES")


@attrs.frozen
class Step:
    """A node on the path from the inputs to the diverging node, with its error against the
    reference program (None: not measured there, e.g. inside a payload the cut did not open)."""

    node: str
    op: str
    error: float | None = None
    tolerance: float | None = None

    @property
    def over(self) -> bool:
        return self.error is not None and self.tolerance is not None and self.error > self.tolerance

    def text(self) -> str:
        if self.error is None:
            return f"{self.node} ({self.op}): not measured"
        mark = "  <-- over the tolerance" if self.over else ""
        return f"{self.node} ({self.op}): {self.error:.3g} (tolerance {self.tolerance:.3g}){mark}"


@attrs.frozen
class Divergence:
    """The first node whose output leaves the tolerance while its inputs are within it."""

    node: str
    op: str
    output_error: float
    tolerance: float
    input_errors: tuple[tuple[str, float | None], ...] = ()
    source: str | None = None  # "file:line: code" of the user's or library's frame
    module: str | None = None  # the nn.Module path and class it ran in
    delegate: str | None = None  # "<delegate call node> (<backend id>)" when found inside a payload
    found_by: str = "node values"  # how its value was read
    reference: str = ""  # the program its value was compared with
    payload_op: str | None = None  # inside a payload: the op(s) computing it there ("gelu (mode EXACT)")
    # What diverges when it is not a number: "dtype bool where torch gives float32", "shape (1, 4)
    # where torch gives (1, 4, 4)", "the payload cannot run: <the runner's reason>" (the error is inf).
    reason: str | None = None

    def lines(self, heading: str = "node", indent: str = "") -> list[str]:
        """The node, its error against the reference, its inputs' errors, where it came from."""
        inside = f", inside delegate {self.delegate}" if self.delegate else ""
        lines = [f"{indent}{heading}: {self.node} ({self.op}){inside}"]
        if self.reason:
            lines.append(f"  output: {self.reason}" + (f" ({self.reference})" if self.reference else ""))
        else:
            lines.append(f"  output error {self.output_error:.3g} over the tolerance {self.tolerance:.3g} ({self.reference})")
        if self.input_errors:
            given = ", ".join(f"{n} {'?' if e is None else f'{e:.3g}'}" for n, e in self.input_errors)
            lines.append(f"  input errors: {given}")
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.module:
            lines.append(f"  module: {self.module}")
        lines.append(f"  found by: {self.found_by}")
        if self.payload_op:
            lines.append(f"  payload op: {self.payload_op}")
        return [lines[0]] + [indent + line for line in lines[1:]]


@attrs.frozen
class Location:
    """Where a program's numbers first leave eager's: the stage, the node, the path to it."""

    backend: str
    stages: tuple[StageError, ...]
    stage: str | None = None  # None: every stage agrees with eager
    divergence: Divergence | None = None
    path: tuple[Step, ...] = ()
    note: str | None = None  # why no node was named, or what was not measured
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return self.stage is not None

    def stage_rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        return ("stage", "ran as", "max abs error", "tolerance", ""), [s.cells() for s in self.stages]

    def describe(self) -> str:
        """The finding in a few lines, for the terminal (the stage table is `stage_rows`)."""
        if self.stage is None:
            return f"locate: every stage's outputs agree with eager ({self.seconds:.1f} s)"
        lines = [f"locate: the outputs first diverge from eager at stage {self.stage!r} ({self.seconds:.1f} s)"]
        if self.divergence is not None:
            lines += self.divergence.lines(heading="first diverging node")
        if self.path:
            lines.append("path from the inputs:")
            lines += [f"  {step.text()}" for step in self.path]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def highlight(self) -> dict[str, Any] | None:
        """What the HTML report marks on the partitioned graph: the diverging node (or, inside a
        delegate, the payload op's Edge node) and the path's nodes with their errors."""
        if self.stage is None:
            return None
        d = self.divergence
        return {
            "stage": self.stage,
            "node": d.node if d else None,
            "summary": self.describe(),
            "path": [{"node": s.node, "error": s.error, "tolerance": s.tolerance} for s in self.path],
        }
