"""A fuzz campaign: N random programs through our pipeline and stock's, one table.

Hypothesis draws the programs (replayed exactly by the seed). Every program is
counted once, as drawn; the first program of each new kind of failure is then
shrunk by hypothesis to the smallest program failing the same way, and written,
like every failing program, as a standalone reproducer.

Every wrong result of ours is located (`place.py`, `compiler.locate`): the shrunk program when
shrinking (the drawn programs failing the same way take its location), else the program as
drawn. The finding's record keeps the Location's JSON (or the error locate raised), its
reproducer file and the campaign's details say it in a paragraph, and with an output directory
`<backend>-<seed>-findings.json` holds every finding's record.

With `quantize`, every program holds layers a scheme quantizes and is drawn with a
scheme the backend takes (`programs.quantized_programs`); the table gains a column
for programs off their eager quantized model by a tolerance question only.
"""

from __future__ import annotations

import collections
import json
import os
import textwrap
import re
from typing import Callable

import attrs
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import FlakyFailure

from compiler.stages import schemes
from compiler.tools.fuzz import oracle, place
from compiler.tools.fuzz.oracle import Outcome
from compiler.tools.fuzz.programs import SMALL, Program, Sizes, programs, quantized_programs

_COLUMNS = (oracle.OK, oracle.COMPILED, oracle.NAMED, oracle.WRAPPED, oracle.RAW, oracle.WRONG)


@attrs.frozen
class Case:
    number: int
    program: Program
    ours: Outcome
    stock: Outcome | None
    reproducer: str | None = None
    # For a wrong result of ours: where locate put it (Location.to_json()), or the error locate
    # raised; the paragraph saying it; the program it was located on.
    location: dict | None = None
    locate_error: str | None = None
    place: str | None = None
    located_on: str | None = None

    def record(self) -> dict:
        """The finding as JSON."""
        return {
            "case": self.number, "source": self.program.source(), "reproducer": self.reproducer,
            "ours": attrs.asdict(self.ours), "stock": attrs.asdict(self.stock) if self.stock else None,
            "location": self.location, "locate_error": self.locate_error, "place": self.place,
            "located_on": self.located_on,
        }


@attrs.define
class Campaign:
    backend: str
    seed: int
    cases: list[Case] = attrs.Factory(list)
    shrunk: list[Case] = attrs.Factory(list)
    quantize: bool = False
    check_nodes: bool = False
    sizes: Sizes = SMALL

    @property
    def failures(self) -> list[Case]:
        return [c for c in self.cases if c.ours.kind in oracle.FAILURES]

    @property
    def stock_right_we_refuse(self) -> list[Case]:
        return [c for c in self.cases if c.stock is not None and c.stock.passed and not c.ours.passed]

    def table(self) -> str:
        """Ours and stock's outcomes as a Markdown table, one row per path."""
        rows = [("ours", collections.Counter(c.ours.kind for c in self.cases))]
        if any(c.stock for c in self.cases):
            rows.append(("stock", collections.Counter(c.stock.kind for c in self.cases if c.stock)))
        invalid = sum(1 for c in self.cases if c.stock is not None and c.stock.kind == oracle.INVALID)
        columns = (_COLUMNS + ((oracle.NODES,) if self.check_nodes else ())
                   + ((oracle.TOLERANCE,) if self.quantize else ()))
        what = ("quantized programs" if self.quantize else "programs") + (" at model sizes" if self.sizes.fitted else "")
        lines = [
            f"| {self.backend} ({len(self.cases)} {what}, seed {self.seed}) | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        lines += [f"| {name} | " + " | ".join(str(counts[k]) for k in columns) + " |" for name, counts in rows]
        lines.append(
            f"\nstock right, ours refused: {len(self.stock_right_we_refuse)}; "
            f"ours right, stock not: {sum(1 for c in self.cases if c.ours.passed and c.stock and not c.stock.passed)}"
            + (f"; programs torch.export refused: {invalid}" if invalid else "")
        )
        if self.quantize:
            drawn = collections.Counter(describe(c.program) for c in self.cases)
            lines.append("schemes drawn: " + ", ".join(f"{n} x {scheme}" for scheme, n in sorted(drawn.items())))
        return "\n".join(lines)

    def details(self) -> str:
        """Each distinct outcome other than a pass, with how often it happened."""
        lines = []
        for path in ("ours", "stock"):
            counts = collections.Counter(
                (getattr(c, path).kind, getattr(c, path).detail)
                for c in self.cases
                if getattr(c, path) is not None and not getattr(c, path).passed
            )
            for (kind, detail), n in counts.most_common():
                lines.append(f"{path:5} {n:4} x {kind}: {detail}")
        for case in self.located:
            what = f"shrunk {case.number}" if case in self.shrunk else f"case {case.number}"
            lines.append(f"{what} ({case.reproducer or 'not written'}), on {case.located_on}: {case.place}")
        return "\n".join(lines)

    @property
    def located(self) -> list[Case]:
        """The wrong results located on their own program (those of the same kind as a shrunk one take its place)."""
        return [c for c in self.cases + self.shrunk if c.place is not None and c.located_on == place.ON_ITSELF]


def describe(program: Program) -> str:
    """The scheme a quantized program was drawn with, in a few words."""
    q = program.quantization
    if q is None:
        return "float"
    grouped = f" {q.group_size}" if q.granularity == schemes.PER_GROUP else ""
    embedding = f" + embedding {q.embedding} {q.embedding_group_size or 'per row'}" if q.embedding else ""
    return f"{q.scheme} {q.granularity}{grouped}{embedding}"


def signature(outcome: Outcome) -> str:
    """A failure's kind with the names and numbers that vary between programs taken out."""
    detail = re.sub(r"\b[\w.]*\d[\w.]*\b", "#", outcome.detail.split(":")[0] if outcome.kind == oracle.WRONG else outcome.detail)
    return f"{outcome.kind}: {detail}"


def write_reproducer(directory: str, name: str, case: Case, backend: str, campaign_seed: int) -> str:
    """The program as a standalone file: `python FILE` compiles it and compares with eager."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.py")
    program = case.program
    located = ""
    if case.place is not None:
        on = "" if case.located_on == place.ON_ITSELF else f" (on {case.located_on})"
        located = textwrap.fill(case.place + on, 100, initial_indent="# ", subsequent_indent="#   ") + "\n"
    header = (
        f"# Found by the fuzz campaign for backend {backend!r} with seed {campaign_seed} (case {case.number}).\n"
        + (f"# quantized: {describe(program)}\n" if program.quantization else "")
        + f"# ours:  {case.ours.kind}: {case.ours.detail}\n"
        + (f"# stock: {case.stock.kind}: {case.stock.detail}\n" if case.stock else "")
        + located
    )
    footer = (
        f"\n\nBACKEND = {backend!r}\nCALLS = {program.calls}\n"
        f"TOLERANCES = {list(program.tolerances)!r}\nOUTPUTS = {list(program.names)!r}\n"
        + (f"QUANTIZATION = {attrs.asdict(program.quantization)!r}\n" if program.quantization else "")
        + "\n"
        "if __name__ == '__main__':\n"
        "    from compiler.tools.fuzz.oracle import replay\n\n"
        "    replay(__file__)\n"
    )
    with open(path, "w") as f:
        f.write(header + program.source() + footer)
    return path


def _worth_keeping(case: Case) -> bool:
    """Our failures and tolerance questions, programs stock runs and we refuse, and programs stock gets wrong."""
    stock = case.stock
    return case.ours.kind in (*oracle.FAILURES, oracle.TOLERANCE) or (
        stock is not None and (stock.passed != case.ours.passed or stock.kind == oracle.WRONG)
    )


def _locate(case: Case, backend: str) -> Case:
    """`case` with where locate puts its wrong result (or the error locate raised)."""
    placed = place.locate(case.program, backend)
    return attrs.evolve(case, location=placed.location, locate_error=placed.error, place=placed.paragraph,
                        located_on=place.ON_ITSELF)


def _place_alike(campaign: Campaign, backend: str, out_dir: str | None) -> None:
    """Each drawn wrong result not located yet takes the location of the shrunk program failing
    the same way (located on its own when there is none); its reproducer says so."""
    shrunk = {signature(c.ours): c for c in campaign.shrunk if c.place is not None}
    for i, case in enumerate(campaign.cases):
        if case.ours.kind != oracle.WRONG or case.place is not None:
            continue
        alike = shrunk.get(signature(case.ours))
        if alike is None:
            case = _locate(case, backend)
        else:
            case = attrs.evolve(case, location=alike.location, locate_error=alike.locate_error, place=alike.place,
                                located_on=f"the shrunk program {alike.number} ({alike.reproducer or 'not written'})")
        if case.reproducer:
            write_reproducer(os.path.dirname(case.reproducer), os.path.basename(case.reproducer)[:-3], case,
                             backend, campaign.seed)
        campaign.cases[i] = case


def write_findings(campaign: Campaign, directory: str) -> str:
    """Every finding's record (our failures, drawn and shrunk) as one JSON file."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{campaign.backend}-{campaign.seed}-findings.json")
    with open(path, "w") as f:
        json.dump({
            "backend": campaign.backend, "seed": campaign.seed, "programs": len(campaign.cases),
            "failures": [c.record() for c in campaign.failures], "shrunk": [c.record() for c in campaign.shrunk],
        }, f, indent=1, default=str)
    return path


class _Reproduced(Exception):
    """Raised inside hypothesis while a failure of one signature keeps reproducing."""


def fuzz(
    backend: str,
    examples: int,
    campaign_seed: int = 0,
    *,
    out_dir: str | None = None,
    with_stock: bool = True,
    shrink: bool = True,
    progress: Callable[[Case], None] | None = None,
    quantize: bool = False,
    check_nodes: bool = False,
    sizes: Sizes = SMALL,
) -> Campaign:
    if quantize and sizes.fitted:
        from compiler.ir.errors import UserInputError

        raise UserInputError("the quantize axis draws at small sizes only", hint="drop --model-sizes or --quantize")
    campaign = Campaign(backend, campaign_seed, quantize=quantize, check_nodes=check_nodes, sizes=sizes)
    drawn = quantized_programs(backend) if quantize else programs(sizes=sizes)
    seen: set[str] = set()
    attempt = 0
    while len(campaign.cases) < examples:
        target: list[str] = []  # the signature being shrunk, once one is found
        last_failing: list[Case] = []

        def failed(program: Program) -> bool:
            """Judge `program`; True while it fails the way being shrunk (or a new way)."""
            want = oracle.eager_outputs(program)
            ours = oracle.ours(program, backend, want, check_nodes=check_nodes)
            if target:
                if ours.kind in oracle.FAILURES and signature(ours) == target[0]:
                    last_failing[:] = [Case(-1, program, ours, None)]
                    return True
                return False
            if len(campaign.cases) >= examples:
                return False
            stock = oracle.stock(program, backend, want) if with_stock else None
            case = Case(len(campaign.cases), program, ours, stock)
            if ours.kind == oracle.WRONG and not shrink:
                case = _locate(case, backend)
            if out_dir and _worth_keeping(case):
                case = attrs.evolve(case, reproducer=write_reproducer(
                    out_dir, f"{backend}-{campaign_seed}-{case.number}", case, backend, campaign_seed))
            campaign.cases.append(case)
            if progress:
                progress(case)
            if shrink and ours.kind in oracle.FAILURES and signature(ours) not in seen:
                seen.add(signature(ours))
                target.append(signature(ours))
                last_failing[:] = [case]
                return True
            return False

        def check(program: Program) -> None:
            # One raise for every failure: hypothesis tells failures apart by where they are raised.
            if failed(program):
                raise _Reproduced

        test = seed(campaign_seed * 1000 + attempt)(
            settings(
                max_examples=examples - len(campaign.cases),
                database=None,
                deadline=None,
                derandomize=False,
                phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
                report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck),
            )(given(drawn)(check))
        )
        attempt += 1
        try:
            test()
        except (_Reproduced, FlakyFailure):
            shrunk = attrs.evolve(last_failing[0], number=len(campaign.shrunk), stock=None)
            if shrunk.ours.kind == oracle.WRONG:
                shrunk = _locate(shrunk, backend)
            if out_dir:
                shrunk = attrs.evolve(shrunk, reproducer=write_reproducer(
                    out_dir, f"{backend}-{campaign_seed}-shrunk-{shrunk.number}", shrunk, backend, campaign_seed))
            campaign.shrunk.append(shrunk)
        else:
            if attempt > examples:  # hypothesis ran out of programs to draw
                break
    _place_alike(campaign, backend, out_dir)
    if out_dir and (campaign.failures or campaign.shrunk):
        write_findings(campaign, out_dir)
    return campaign
