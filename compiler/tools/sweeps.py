"""Compile sweeps: many jobs (models x backends x options), each compiled in a worker process.

    rows = compiler.sweep([{"model": ["mlp", "transformer:depth=2"], "backend": ["portable", "xnnpack"],
                            "output": "out/{model}-{backend}.pte"}], workers=2, cache_dir="cache")

A job is a mapping: `model` (a MODEL spec, as the CLI's: `transformer:depth=2` or
`path/to/file.py:factory`), `backend`, `backend_options`, any compile option by its
configuration name (`compiler.driver.config.options()`), `dynamic_dim` (dynamic input sizes in
`--dynamic-dim`'s form, `compiler.driver.dynamic_dims`), `check` (run the `.pte` and compare with
eager, as `compile --check`, at the ends of the dynamic sizes' ranges too) with `tolerance`, and
`output` (a `.pte` path; `{model}`, `{backend}` and `{job}` are replaced). A list given for `model`,
`backend`, `backend_options`, `check`, `tolerance` or an option expands to the cross product; for
`dynamic_dim` and an option that takes several values (`fold_skip_ops`) a list of lists expands. Every job is
checked before any work starts (names, kinds and choices, model specs, backends, output
paths): a mistake is a `UserInputError` naming the job and the key.

Each job runs `run_job` in a worker: a process of a pool, forked from a server process that
imported the pipeline once, or a Ray task
(`ray_address`). It builds the model, calls `compiler.compile` (with the stage cache when
`cache_dir` is given) and returns the `.pte` bytes with the job's `SweepRow`; the caller
writes the output file (Ray nodes may not share a disk). A failing job is recorded with its
error and the others go on. This module imports no torch: the parent reads the jobs, serves
each job without a check whose program the program cache holds
(`compiler.driver.program_cache`: no worker, no capture, no torch) and dispatches the rest;
the workers import the pipeline. A sweep whose every job is served starts no workers.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from compiler import backends
from compiler.models import catalog
from compiler.driver import config, dynamic_dims
from compiler.ir.errors import CompileError, UserInputError
from compiler.process.writable import prove_file_writable

logger = logging.getLogger(__name__)

# Keys of a job besides the compile options (`compiler.driver.config.options()`).
JOB_KEYS = ("model", "backend", "backend_options", "dynamic_dim", "check", "tolerance", "output")
# Compile options a sweep job cannot take: each job makes a .pte and prints nothing.
_NOT_IN_A_JOB = {
    "stop_after": "a sweep job compiles to the end (compile with stop_after on its own)",
    "resume_from": "a sweep job compiles from the model (resume with compile on its own)",
    "print_after_change": "workers print nothing (use dump_dir to see each stage's graph)",
    "external_weights": "a sweep job writes one .pte (compile with external_weights on its own for a .pte and .ptd)",
}
# Keys whose list value expands to the cross product (besides the options).
_EXPANDING = ("model", "backend", "backend_options", "check", "tolerance")
STATUS_OK, STATUS_ERROR, STATUS_MISMATCH = "ok", "error", "mismatch"
TABLE_HEADER = ("job", "backend", "status", "time s", "cached stages", "output", "delegated", "check")


@attrs.frozen
class Job:
    """One compile of a sweep, after expansion and checks."""

    number: int  # 1, 2, ... over the expanded jobs
    entry: int  # which job of the file (1-based) it came from
    model: str
    backend: str
    backend_options: Mapping[str, Any] = attrs.field(factory=dict)
    options: Mapping[str, Any] = attrs.field(factory=dict)  # compile options by configuration name
    check: bool = False
    tolerance: float | None = None
    output: str | None = None
    dynamic_dim: tuple[dynamic_dims.DynamicDim, ...] = ()  # dynamic input sizes

    @property
    def label(self) -> str:
        """What the table calls it: the number, the model, and the options it sets."""
        extra = [f"dynamic_dim={','.join(map(str, self.dynamic_dim))}"] if self.dynamic_dim else []
        extra += [f"{k}={json.dumps(v)}" for k, v in self.backend_options.items()]
        extra += [f"{k}={json.dumps(v)}" for k, v in self.options.items() if k not in ("cache", "cache_dir")]
        return f"{self.number} {self.model}" + (f" ({', '.join(extra)})" if extra else "")


@attrs.frozen
class SweepRow:
    """One job's outcome: the table row, as values."""

    job: int
    label: str
    model: str
    backend: str
    status: str  # "ok", "error" (the compile, the model or the check failed to run), "mismatch" (check failed)
    seconds: float  # the job's wall time in its worker: building the model, compiling, checking
    cached_stages: tuple[str, ...] = ()
    output: str | None = None
    pte_bytes: int | None = None
    delegated: float | None = None  # fraction of the program's ops delegated (0.0 on portable)
    check: Mapping[str, Any] | None = None  # `CheckResult.to_json()`, when checked
    error: str | None = None  # the error's message (with what to do), when status is "error"
    error_type: str | None = None
    error_stage: str | None = None
    compile_seconds: float | None = None  # the report's total (stage times)
    # Each stage's seconds as the report has them (a cached stage's: its load, or 0).
    stage_seconds: Mapping[str, float] = attrs.field(factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == STATUS_OK

    def cells(self) -> tuple[str, ...]:
        """The row as the table's text cells (`TABLE_HEADER`)."""
        if self.check is None:
            check = "-"
        else:
            check = f"{'OK' if self.check['passed'] else 'MISMATCH'} {self.check['max_abs_error']:.2g}"
        status = self.status if self.status != STATUS_ERROR else f"error: {self.error_type}" + (
            f" [{self.error_stage}]" if self.error_stage else "")
        return (
            self.label, self.backend, status, f"{self.seconds:.1f}", ", ".join(self.cached_stages) or "-",
            self.output or "-", "-" if self.delegated is None else f"{100 * self.delegated:.0f}%", check,
        )


def format_table(rows: Sequence[SweepRow]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row.cells()) + " |" for row in rows]
    return "\n".join(lines)


# --- reading and checking jobs ------------------------------------------------------------


def read_jobs_file(path: str | os.PathLike) -> list[dict]:
    """The jobs of a `.json`, `.toml` or `.yaml` file: a list of jobs, or `{"jobs": [...]}`
    (TOML: `[[jobs]]` tables), unexpanded."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UserInputError(f"jobs file {path!r} does not exist", hint="give a .json, .toml or .yaml file of jobs")
    kind = os.path.splitext(path)[1].lower()
    try:
        if kind == ".json":
            with open(path) as f:
                data = json.load(f)
        elif kind == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif kind in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                data = yaml.safe_load(f)
        else:
            raise UserInputError(
                f"jobs file {path!r}: cannot tell its format from {kind or 'no suffix'!r}",
                hint="name it .json, .toml or .yaml",
            )
    except UserInputError:
        raise
    except Exception as exc:  # each parser has its own error types
        raise UserInputError(
            f"jobs file {path!r} does not parse: {type(exc).__name__}: {exc}", hint="fix the file's syntax"
        ) from None
    return _job_list(data, f"jobs file {path!r}")


def _job_list(data: Any, where: str) -> list[dict]:
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"jobs"})
        if extra or "jobs" not in data:
            raise UserInputError(
                f"{where}: unknown top-level key(s) {', '.join(map(repr, extra))}" if extra
                else f"{where} has no 'jobs'",
                hint="give a list of jobs, or {\"jobs\": [...]} (TOML: [[jobs]] tables)",
            )
        data = data["jobs"]
    if not isinstance(data, list):
        raise UserInputError(
            f"{where}: the jobs must be a list, got {type(data).__name__}",
            hint="give a list of jobs, or {\"jobs\": [...]} (TOML: [[jobs]] tables)",
        )
    for number, job in enumerate(data, 1):
        if not isinstance(job, Mapping):
            raise UserInputError(f"{where}: job {number} is a {type(job).__name__}, not a mapping of keys",
                                 hint=f"keys are: {', '.join(job_keys())}")
    return [dict(job) for job in data]


def job_keys() -> tuple[str, ...]:
    return (*JOB_KEYS, *(spec.name for spec in config.options() if spec.name not in _NOT_IN_A_JOB))


def expand_jobs(jobs: Iterable[Mapping[str, Any]] | str | os.PathLike, where: str = "jobs") -> list[Job]:
    """The jobs (mappings, or a jobs file's path) expanded to the cross product and checked:
    a mistake is a `UserInputError` naming the job (its place in the list) and the key."""
    if isinstance(jobs, (str, os.PathLike)):
        where = f"jobs file {os.fspath(jobs)!r}"
        entries = read_jobs_file(jobs)
    else:
        entries = _job_list(list(jobs), where)
    if not entries:
        raise UserInputError(f"{where}: there are no jobs", hint="give at least one job with a model")
    specs = {spec.name: spec for spec in config.options()}
    expanded: list[Job] = []
    for entry_number, entry in enumerate(entries, 1):
        name = f"{where}: job {entry_number}"
        for key in entry:
            if key in _NOT_IN_A_JOB:
                raise UserInputError(f"{name}: key {key!r} cannot be set in a sweep job", hint=_NOT_IN_A_JOB[key])
            if key not in JOB_KEYS and key not in specs:
                raise UserInputError(f"{name}: unknown key {key!r}", hint=f"keys are: {', '.join(job_keys())}")
        if "model" not in entry:
            raise UserInputError(f"{name} has no 'model'", hint="give a MODEL, e.g. \"model\": \"transformer:depth=2\"")
        axes = [(key, _choices(name, key, value, specs.get(key))) for key, value in entry.items() if key != "output"]
        output = entry.get("output")
        if output is not None and not isinstance(output, str):
            raise UserInputError(f"{name}: key 'output' must be a path (a string), got {type(output).__name__}",
                                 hint="give one .pte path; {model}, {backend} and {job} make it differ per job")
        for values in itertools.product(*(choices for _, choices in axes)):
            fields = dict(zip((key for key, _ in axes), values))
            expanded.append(_job(name, entry_number, len(expanded) + 1, fields, output, specs))
    _check_outputs(expanded, where)
    return expanded


def _choices(name: str, key: str, value: Any, spec: config.OptionSpec | None) -> list[Any]:
    """The values a key takes across the cross product."""
    if key == "model" and isinstance(value, list) and not value:
        raise UserInputError(f"{name}: key 'model' is an empty list", hint="give at least one MODEL")
    if key == "dynamic_dim" or (spec is not None and spec.repeated):
        # A list of values is one value of the option; a list of lists expands.
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            return value
        return [value]
    if isinstance(value, list) and (spec is not None or key in _EXPANDING):
        if not value:
            raise UserInputError(f"{name}: key {key!r} is an empty list", hint="give one value, or a list of values")
        return value
    return [value]


def _job(name: str, entry: int, number: int, fields: dict[str, Any], output: str | None,
         specs: Mapping[str, config.OptionSpec]) -> Job:
    model = fields.pop("model")
    if not isinstance(model, str):
        raise UserInputError(f"{name}: key 'model' must be a MODEL string, got {type(model).__name__}",
                             hint="e.g. \"transformer:depth=2\" or \"path/to/file.py:factory\"")
    try:
        catalog.check_model_spec(model)
    except UserInputError as error:
        raise UserInputError(f"{name}: key 'model': {error.reason}", hint=error.hint) from None
    backend = fields.pop("backend", config.CompileConfig().backend)
    if backend not in backends.available():
        raise UserInputError(f"{name}: key 'backend': unknown backend {backend!r}",
                             hint=f"backends are: {', '.join(backends.available())}")
    backend_options = fields.pop("backend_options", None) or {}
    if not isinstance(backend_options, Mapping) or not all(isinstance(k, str) for k in backend_options):
        raise UserInputError(f"{name}: key 'backend_options' must be a mapping of option names to values",
                             hint="e.g. {\"per_op_mode\": true}; a list of mappings expands")
    check = fields.pop("check", False)
    if not isinstance(check, bool):
        raise UserInputError(f"{name}: key 'check' must be true or false, got {check!r}", hint="check: true")
    tolerance = fields.pop("tolerance", None)
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))):
        raise UserInputError(f"{name}: key 'tolerance' must be a number, got {tolerance!r}", hint="e.g. 1e-4")
    dims = _dynamic_dims(name, fields.pop("dynamic_dim", []))
    for key, value in fields.items():
        fields[key] = _option_value(name, specs[key], value)
    given, run = config.split_options(fields)  # names were checked: this checks the run options' values
    try:
        config.CompileConfig().with_options(given)
    except UserInputError as error:
        raise UserInputError(f"{name}: {error.reason}", hint=error.hint) from None
    job = Job(number, entry, model, backend, dict(backend_options), fields, check,
              None if tolerance is None else float(tolerance), None, dims)
    if output is not None:
        try:
            path = output.format(model=safe_name(model), backend=backend, job=number)
        except (KeyError, IndexError, ValueError) as exc:
            raise UserInputError(f"{name}: key 'output' {output!r} has a placeholder it cannot fill ({exc})",
                                 hint="placeholders are {model}, {backend} and {job}") from None
        if not path.endswith(".pte"):
            raise UserInputError(f"{name}: key 'output' {path!r} is not a .pte path", hint="end it with .pte")
        job = attrs.evolve(job, output=path)
    return job


def _dynamic_dims(name: str, value: Any) -> tuple[dynamic_dims.DynamicDim, ...]:
    """A job's `dynamic_dim`: one text or a list of them, each in `--dynamic-dim`'s form."""
    texts = [value] if isinstance(value, str) else value
    key = f"{name}: key 'dynamic_dim'"
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise UserInputError(f"{key} takes a list of {dynamic_dims.FORM} or {dynamic_dims.TIED_FORM}, got {value!r}",
                             hint="e.g. dynamic_dim: [\"x:1:2:32\"]")
    try:
        return tuple(dynamic_dims.parse(text) for text in texts)
    except UserInputError as error:
        raise UserInputError(f"{key}: {error.reason}", hint=error.hint) from None


def _option_value(name: str, spec: config.OptionSpec, value: Any) -> Any:
    """An option's value checked against its kind and choices (as the CLI's flag would read it)."""
    key = f"{name}: option {spec.name!r}"
    if spec.repeated:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, spec.kind) for v in values):
            raise UserInputError(f"{key} takes a {spec.kind.__name__} or a list of them, got {value!r}",
                                 hint=f"e.g. {spec.name}: [\"aten.t.default\"]")
        return tuple(values)
    if value is None and spec.default is None:
        return value
    if spec.kind is bool:
        ok = isinstance(value, bool)
    elif spec.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif spec.kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, spec.kind)
    if not ok:
        raise UserInputError(f"{key} takes a {spec.kind.__name__}, got {value!r}", hint=spec.help)
    if spec.choices and value not in spec.choices:
        raise UserInputError(f"{key}: {value!r} is not one of {', '.join(map(str, spec.choices))}", hint=spec.help)
    return value


def _check_outputs(jobs: Sequence[Job], where: str) -> None:
    seen: dict[str, Job] = {}
    for job in jobs:
        if job.output is None:
            continue
        key = os.path.abspath(os.path.expanduser(job.output))
        if key in seen:
            first = seen[key]
            raise UserInputError(
                f"{where}: job {job.entry} (sweep job {job.number}, {job.label}) and job {first.entry} (sweep job "
                f"{first.number}, {first.label}) write the same output {job.output!r}",
                hint="put {model}, {backend} or {job} in the output path",
            )
        seen[key] = job


def safe_name(model: str) -> str:
    """A MODEL spec as a file name: `transformer:depth=2` -> `transformer_depth-2`;
    `path/to/net.py:make` -> `net_make`."""
    head, _, tail = model.partition(":")
    if head.endswith(".py") or os.sep in head:
        head = os.path.splitext(os.path.basename(head))[0]
    text = f"{head}_{tail}" if tail else head
    text = text.replace("=", "-").replace(",", "_")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "model"


# --- running one job (in a worker) ----------------------------------------------------------


@attrs.frozen
class JobResult:
    """What a worker sends back: the row and the program (the caller writes the file)."""

    row: SweepRow
    pte: bytes | None = None


def _set_threads(threads: int | None) -> None:
    if threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = str(threads)
        import torch

        torch.set_num_threads(threads)


def run_job(job: Job, cache_dir: str | None = None, cache: bool = True, threads: int | None = None,
            cache_max_mb: int | None = None) -> JobResult:
    """Builds the job's model, compiles it (and checks it): the work of one worker, for a
    process pool and a Ray task alike. Never raises for the job's own failure: it is the row's."""
    start = time.perf_counter()
    _set_threads(threads)
    base = _base(job)
    try:
        from compiler.process.dependency_output import DependencyOutput

        # What dependencies print outside the compile's own capture (building the model, the
        # runtime's check, cpuinfo from C) stays off the sweep's terminal too.
        with DependencyOutput():
            return _run_job(job, cache_dir, cache, cache_max_mb, start)
    except Exception as error:  # noqa: BLE001 - one job's failure is its row, the sweep goes on
        return JobResult(failed_row(base, error, time.perf_counter() - start))


def _run_job(job: Job, cache_dir: str | None, cache: bool, cache_max_mb: int | None, start: float) -> JobResult:
    base = _base(job)
    from compiler import api
    from compiler.models.examples import resolve_model

    options = _options(job, cache_dir, cache, cache_max_mb)
    programs = _program_cache(job, options)  # keyed before the model file is read
    module, inputs, own = resolve_model(job.model)
    dynamic_shapes = api.model_dynamic_shapes(job.model, module, inputs, own, job.dynamic_dim)
    artifact = api.compile(module, inputs, job.backend, backend_options=job.backend_options or None,
                           dynamic_shapes=dynamic_shapes, **options)
    if programs is not None:
        programs.store(artifact.program, artifact.report)
    check = None
    if job.check:
        from compiler.running import runtime

        check = runtime.compare_with_eager(artifact, module, inputs, tolerance=job.tolerance).to_json()
    return JobResult(_done_row(base, artifact.report, artifact.pte, check, start), artifact.pte)


def _options(job: Job, cache_dir: str | None, cache: bool, cache_max_mb: int | None) -> dict[str, Any]:
    """The job's compile options with the sweep's cache settings (unless the job sets its own)."""
    options = dict(job.options)
    if cache_dir is not None and "cache_dir" not in options and _has_run_option("cache_dir"):
        options["cache_dir"] = cache_dir
    if _has_run_option("cache"):
        options.setdefault("cache", cache)
    if cache_max_mb is not None and _has_run_option("cache_max_mb"):
        options.setdefault("cache_max_mb", cache_max_mb)
    return options


def _program_cache(job: Job, options: Mapping[str, Any]):
    """The job's `ProgramCache` (None when its run is not cached)."""
    from compiler.driver.config import CompileConfig, split_options
    from compiler.driver.program_cache import ProgramCache

    config_options, driving = split_options(options)
    config = CompileConfig(backend=job.backend, backend_options=dict(job.backend_options or {})).with_options(config_options)
    return ProgramCache.for_run(job.model, config, driving, job.dynamic_dim)


def _from_program_cache(job: Job, common: Mapping[str, Any]) -> JobResult | None:
    """A job without a check whose program the program cache holds, served here: no worker,
    no torch (None: the job runs in a worker)."""
    start = time.perf_counter()
    if job.check:
        return None
    try:
        programs = _program_cache(job, _options(job, **common))
        cached = programs.load() if programs is not None else None
    except Exception as error:  # noqa: BLE001 - the worker meets it again and records it as the job's
        logger.info("job %s: program cache not used (%s: %s)", job.label, type(error).__name__, error)
        return None
    if cached is None:
        return None
    return JobResult(_done_row(_base(job), cached.report, cached.pte, None, start), cached.pte)


def _done_row(base: Mapping[str, Any], report: Any, pte: bytes, check: Mapping[str, Any] | None,
              start: float) -> SweepRow:
    return SweepRow(
        **base,
        status=STATUS_OK if check is None or check["passed"] else STATUS_MISMATCH,
        seconds=time.perf_counter() - start,
        cached_stages=tuple(r.stage for r in report.stages if getattr(r, "cached", False)),
        pte_bytes=len(pte),
        delegated=_delegated(report),
        check=check,
        compile_seconds=report.total_seconds,
        stage_seconds={r.stage: r.seconds + r.verify_seconds for r in report.stages},
    )


def failed_row(base: Mapping[str, Any], error: BaseException, seconds: float) -> SweepRow:
    if isinstance(error, CompileError):
        message, stage = str(error), error.stage
    else:
        message, stage = f"{type(error).__name__}: {error}", None
    return SweepRow(**{**base, "output": None}, status=STATUS_ERROR, seconds=seconds, error=message,
                    error_type=type(error).__name__, error_stage=stage)


def _has_run_option(name: str) -> bool:
    return name in attrs.fields_dict(config.DriverOptions)


def _delegated(report: Any) -> float | None:
    plan = getattr(report, "plan", None)
    if plan is None:
        return None
    shares = plan.shares()
    total = shares[-1].total if shares else 0
    return sum(s.ops for s in shares if s.backend_id is not None) / total if total else 0.0


def _worker_start(threads: int | None) -> None:
    """A pool worker's first step: one torch thread each when several share the cores, and
    the pipeline's imports (so a job's time is its own work; already there when the fork
    server preloaded them)."""
    import compiler.tools.pipeline_imports  # noqa: F401

    _set_threads(threads)


# --- the sweep ------------------------------------------------------------------------------


def sweep(
    jobs: Iterable[Mapping[str, Any]] | str | os.PathLike,
    *,
    workers: int | None = None,
    ray_address: str | None = None,
    cache_dir: str | None = None,
    cache: bool = True,
    cache_max_mb: int | None = None,
    on_result: Callable[[SweepRow], None] | None = None,
) -> list[SweepRow]:
    """Compiles every job (mappings, or the path of a `.json`/`.toml`/`.yaml` jobs file) and
    returns one `SweepRow` per expanded job, in job order.

    `workers`: processes of a pool (default: the CPU count, at most one per job), forked from
    a server process that imported the pipeline once and stays for this process's lifetime;
    with more than one, each worker runs torch on one thread. `ray_address` ("auto", or a
    cluster's address) runs the jobs as Ray tasks instead (`pip install -e '.[ray]'`);
    when Ray is already initialized in this process, its connection is used. `cache_dir`:
    the stage cache's folder, shared by every worker (on Ray, a folder every node sees),
    None for no cache. Outputs are written here, from the bytes the workers return;
    `on_result(row)` is called as each job finishes. A bad job is a `UserInputError`
    before any work; a job that fails is its row's error.
    """
    expanded = expand_jobs(jobs)
    if workers is not None and workers < 1:
        raise UserInputError(f"workers must be at least 1, got {workers}", hint="e.g. workers=2")
    _prepare_outputs(expanded)
    if cache_dir is not None:
        cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
        os.makedirs(cache_dir, exist_ok=True)
    common = {"cache_dir": cache_dir, "cache": cache, "cache_max_mb": cache_max_mb}
    rows: dict[int, SweepRow] = {}

    def finished(job: Job, result: JobResult) -> None:
        row = result.row
        if result.pte is not None and job.output:
            try:
                with open(job.output, "wb") as f:
                    f.write(result.pte)
            except OSError as exc:
                row = failed_row(_base(job), exc, row.seconds)
                row = attrs.evolve(row, error=f"writing {job.output!r} failed: {exc}")
        rows[job.number] = row
        if on_result is not None:
            on_result(row)

    pending = []
    for job in expanded:
        served = _from_program_cache(job, common)
        if served is not None:
            finished(job, served)
        else:
            pending.append(job)
    if pending and ray_address is not None:
        _run_on_ray(pending, ray_address, common, finished)
    elif pending:
        _run_in_pool(pending, workers or os.cpu_count() or 1, common, finished)
    return [rows[job.number] for job in expanded]


def _prepare_outputs(jobs: Sequence[Job]) -> None:
    for job in jobs:
        if job.output is None:
            continue
        folder = os.path.dirname(os.path.abspath(os.path.expanduser(job.output)))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise UserInputError(f"job {job.entry}: key 'output' {job.output!r}: cannot create the folder "
                                 f"{folder!r} ({exc.strerror})", hint="give a place under a folder you can write to")
        try:
            if os.path.isdir(job.output):
                raise IsADirectoryError(21, "Is a directory")
            prove_file_writable(job.output)
        except OSError as exc:
            raise UserInputError(f"job {job.entry}: key 'output' {job.output!r} cannot be written ({exc.strerror})",
                                 hint="give a .pte path under a folder you can write to") from None


def _run_in_pool(jobs: Sequence[Job], workers: int, common: Mapping[str, Any],
                 finished: Callable[[Job, JobResult], None]) -> None:
    import concurrent.futures
    import multiprocessing

    workers = max(1, min(workers, len(jobs)))
    threads = 1 if workers > 1 else None
    # Workers fork from a server process that imported the pipeline once and runs nothing else
    # (a worker forked from the caller could inherit torch's threads in any state). The
    # server lives as long as this process: later sweeps' workers start at once.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["compiler.tools.pipeline_imports"])
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_start,
                                                initargs=(threads,)) as pool:
        futures = {pool.submit(run_job, job, threads=threads, **common): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            try:
                result = future.result()
            except Exception as error:  # noqa: BLE001 - the worker died (a crash in C, killed)
                result = JobResult(failed_row(_base(job), error, 0.0))
            finished(job, result)


def _base(job: Job) -> dict[str, Any]:
    return {"job": job.number, "label": job.label, "model": job.model, "backend": job.backend, "output": job.output}


def _run_on_ray(jobs: Sequence[Job], address: str, common: Mapping[str, Any],
                finished: Callable[[Job, JobResult], None]) -> None:
    try:
        import ray
    except ModuleNotFoundError:
        raise UserInputError("Ray is not installed", hint="pip install -e '.[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - ray's own connection errors
            raise UserInputError(f"cannot connect to the Ray cluster at {address!r}: {type(exc).__name__}: {exc}",
                                 hint="start one (ray start --head) or give its address") from None
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(run_job)
        pending = {task.remote(job, threads=1, **common): job for job in jobs}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                job = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - the task's worker died
                    result = JobResult(failed_row(_base(job), error, 0.0))
                finished(job, result)
    finally:
        if started:
            ray.shutdown()
