"""A whole compile as `python -m compiler compile` runs it: a MODEL spec in; the program, its
check, where a failed check diverges and the report files out.

What it adds to `compiler.compile`: the model built from its spec, the program cache (a compile
it has seen is loaded, no stage runs), the program or the stage file saved, the check against
eager (with the eager quantized model a resumed run needs), locate on a failed check, and the
JSON and HTML reports. The configuration is built once, here, and given to the compile and to
the program cache alike. The CLI only checks the places it will write, calls this, and prints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import attrs

from compiler.driver import config as configuration
from compiler.ir import targets
from compiler.ir.errors import UserInputError
from compiler.models import catalog
from compiler.stages import STAGE_NAMES, schemes

logger = logging.getLogger(__name__)

# How the job names the files it writes in an error (the CLI passes its flags).
PLACES = {"output": "output", "report_json": "report_json", "report_html": "report_html"}


def _directly(doing: str, work: Callable, *args, **kwargs) -> Any:
    return work(*args, **kwargs)


@attrs.frozen
class CompileJob:
    """What a compile job did: `result` (a `CompileResult`, or the program cache's hit), the
    report (with the check, if one ran), the check, the location of a failed check, the file
    the program or the stage went to (None: nothing written) and the report files written."""

    result: Any
    report: Any
    check: Any = None
    location: Any = None
    output: str | None = None
    reports: tuple[str, ...] = ()
    nodes: Any = None  # the node check (`compiler.check_nodes`), when asked

    @property
    def passed(self) -> bool:
        return (self.check is None or self.check.passed) and (self.nodes is None or self.nodes.passed)


def compile_job(
    model: str | None,
    backend: str | None = None,
    *,
    backend_options: Mapping[str, Any] | None = None,
    dynamic_dim: Sequence[Any] = (),
    calibration_file: str | None = None,
    calibration_draws: int | None = None,
    output: str | None = None,
    report_json: str | None = None,
    report_html: str | None = None,
    check: bool = False,
    tolerance: float | None = None,
    locate: bool = False,
    check_nodes: bool = False,
    instruments: Sequence[Any] = (),
    quietly: Callable[..., Any] = _directly,
    places: Mapping[str, str] = PLACES,
    **options: Any,
) -> CompileJob:
    """Compile the MODEL spec `model` (a built-in example, path.py:factory or a save_pretrained
    folder with its task) for `backend`, or resume `resume_from` (an option), and do with the
    program what is asked. `options` are `compiler.compile`'s by their names; without a
    `cache_dir` or `reproducer_dir` the user's cache folder holds them. `quietly(doing, work,
    *args)` runs each step that is not a stage (the CLI shows a status line and keeps what
    dependencies print)."""
    resume_from = options.get("resume_from")
    backend = backend or (None if resume_from else targets.DEFAULT)
    _refuse_mistakes(model, resume_from, check, locate, check_nodes, dynamic_dim, calibration_file, calibration_draws)
    options = _with_default_folders(options)
    config_options, driving = configuration.split_options(options)
    run = {name: value for name, value in options.items() if name not in config_options}
    if check_nodes:  # it reads every stage's program, which a stage cache hit does not load
        run["cache"] = False
    config = None
    if not resume_from:
        config = configuration.CompileConfig(
            backend=backend, backend_options=dict(backend_options or {})
        ).with_options(config_options)
        # A scheme the backend does not take is refused now, not after the model is built.
        schemes.chosen_scheme(config.quantize, config.backend)
    programs = None
    if model and config is not None:
        from compiler.driver.program_cache import ProgramCache

        written = [path for path in (output, report_json, report_html) if path]
        programs = ProgramCache.for_run(model, config, driving, dynamic_dim, calibration_file or calibration_draws,
                                        written)
    # A check builds and captures the model anyway (the stage cache serves the rest); the HTML
    # report draws the partitioned program, which the program cache does not keep.
    served = programs is not None and not check and not check_nodes and not report_html
    result = programs.load() if served else None
    module = inputs = dynamic_shapes = calibration = None
    if result is None:
        from compiler import api
        from compiler.models.examples import resolve_model

        loading = f" and the {backend} backend" if backend else ""
        quietly(f"loading ExecuTorch{loading}", load_pipeline, backend)
        if model:
            module, inputs, dynamic_shapes = quietly("building the model", resolve_model, model)
            calibration = quietly("reading the calibration inputs", calibration_inputs, model, calibration_file,
                                  calibration_draws)
        dynamic_shapes = api.model_dynamic_shapes(model, module, inputs, dynamic_shapes, dynamic_dim)
        result = api.compile(
            None if resume_from else module, None if resume_from else inputs,
            backend if resume_from else None,
            backend_options=backend_options if resume_from else None,
            dynamic_shapes=dynamic_shapes, calibration=calibration, config=config,
            instruments=list(instruments), **(options if resume_from else run),
        )
        if programs is not None and result.stopped_after == STAGE_NAMES[-1]:
            programs.store(result.program, result.report)
    report = attrs.evolve(result.report, model=model)
    cache_dir = options.get("cache_dir") if options.get("cache", True) else None
    output = _save(result, output, places["output"], cache_dir)
    found = location = None
    if check and result.stopped_after == STAGE_NAMES[-1]:
        result, found = _check(result, module, inputs, dynamic_shapes, calibration, tolerance, bool(resume_from),
                               quietly)
        report = attrs.evolve(report, check=found.to_json())
    if locate and found is not None and not found.passed:
        from compiler.tools.locate import locate_result

        location = quietly("locating where the outputs diverge", locate_result, result, module, inputs,
                           tolerance=tolerance)
    nodes = None
    if check_nodes and result.stopped_after == STAGE_NAMES[-1]:
        from compiler.tools.locate.every_node import check_nodes as check_every_node

        nodes = quietly("checking every node against eager", check_every_node, result, module, inputs)
        report = attrs.evolve(report, check_nodes=nodes.to_json())
    reports = []
    if report_json:
        with _writing(places["report_json"], report_json, "the report", cache_dir), open(report_json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
        reports.append(report_json)
    if report_html:
        if module is not None and getattr(result.stages, "partition", None) is None and _reached_partition(result):
            # The stage cache stood in for partition without loading its program: the page's graph
            # is drawn from it, so it is made again (from the cache's latest program before it).
            again = quietly("drawing the partitioned program", _partitioned, result, module, inputs, dynamic_shapes,
                            calibration, {k: v for k, v in run.items() if k not in ("instruments", "stop_after")})
            result = attrs.evolve(result, stages={**result.stages, "partition": again})
        title = f"{model or report.resumed_from} compiled for {report.config.get('backend')}"
        with _writing(places["report_html"], report_html, "the report", cache_dir), open(report_html, "w") as f:
            f.write(html_page(report, result, title, location))
        reports.append(report_html)
    return CompileJob(result, report, found, location, output, tuple(reports), nodes)


def _save(result: Any, output: str | None, place: str, cache_dir: str | None) -> str | None:
    """The program (or, for a run stopped early, its stage file) written to `output`; the path
    written, None when nothing was (an artifact no stage file holds)."""
    if not output:
        return None
    if result.stopped_after == STAGE_NAMES[-1]:
        with _writing(place, output, "the program", cache_dir):
            result.save(output)
        return output
    from compiler.driver.stage_files import can_save, save_stage_file

    if not can_save(result.artifact):
        return None
    with _writing(place, output, "the stage file", cache_dir):
        save_stage_file(output, result.artifact, result.stopped_after, result.config)
    return output


def _check(result: Any, module: Any, inputs: Any, dynamic_shapes: Any, calibration: Any, tolerance: float | None,
           resumed: bool, quietly: Callable[..., Any]) -> tuple[Any, Any]:
    """The check against eager, and the result it checked (with the eager quantized model a
    resumed run's check needs)."""
    from compiler import api
    from compiler.running import runtime

    if resumed:  # the check needs the eager model its program quantized
        result = quietly("quantizing the model for the check", api.with_quantized_model, result, module, inputs,
                         dynamic_shapes, calibration)
    found = quietly("checking against eager", runtime.compare_with_eager, result, module, inputs, tolerance=tolerance)
    return result, found


def _reached_partition(result: Any) -> bool:
    return STAGE_NAMES.index(result.stopped_after) >= STAGE_NAMES.index("partition")


def _partitioned(result: Any, module: Any, inputs: Any, dynamic_shapes: Any, calibration: Any,
                 run: Mapping[str, Any]) -> Any:
    """The partitioned program of `result`'s compile, compiled again up to partition."""
    from compiler import api

    again = api.compile(module, inputs, dynamic_shapes=dynamic_shapes, calibration=calibration, config=result.config,
                        stop_after="partition", **run)
    return again.stages.partition


def html_page(report: Any, result: Any, title: str, location: Any = None) -> str:
    """The report as one HTML page, its graph the partitioned program's."""
    from compiler.reporting.html_report import render_html

    return render_html(report, getattr(result.stages, "partition", None), title=title,
                       located=location.highlight() if location else None)


def _refuse_mistakes(model, resume_from, check, locate, check_nodes, dynamic_dim, calibration_file,
                     calibration_draws) -> None:
    """What the job cannot do with what it was given, before any work (by the keywords' names,
    which the CLI shows as its flags)."""
    if not model and not resume_from:
        raise UserInputError("compile needs a MODEL (or resume_from FILE)", hint="see `python -m compiler examples`")
    if locate and not check:
        raise UserInputError("locate=True locates a failed check=True", hint="add check=True")
    if check_nodes and resume_from:
        raise UserInputError("check_nodes=True compares the captured program's nodes, which a resumed run does not "
                             "have", hint="compile the MODEL from the start")
    if check and not model:
        raise UserInputError("check=True needs the MODEL to compare with", hint="pass MODEL along with resume_from")
    if model:
        catalog.check_model_spec(model)
    if resume_from and not os.path.isfile(resume_from):
        raise UserInputError(f"resume_from {resume_from!r}: the stage file does not exist", hint="give a .stage file "
                             "written by stop_after, dump_dir or a failed compile")
    if calibration_file and not os.path.isfile(calibration_file):
        raise UserInputError(f"calibration_file {calibration_file!r}: the file does not exist", stage="quantize",
                             hint="give a file written by torch.save([inputs, ...], FILE)")
    if calibration_draws is not None and calibration_draws < 1:
        raise UserInputError(f"calibration_draws {calibration_draws}: give at least 1", stage="quantize")
    if dynamic_dim and not model:
        raise UserInputError("dynamic_dim needs the MODEL", hint="a resumed run keeps its program's dynamic sizes")
    if (calibration_file or calibration_draws) and not model:
        raise UserInputError("calibration needs the MODEL", stage="quantize",
                             hint="pass MODEL, or drop calibration_file and calibration_draws")


def _with_default_folders(options: Mapping[str, Any]) -> dict[str, Any]:
    """Reproducers and the stage cache in the user's cache folder unless told otherwise."""
    options = dict(options)
    if "reproducer_dir" not in options and "dump_dir" not in options:
        from compiler.driver.instruments import default_reproducer_dir

        options["reproducer_dir"] = default_reproducer_dir()
    if "cache_dir" not in options and options.get("cache", True):
        from compiler.driver.cache import default_cache_dir

        options["cache_dir"] = default_cache_dir()
    return options


def load_pipeline(backend: str | None) -> None:
    """The pipeline's heavy imports (they take seconds)."""
    import compiler.driver.pipeline  # noqa: F401
    from compiler import backends
    from compiler.stages import default_stages

    default_stages()
    if backend:
        backends.load(backend)


def calibration_inputs(model: str, calibration_file: str | None, draws: int | None) -> Any:
    """The calibration inputs a static scheme quantizes with: `draws` draws of the MODEL spec's
    inputs, or those `calibration_file` holds (None: neither given)."""
    if draws:
        from compiler.models.examples import draw_inputs

        return draw_inputs(model, draws)
    if not calibration_file:
        return None
    import torch

    try:
        return torch.load(calibration_file, weights_only=True)
    except Exception as exc:  # torch.load fails in many ways on a file it did not write
        raise UserInputError(
            f"calibration {calibration_file!r} is not a torch.save'd list of input tuples ({type(exc).__name__}: {exc})",
            stage="quantize", hint="write it with torch.save([(tensor, ...), ...], FILE)",
        ) from exc


@contextlib.contextmanager
def _writing(place: str, path: str, what: str, cache_dir: str | None):
    """A write after the compile that fails (a full disk, a mount gone read-only) is a named
    error that says where the work is kept."""
    try:
        yield
    except OSError as exc:
        kept = (
            f"the stage cache in {cache_dir} holds the compiled stages: fix the path or free the space and "
            "run the same command again, which loads them instead of compiling"
            if cache_dir
            else "the compile was not cached: fix the path or free the space and run it again"
        )
        raise UserInputError(f"{place} {path!r}: writing {what} failed after the compile ({exc.strerror})",
                             hint=kept) from None
