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
    # What the stage itself reported (e.g. the fold stage's constants created).
    metrics: Mapping[str, Any] = attrs.field(factory=dict)
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


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def memory_cell(held: int | None, peak: int | None) -> str:
    """What a stage left resident and the peak it reached, in GB ("-" where unknown)."""
    if held is None:
        return "-"
    return f"{held / GB:.2f} (peak {peak / GB:.2f})" if peak is not None else f"{held / GB:.2f}"


def _peak_cell(records: Sequence[StageRecord]) -> str:
    """The highest peak of the stages' ("" where none was measured)."""
    peaks = [r.peak_rss_bytes for r in records if r.peak_rss_bytes is not None]
    return f"peak {max(peaks) / GB:.2f}" if peaks else ""


def _kib(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} KiB"


# Metric key (what a stage put in `ctx.metrics`) -> its value in words for the notes column.
# The dry run's `skipped` and `because` values are sentences already.
_METRIC_PHRASES: dict[str, Callable[[Any], str]] = {
    # quantize
    "conv1d_as_linear": lambda n: f"quantized {_count(n, 'Conv1D layer')} as the Linear it is (weight transposed)",
    # capture
    "constants_made_buffers": lambda n: f"made {_count(n, 'constant')} the model writes to into buffers",
    "selects_by_tensor": lambda n: f"rewrote {_count(n, 'select')} by a tensor value as index_select",
    "mutation_sources_cloned": lambda n: f"cloned {_count(n, 'value')} a mutated buffer would share",
    "vmap_inlined": lambda _: "inlined vmap regions",
    "views_owned": lambda n: f"gave {_count(n, 'constant view')} its own storage",
    "constants_made_row_major": lambda n: f"made {_count(n, 'constant')} row-major",
    # precision
    "precision": lambda why: why,
    "dtype": lambda dtype: f"computes in {dtype}",
    "tensors_converted": lambda n: f"stored {_count(n, 'weight or buffer', 'weights and buffers')} in it",
    "dtype_arguments": lambda n: f"retargeted {_count(n, 'cast or factory', 'casts and factories')}",
    "edge_casts": lambda n: f"cast {_count(n, 'input or output', 'inputs and outputs')} at the edges",
    "casts_added": lambda n: f"added {_count(n, 'cast')} inside",
    # fold
    "folded": lambda n: f"folded {_count(n, 'node')} into constants" if n else "folded nothing",
    "constants": lambda n: f"made {_count(n, 'constant')}",
    "bytes_added": lambda n: f"added {_kib(n)} of constants",
    "bytes_removed": lambda n: f"removed {_kib(n)} of constants",
    "masks": lambda n: f"turned {_count(n, 'constant bool mask')} into index positions",
    # dry_run
    "opened": lambda ops: f"decomposed one level first, as they hold ops the backend keeps whole: {ops}",
    "kept": lambda n: f"kept {_count(n, 'op')} whole for the backend" if n else "kept no op whole",
    "skipped": lambda why: f"no dry run needed: {why}",
    "because": lambda why: f"dry run needed: {why}",
    "decomposed": lambda ops: f"decomposed after all (would run on the CPU without a kernel): {ops}",
    "decomposition_handed_on_s": lambda s: f"handed its decomposition ({s:.2f} s) on to the decompose stage",
    "search_handed_on_s": lambda s: f"handed its partition search ({s:.2f} s) on to the partition stage",
    # decompose
    "from_dry_run": lambda _: "the dry run's decomposition, which kept exactly these ops whole",
    "retraced": lambda why: f"decomposed by torch's retrace (node by node failed: {why})",
    # partition
    "search_from_dry_run": lambda _: "the dry run's partition search of this very program",
    "program_state": lambda names: f"kept state other methods write the program's (not a delegate's constant): {names}",
    # split_constants
    "copies": lambda n: f"made {_count(n, 'constant copy', 'constant copies')} for delegates sharing one"
    if n else "no constant copies needed",
    # emit
    "initialized_state": lambda n: f"kept the initial value of {_count(n, 'CPU buffer')}",
    "pte_bytes": lambda n: f".pte of {_kib(n)}",
    "ptd_bytes": lambda n: f"weights in a .ptd of {_kib(n)}",
}


def metric_phrase(key: str, value: Any) -> str:
    """A stage's metric in words; a key without a phrase shows as `key: value`."""
    phrase = _METRIC_PHRASES.get(key)
    return phrase(value) if phrase else f"{key.replace('_', ' ')}: {_cell(value)}"


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
                memory_cell(r.rss_bytes, r.peak_rss_bytes),
                "; ".join(([_cached_phrase(r)] if r.cached else []) + [metric_phrase(k, v) for k, v in r.metrics.items()]),
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
                {**attrs.asdict(r), "notes": ([_cached_phrase(r)] if r.cached else []) + [metric_phrase(k, v) for k, v in r.metrics.items()]}
                for r in self.stages
            ],
            "shares": [{**attrs.asdict(s), "percent": s.percent} for s in plan.shares()] if plan else [],
            "nodes": [attrs.asdict(n) for n in plan.described()] if plan else [],
            "placement": [attrs.asdict(s) for s in self.placement],
            "check": dict(self.check) if self.check is not None else None,
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
