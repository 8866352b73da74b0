"""The compile report: per-stage timing and node counts, where every node runs and why,
and the configuration the run used (with what a resume changed).

Text and JSON are made from the same rows (`stage_rows`, `placement_rows`), so a
terminal table (plain or `rich`) and the JSON report say the same thing. docs/REPORT.md
explains every column and field.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Sequence

import attrs

from compiler.ir.placement import OpSummary, PlacementPlan, backend_name
from compiler.process.memory import GB


@attrs.frozen
class StageRecord:
    stage: str
    seconds: float
    verify_seconds: float = 0.0
    nodes_in: int | None = None
    nodes_out: int | None = None
    delegates: int | None = None
    cpu_ops: int | None = None
    # The process's resident memory after the stage, and its peak while the stage ran (None where
    # the OS does not say, or for a stage the cache gave).
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    # The peak of the process's own memory (the resident set less mapped files' pages), sampled.
    peak_anonymous_bytes: int | None = None
    # What the stage itself reported (e.g. the fold stage's constants created), and the same in
    # words (each by the stage's declared `Metric`), for the notes column.
    metrics: Mapping[str, Any] = attrs.field(factory=dict)
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    # What the dependencies printed, warned or logged while the stage ran (kept off the terminal).
    messages: tuple[str, ...] = ()
    # Loaded from the stage cache instead of run (`seconds` is then the load, 0 for a stage
    # skipped without loading); `saved_seconds`: the run and verify time its entry recorded.
    cached: bool = False
    saved_seconds: float | None = None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def counted(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def memory_cell(held: int | None, peak: int | None, anonymous: int | None = None) -> str:
    """What a stage left resident and the peak it reached, and of that its own memory (less
    mapped files), in GB ("-" where unknown)."""
    if held is None:
        return "-"
    if peak is None:
        return f"{held / GB:.2f}"
    return f"{held / GB:.2f} (peak {peak / GB:.2f}" + (f", own {anonymous / GB:.2f})" if anonymous else ")")


def _peak_cell(records: Sequence[StageRecord]) -> str:
    """The highest peak of the stages' and of their own memory ("" where none was measured)."""
    peaks = [r.peak_rss_bytes for r in records if r.peak_rss_bytes is not None]
    anonymous = [r.peak_anonymous_bytes for r in records if r.peak_anonymous_bytes]
    if not peaks:
        return ""
    return f"peak {max(peaks) / GB:.2f}" + (f", own {max(anonymous) / GB:.2f}" if anonymous else "")


def kib(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} KiB"


@attrs.frozen
class Metric:
    """A number or fact a stage reports in its row: its key in `ctx.metrics`, its unit, and how
    the notes column says it. Each stage declares its own (`Stage.metrics`), beside itself."""

    name: str
    unit: str  # "count", "bytes", "s", "text" or "flag"
    wording: Callable[[Any], str]

    def phrase(self, value: Any) -> str:
        return self.wording(value)

    @classmethod
    def plain(cls, name: str, unit: str) -> "Metric":
        """One the notes say as `name: value`."""
        return cls(name, unit, lambda value: plain_phrase(name, value))


def plain_phrase(key: str, value: Any) -> str:
    """A value without wording of its own (an instrument's extra key): `key: value`."""
    return f"{key.replace('_', ' ')}: {_cell(value)}"


def _cached_phrase(record: StageRecord) -> str:
    saved = f", saved {record.saved_seconds:.3f} s" if record.saved_seconds is not None else ""
    return f"cached{saved}"


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
    # Per (op, where, reason): how many nodes (the plan's `summary()`, kept for old callers).
    placement: tuple[OpSummary, ...] = ()
    # The compile configuration (as JSON) and the dependency versions the run used.
    config: Mapping[str, Any] = attrs.field(factory=dict)
    versions: Mapping[str, Any] = attrs.field(factory=dict)
    # Set when the run resumed from a stage file: its path, and what differs from the
    # recorded run (options given, dependency versions installed).
    resumed_from: str | None = None
    overrides: tuple[Override, ...] = ()
    # Where every node of the final program runs and why; per-node rows and shares come from it.
    plan: PlacementPlan | None = None
    # What was compiled ("transformer:depth=2") and the check against eager (`CheckResult.to_json()`).
    model: str | None = None
    check: Mapping[str, Any] | None = None
    check_nodes: Mapping[str, Any] | None = None  # `NodeCheck.to_json()`, when asked

    # At most this many op nodes are listed one per line in the terminal; more are grouped.
    PER_NODE_LIMIT = 60

    def stage(self, name: str) -> StageRecord:
        for record in self.stages:
            if record.stage == name:
                return record
        raise KeyError(f"no stage {name!r} in this report; ran: {[r.stage for r in self.stages]}")

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.stages)

    def stage_rows(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows) of the stage table, the total last; cells are text."""
        header = ["stage", "time s", "verify s", "nodes in", "nodes out", "delegates", "cpu ops", "memory GB", "notes"]
        rows = [
            [
                r.stage,
                _cell(r.seconds),
                _cell(r.verify_seconds),
                _cell(r.nodes_in),
                _cell(r.nodes_out),
                _cell(r.delegates),
                _cell(r.cpu_ops),
                memory_cell(r.rss_bytes, r.peak_rss_bytes, r.peak_anonymous_bytes),
                "; ".join(([_cached_phrase(r)] if r.cached else []) + list(r.notes)),
            ]
            for r in self.stages
        ]
        rows.append([
            "total", _cell(self.total_seconds), _cell(sum(r.verify_seconds for r in self.stages)), "", "", "", "",
            _peak_cell(self.stages), "",
        ])
        return header, rows

    def format_stages(self) -> str:
        return _table(*self.stage_rows())

    @property
    def per_node(self) -> bool:
        """Whether the placement table lists every node (else it groups them by op)."""
        return self.plan is not None and len(self.plan.nodes) <= self.PER_NODE_LIMIT

    def placement_rows(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows) of the placement table: a row per node for a program of at most
        `PER_NODE_LIMIT` ops, else a row per (op, where, reason) with its count."""
        return self.node_rows() if self.per_node else self.grouped_rows()

    def node_rows(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows): every op node, where it runs and why (empty without a plan)."""
        header = ["node", "op", "runs on", "delegate", "precision", "reason"]
        if self.plan is None:
            return header, []
        return header, [
            [n.node, n.op, n.where, f"{n.backend_id}/{n.tag}" if n.tag else "-", _cell(n.precision), n.reason]
            for n in self.plan.described()
        ]

    def grouped_rows(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows): one row per (op, where, reason), with how many nodes."""
        header = ["op", "count", "runs on", "precision", "reason"]
        if self.plan is None:
            return header, [[s.op, str(s.count), s.where, "-", s.reason] for s in self.placement]
        counts = collections.Counter(
            (n.op, backend_name(n.backend_id) if n.backend_id else n.where, _cell(n.precision), n.reason)
            for n in self.plan.described()
        )
        ordered = sorted(counts.items(), key=lambda item: (item[0][1].startswith("CPU"), item[0][1], item[0][0]))
        return header, [[op, str(n), where, precision, reason] for (op, where, precision, reason), n in ordered]

    def format_shares(self) -> str:
        """One line: how many ops each delegate and the CPU run ("" without a plan)."""
        if self.plan is None or not self.plan.nodes:
            return ""
        return "; ".join(str(share) for share in self.plan.shares())

    def placement_note(self) -> str:
        """The line under a grouped placement table saying where every node is listed ("" else)."""
        if self.plan is None or self.per_node:
            return ""
        return f"{len(self.plan.nodes)} op nodes, grouped by op; the JSON report (--report-json) lists every node"

    def format_placement(self) -> str:
        """The shares, the placement table, and the note under a grouped table."""
        lines = [self.format_shares(), _table(*self.placement_rows()), self.placement_note()]
        return "\n".join(line for line in lines if line)

    def format_resume(self) -> str:
        """What a resumed run replayed and what it changed ("" when it did not resume)."""
        if not self.resumed_from:
            return ""
        lines = [f"resumed from {self.resumed_from} with its recorded configuration (backend {self.config.get('backend')})"]
        lines += [f"  overridden: {o}" for o in self.overrides]
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The whole report as JSON types: what `json.dumps` takes as is."""
        plan = self.plan
        return {
            "model": self.model,
            "config": dict(self.config),
            "versions": dict(self.versions),
            "resumed_from": self.resumed_from,
            "overrides": [attrs.asdict(o) for o in self.overrides],
            "stages": [
                {**attrs.asdict(r), "notes": ([_cached_phrase(r)] if r.cached else []) + list(r.notes)}
                for r in self.stages
            ],
            "shares": [{**attrs.asdict(s), "percent": s.percent} for s in plan.shares()] if plan else [],
            "nodes": [attrs.asdict(n) for n in plan.described()] if plan else [],
            "placement": [attrs.asdict(s) for s in self.placement],
            "check": dict(self.check) if self.check is not None else None,
            "check_nodes": dict(self.check_nodes) if self.check_nodes is not None else None,
        }


@attrs.frozen
class MethodsReport:
    """The report of a program of several methods: each method's stages (its own `Report`,
    through lower) and the one emit that made the `.pte` of them all."""

    methods: Mapping[str, Report]
    emit: StageRecord | None = None  # None when the methods stopped before emit
    config: Mapping[str, Any] = attrs.field(factory=dict)  # the emit's configuration

    @property
    def total_seconds(self) -> float:
        return sum(r.total_seconds for r in self.methods.values()) + (self.emit.seconds if self.emit else 0.0)

    def stage_rows(self) -> tuple[list[str], list[list[str]]]:
        """(header, rows): a row per method and stage, then the emit's (its method cell names them
        all), the total last."""
        header, _ = Report().stage_rows()
        rows = [[name, *row] for name, report in self.methods.items() for row in report.stage_rows()[1][:-1]]
        if self.emit is not None:
            rows += [[", ".join(self.methods), *row] for row in Report((self.emit,)).stage_rows()[1][:-1]]
        verify = sum(r.verify_seconds for report in self.methods.values() for r in report.stages)
        verify += self.emit.verify_seconds if self.emit else 0.0
        records = [r for report in self.methods.values() for r in report.stages] + ([self.emit] if self.emit else [])
        rows.append(["total", "", _cell(self.total_seconds), _cell(verify), "", "", "", "", _peak_cell(records), ""])
        return ["method", *header], rows

    def format_stages(self) -> str:
        return _table(*self.stage_rows())

    def format_placement(self) -> str:
        """Each method's placement, under its name."""
        return "\n\n".join(f"method {name}:\n{report.format_placement()}" for name, report in self.methods.items())

    def to_json(self) -> dict:
        emit = Report((self.emit,)).to_json()["stages"][0] if self.emit is not None else None
        return {
            "methods": {name: report.to_json() for name, report in self.methods.items()},
            "emit": emit,
            "config": dict(self.config),
        }
