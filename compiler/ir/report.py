"""The compile report: per-stage timing and node counts, the placement summary, and the
configuration the run used (with what a resume changed)."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from compiler.ir.placement import OpSummary


@attrs.frozen
class StageRecord:
    stage: str
    seconds: float
    verify_seconds: float = 0.0
    nodes_in: int | None = None
    nodes_out: int | None = None
    delegates: int | None = None
    cpu_ops: int | None = None
    # What the stage itself reported (e.g. the fold stage's constants created).
    metrics: Mapping[str, Any] = attrs.field(factory=dict)
    # What the dependencies printed, warned or logged while the stage ran (kept off the terminal).
    messages: tuple[str, ...] = ()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


@attrs.frozen
class Override:
    """An option of a resumed run that differs from the one its stage file recorded."""

    option: str
    recorded: Any
    given: Any

    def __str__(self) -> str:
        return f"{self.option}: {self.recorded!r} -> {self.given!r}"


@attrs.frozen
class Report:
    stages: tuple[StageRecord, ...] = ()
    placement: tuple[OpSummary, ...] = ()
    # The compile configuration (as JSON) and the dependency versions the run used.
    config: Mapping[str, Any] = attrs.field(factory=dict)
    versions: Mapping[str, Any] = attrs.field(factory=dict)
    # Set when the run resumed from a stage file: its path, and what differs from the
    # recorded run (options given, dependency versions installed).
    resumed_from: str | None = None
    overrides: tuple[Override, ...] = ()

    def stage(self, name: str) -> StageRecord:
        for record in self.stages:
            if record.stage == name:
                return record
        raise KeyError(f"no stage {name!r} in this report; ran: {[r.stage for r in self.stages]}")

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.stages)

    def format_stages(self) -> str:
        header = ["stage", "time s", "verify s", "nodes in", "nodes out", "delegates", "cpu ops", "notes"]
        rows = [
            [
                r.stage,
                _cell(r.seconds),
                _cell(r.verify_seconds),
                _cell(r.nodes_in),
                _cell(r.nodes_out),
                _cell(r.delegates),
                _cell(r.cpu_ops),
                ", ".join(f"{k}={_cell(v)}" for k, v in r.metrics.items()),
            ]
            for r in self.stages
        ]
        rows.append(["total", _cell(self.total_seconds), _cell(sum(r.verify_seconds for r in self.stages)), "", "", "", "", ""])
        return _table(header, rows)

    def format_placement(self) -> str:
        header = ["op", "count", "runs on", "reason"]
        rows = [[s.op, str(s.count), s.where, s.reason] for s in self.placement]
        return _table(header, rows)

    def format_resume(self) -> str:
        """What a resumed run replayed and what it changed ("" when it did not resume)."""
        if not self.resumed_from:
            return ""
        lines = [f"resumed from {self.resumed_from} with its recorded configuration (backend {self.config.get('backend')})"]
        lines += [f"  overridden: {o}" for o in self.overrides]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "config": dict(self.config),
            "versions": dict(self.versions),
            "resumed_from": self.resumed_from,
            "overrides": [attrs.asdict(o) for o in self.overrides],
            "stages": [attrs.asdict(r) for r in self.stages],
            "placement": [attrs.asdict(s) for s in self.placement],
        }
