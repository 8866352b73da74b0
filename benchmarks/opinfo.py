"""PyTorch's OpInfo (`op_db`) on every backend, ours against stock ExecuTorch (issue 54, item 5).

    python -m benchmarks.opinfo [--backends B ...] [--seed S] [--ops N] [--samples-per-op K]
                                [--only OP ...] [--no-stock] [--markdown FILE] [--json FILE]

Draws `--ops` ops of op_db that take float32 (seed `--seed`, up to `--samples-per-op` samples
each: `compiler.tools.fuzz.opinfo.draw`), compiles each op x sample by ours for each backend and
by stock beside it, runs both here and compares them with eager (the fuzz oracle). Writes
`benchmarks/results/opinfo.md` and `.json`: per backend, ours and stock's counts of pass, named
refusal, wrapped error, raw exception and wrong result; every case of ours wrong, raw or wrapped;
every case stock passes and ours does not; ours' named refusals grouped by their reason.
`tests/test_opinfo.py` runs a few cases by default and the whole draw with -m slow.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import platform
import re
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' progress bars

import torch  # noqa: E402

from compiler.tools.fuzz import opinfo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DEFAULT_MARKDOWN = os.path.join(RESULTS, "opinfo.md")
DEFAULT_JSON = os.path.join(RESULTS, "opinfo.json")
BACKENDS = ("portable", "xnnpack", "coreml", "mlx")
FAILING = (opinfo.WRONG, opinfo.RAW, opinfo.WRAPPED)


def counts_table(records: list[dict], backends: tuple[str, ...]) -> str:
    lines = ["| backend | path | cases | " + " | ".join(opinfo.COLUMNS) + " | ours not passing where stock passes |",
             "|---" * (len(opinfo.COLUMNS) + 4) + "|"]
    for backend in backends:
        mine = [r for r in records if r["backend"] == backend]
        worse = sum(1 for r in mine if r["stock"] == opinfo.PASS and r["ours"] != opinfo.PASS)
        for path in ("ours", "stock"):
            counted = collections.Counter(r[path] for r in mine if r[path] is not None)
            if not counted:
                continue
            cells = " | ".join(str(counted[c]) for c in opinfo.COLUMNS)
            lines.append(f"| {backend} | {path} | {sum(counted.values())} | {cells} | "
                         f"{worse if path == 'ours' else '-'} |")
    return "\n".join(lines)


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")[:240]


def case_list(records: list[dict]) -> str:
    lines = ["| backend | case | ours | ours' detail | stock | stock's detail |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['backend']} | `{r['case']}` | {r['ours']} | {_cell(r['ours_detail'])} | "
                     f"{r['stock'] or '-'} | {_cell(r['stock_detail'])} |")
    return "\n".join(lines)


def reason(detail: str) -> str:
    """A refusal's reason with the node names and numbers that vary between cases taken out."""
    return re.sub(r"\b[\w.]*\d[\w.]*\b", "#", detail)[:200]


def refusal_reasons(records: list[dict]) -> str:
    reasons = collections.Counter((r["backend"], reason(r["ours_detail"])) for r in records if r["ours"] == opinfo.NAMED)
    lines = ["| backend | refusals | reason (first line) |", "|---|---|---|"]
    lines += [f"| {backend} | {n} | {_cell(text)} |" for (backend, text), n in sorted(
        reasons.items(), key=lambda item: (item[0][0], -item[1]))]
    return "\n".join(lines)


def markdown(records: list[dict], backends: tuple[str, ...], args: argparse.Namespace, cases: int, ops: int) -> str:
    ours_failing = [r for r in records if r["ours"] in FAILING]
    at_run_time = [r for r in records if r["ours"] == opinfo.NAMED and r["ours_detail"].startswith("run:")]
    worse = [r for r in records if r["stock"] == opinfo.PASS and r["ours"] != opinfo.PASS]
    return (
        "# OpInfo: ours against stock ExecuTorch\n\n"
        f"`python -m benchmarks.opinfo` (torch {torch.__version__}, {platform.machine()}): {ops} ops of "
        f"`op_db` taking float32 (seed {args.seed}, up to {args.samples_per_op} samples each), {cases} op x "
        "sample cases per backend. Each is compiled by ours and by stock (`torch.export` + "
        "`to_edge_transform_and_lower` with the backend's partitioner), both run here (Core ML in the "
        "reference executor; both compute in float32) and are compared with eager by the fuzz oracle "
        "(`compiler/tools/fuzz/oracle.py`). pass: ran and matched eager (or compiled, where a payload has "
        "no runner here); named refusal: one of our named errors (stock: any error at compile, or "
        "torch.export refusing the program, or a program calling an operator the runtime has no kernel for); "
        "wrapped error: a stage failure around a library's error; "
        "raw: an exception that is not ours, compiling or running; wrong: a shape, dtype or value "
        "unlike eager's.\n\n"
        + counts_table(records, backends)
        + "\n\n## Ours wrong, raw or wrapped\n\n"
        + (case_list(ours_failing) if ours_failing else "None.")
        + "\n\n## Ours refused when run, not when compiled\n\n"
        + (case_list(at_run_time) if at_run_time else "None.")
        + "\n\n## Stock passes, ours does not\n\n"
        + (case_list(worse) if worse else "None.")
        + "\n\n## Ours' named refusals by reason\n\n"
        + refusal_reasons(records) + "\n"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--seed", type=int, default=opinfo.SEED)
    parser.add_argument("--ops", type=int, default=opinfo.OPS)
    parser.add_argument("--samples-per-op", type=int, default=opinfo.SAMPLES_PER_OP)
    parser.add_argument("--only", nargs="+", default=(), help="these ops of op_db (name.variant) instead of a draw")
    parser.add_argument("--no-stock", action="store_true", help="ours only")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN)
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    backends = tuple(args.backends)
    cases = opinfo.draw(args.seed, args.ops, args.samples_per_op, tuple(args.only))
    ops = len({c.op for c in cases})
    print(f"{len(cases)} cases of {ops} ops", flush=True)
    start = time.perf_counter()

    def progress(judged: opinfo.Judged) -> None:
        record = judged.record()
        stock = f" | stock {record['stock']}: {(record['stock_detail'] or '')[:60]}" if judged.stock else ""
        print(f"{time.perf_counter() - start:6.0f}s {judged.backend:8} {judged.case.id:36} ours {record['ours']}: "
              f"{record['ours_detail'][:100]}{stock}", flush=True)

    records = [j.record() for j in opinfo.run(cases, backends, with_stock=not args.no_stock, progress=progress)]
    text = markdown(records, backends, args, len(cases), ops)
    print(text)
    os.makedirs(os.path.dirname(args.markdown) or ".", exist_ok=True)
    with open(args.markdown, "w") as f:
        f.write(text)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "seed": args.seed, "ops": ops, "cases": len(cases),
                   "seconds": round(time.perf_counter() - start), "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
