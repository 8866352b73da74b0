"""Compile sweeps: jobs files, cross products, mistakes named before work, a 2-worker pool and Ray."""

import contextlib
import importlib.util
import io
import json
import os
import textwrap

import pytest

import compiler
from compiler.tools import sweeps
from compiler.cli.main import main
from compiler.ir.errors import UserInputError

FAILING_FACTORY = textwrap.dedent(
    """
    def broken():
        raise RuntimeError("no weights here")
    """
)


def test_lists_expand_to_the_cross_product():
    jobs = sweeps.expand_jobs([
        {"model": ["mlp", "convnet"], "backend": ["portable", "xnnpack"], "dry_run_mode": ["auto", "never"],
         "fold_skip_ops": ["aten.t.default"], "output": "out/{model}-{backend}-{job}.pte"},
        {"model": "transformer:depth=2,dim=32", "fold_skip_ops": [["aten.t.default"], []]},
    ])
    assert len(jobs) == 2 * 2 * 2 + 2
    assert [job.number for job in jobs] == list(range(1, 11))
    assert {(j.model, j.backend, j.options["dry_run_mode"]) for j in jobs[:8]} == {
        (m, b, d) for m in ("mlp", "convnet") for b in ("portable", "xnnpack") for d in ("auto", "never")
    }
    # A list of values is one value of an option that takes several; a list of lists expands.
    assert all(j.options["fold_skip_ops"] == ("aten.t.default",) for j in jobs[:8])
    assert [j.options["fold_skip_ops"] for j in jobs[8:]] == [("aten.t.default",), ()]
    assert jobs[0].output == "out/mlp-portable-1.pte"
    assert jobs[8].backend == "portable" and jobs[8].entry == 2
    assert sweeps.safe_name("transformer:depth=2,dim=32") == "transformer_depth-2_dim-32"
    assert sweeps.safe_name("models/net.py:make") == "net_make"


def test_json_toml_and_yaml_files_read_as_the_same_jobs(tmp_path):
    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": [
        {"model": ["mlp", "shared_buffer"], "backend": "xnnpack", "backend_options": {"per_op_mode": True},
         "emit_stacktrace": True, "check": True, "output": "o/{model}.pte"},
        {"model": "convnet", "dry_run_mode": ["always", "never"], "output": "o/c-{job}.pte"},
    ]}))
    (tmp_path / "jobs.toml").write_text(textwrap.dedent("""
        [[jobs]]
        model = ["mlp", "shared_buffer"]
        backend = "xnnpack"
        backend_options = { per_op_mode = true }
        emit_stacktrace = true
        check = true
        output = "o/{model}.pte"

        [[jobs]]
        model = "convnet"
        dry_run_mode = ["always", "never"]
        output = "o/c-{job}.pte"
    """))
    (tmp_path / "jobs.yaml").write_text(textwrap.dedent("""
        - model: [mlp, shared_buffer]
          backend: xnnpack
          backend_options: {per_op_mode: true}
          emit_stacktrace: true
          check: true
          output: o/{model}.pte
        - model: convnet
          dry_run_mode: [always, never]
          output: o/c-{job}.pte
    """))
    read = [sweeps.expand_jobs(str(tmp_path / name)) for name in ("jobs.json", "jobs.toml", "jobs.yaml")]
    assert read[0] == read[1] == read[2]
    assert len(read[0]) == 4 and read[0][3].options == {"dry_run_mode": "never"}


@pytest.mark.parametrize(
    "jobs, message",
    [
        ([{"model": "mlp"}, {"model": "mlp", "bakend": "xnnpack"}], "job 2: unknown key 'bakend'"),
        ([{"model": "mlp"}, {"backend": "xnnpack"}], "job 2 has no 'model'"),
        ([{"model": "mlp", "fold_skip": ["aten.t.default"]}], "job 1: unknown key 'fold_skip'"),
        ([{"model": "mlp", "dry_run_mode": "sometimes"}], "job 1: option 'dry_run_mode': 'sometimes' is not one of"),
        ([{"model": "mlp", "emit_stacktrace": "yes"}], "job 1: option 'emit_stacktrace' takes a bool"),
        ([{"model": "nosuchmodel"}], "job 1: key 'model': MODEL 'nosuchmodel' is neither"),
        ([{"model": "mlp", "backend": ["portable", "tpu"]}], "job 1: key 'backend': unknown backend 'tpu'"),
        ([{"model": "mlp", "stop_after": "fold"}], "job 1: key 'stop_after' cannot be set in a sweep job"),
        ([{"model": ["mlp", "convnet"], "output": "same.pte"}], "write the same output 'same.pte'"),
        ([{"model": "mlp", "output": "x/{modle}.pte"}], "job 1: key 'output' 'x/{modle}.pte' has a placeholder"),
        ([{"model": "mlp", "check": "yes"}], "job 1: key 'check' must be true or false"),
        ([{"model": "mlp", "dynamic_dim": ["x:0:8", "x:1"]}],
         "job 1: key 'dynamic_dim': 'x:1' is neither INPUT:DIM:[MIN:]MAX nor INPUT:DIM=OTHER:DIM"),
        ([{"model": "mlp", "dynamic_dim": 8}], "job 1: key 'dynamic_dim' takes a list of INPUT:DIM:[MIN:]MAX"),
        ([], "there are no jobs"),
    ],
)
def test_a_bad_job_is_named_before_any_work(jobs, message):
    with pytest.raises(UserInputError) as caught:
        sweeps.expand_jobs(jobs)
    assert message in str(caught.value)


def test_an_output_no_file_can_be_made_at_is_named_before_any_work(tmp_path):
    """/proc passes a permission check for root; making the file is the test that holds."""
    with pytest.raises(UserInputError, match=r"job 1: key 'output' '/proc/x.pte' cannot be written \(No such file"):
        sweeps.sweep([{"model": "mlp", "output": "/proc/x.pte"}], cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.stage*"))


def test_a_bad_jobs_file_is_named_by_the_cli_at_once(tmp_path, capsys):
    (tmp_path / "jobs.toml").write_text('[[jobs]]\nmodel = "mlp"\n\n[[jobs]]\nmodel = "mlp"\nwokers = 2\n')
    assert main(["sweep", str(tmp_path / "jobs.toml")]) == 2
    err = capsys.readouterr().err
    assert "jobs.toml': job 2: unknown key 'wokers'" in err and "Traceback" not in err
    (tmp_path / "top.json").write_text('{"job": []}')
    assert main(["sweep", str(tmp_path / "top.json")]) == 2
    assert "unknown top-level key(s) 'job'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pool_sweep(tmp_path_factory):
    """One 2-worker sweep through the CLI: mlp on portable and xnnpack (checked), and a job
    whose model factory raises."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "broken.py").write_text(FAILING_FACTORY)
    jobs = {"jobs": [
        {"model": "mlp:features=8,hidden=16", "backend": ["portable", "xnnpack"], "check": True,
         "output": str(folder / "out" / "{model}-{backend}.pte")},
        {"model": f"{folder / 'broken.py'}:broken", "output": str(folder / "out" / "{model}.pte")},
    ]}
    (folder / "jobs.json").write_text(json.dumps(jobs))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["sweep", str(folder / "jobs.json"), "--workers", "2", "--cache-dir", str(folder / "cache")])
    return folder, status, out.getvalue(), err.getvalue()


def test_a_two_worker_sweep_writes_what_single_compiles_write(pool_sweep):
    from compiler.models.examples import resolve_model

    folder, *_ = pool_sweep
    module, inputs, _ = resolve_model("mlp:features=8,hidden=16")
    for backend in ("portable", "xnnpack"):
        single = compiler.compile(module, inputs, backend).pte
        assert (folder / "out" / f"mlp_features-8_hidden-16-{backend}.pte").read_bytes() == single


def test_a_failing_job_is_recorded_and_the_others_pass(pool_sweep):
    folder, status, out, err = pool_sweep
    assert status == 1
    assert "2 of 3 job(s) passed" in out
    assert "the model factory for" in err and "RuntimeError: no weights here" in err
    assert not (folder / "out" / "broken_broken.pte").exists()
    # One progress line per job as it finishes.
    assert sorted(line.split("]")[0] for line in err.splitlines() if line.startswith("[")) == ["[1/3", "[2/3", "[3/3"]


def test_the_table_has_its_columns(pool_sweep):
    _, _, out, _ = pool_sweep
    header = out.splitlines()[0]
    for column in sweeps.TABLE_HEADER:
        assert column in header
    rows = {line.split()[0]: line for line in out.split("\n\n")[0].splitlines()[2:]}
    assert set(rows) == {"1", "2", "3"}
    assert "ok" in rows["1"] and "0%" in rows["1"] and "OK" in rows["1"]
    assert "100%" in rows["2"] and "mlp_features-8_hidden-16-xnnpack.pte" in rows["2"]
    assert "error: UserInputError" in rows["3"]


def test_a_job_row_holds_the_artifact_data_and_a_warm_cache_shows(tmp_path):
    """`run_job` is what every worker runs (pool and Ray): here in this process, twice."""
    job, failing = sweeps.expand_jobs([
        {"model": "mlp:features=8,hidden=16", "backend": "xnnpack", "check": True},
        {"model": "mlp:features=8,hidden=16", "backend": "xnnpack", "backend_options": {"nope": 1}},
    ])
    cold = sweeps.run_job(job, cache_dir=str(tmp_path))
    warm = sweeps.run_job(job, cache_dir=str(tmp_path))
    assert cold.row.passed and cold.row.cached_stages == () and cold.row.delegated == 1.0
    assert cold.row.check["passed"] and cold.row.pte_bytes == len(cold.pte)
    assert "emit" in warm.row.cached_stages and warm.pte == cold.pte
    failed = sweeps.run_job(failing, cache_dir=str(tmp_path))
    assert failed.pte is None and failed.row.status == "error" and failed.row.error_type == "UserInputError"
    assert "has no option 'nope'" in failed.row.error and failed.row.output is None
    with pytest.raises(AttributeError):
        failed.row.status = "ok"  # rows are frozen values


def test_a_job_with_dynamic_dims_is_checked_at_the_ends_of_their_ranges(tmp_path):
    """`dynamic_dim` takes --dynamic-dim's form; a list of lists expands, as an option of several values does."""
    job, other = sweeps.expand_jobs([
        {"model": "transformer:depth=1,dim=32,seq=8", "dynamic_dim": [["x:1:2:32"], ["x:1:4:16"]], "check": True},
    ])
    assert job.label == "1 transformer:depth=1,dim=32,seq=8 (dynamic_dim=x:1:2:32)"
    assert str(other.dynamic_dim[0]) == "x:1:4:16"
    row = sweeps.run_job(job, cache_dir=str(tmp_path)).row
    assert row.passed and row.check["sizes"] == ["x's dim 1 = 2", "x's dim 1 = 32"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install -e '.[ray]')")
def test_ray_runs_the_same_jobs_to_the_same_bytes(pool_sweep, tmp_path):
    """A local Ray instance (in this process, loopback only, 2 CPUs) runs the jobs to the
    bytes the process pool wrote."""
    import ray

    folder, *_ = pool_sweep
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        rows = compiler.sweep(
            [{"model": "mlp:features=8,hidden=16", "backend": ["portable", "xnnpack"], "check": True,
              "output": str(tmp_path / "{model}-{backend}.pte")}],
            ray_address="auto", cache_dir=str(tmp_path / "cache"),
        )
    finally:
        ray.shutdown()
    assert [row.status for row in rows] == ["ok", "ok"]
    for name in ("mlp_features-8_hidden-16-portable.pte", "mlp_features-8_hidden-16-xnnpack.pte"):
        assert (tmp_path / name).read_bytes() == (folder / "out" / name).read_bytes()
    assert os.listdir(tmp_path / "cache")  # the workers filled the cache folder given


def test_reading_jobs_imports_no_torch(tmp_path):
    """The parent only reads, checks and dispatches: the workers import the pipeline."""
    import subprocess
    import sys

    (tmp_path / "jobs.yaml").write_text("- model: [mlp, convnet]\n  backend: [portable, xnnpack]\n")
    code = (
        "import sys; from compiler.tools import sweeps; import compiler.cli.main; "
        f"assert len(sweeps.expand_jobs({str(tmp_path / 'jobs.yaml')!r})) == 4; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


WHERE_FACTORY = textwrap.dedent(
    """
    import os

    import torch


    def where():
        # The process this worker was forked from.
        with open(os.path.join(os.path.dirname(__file__), f"{os.getpid()}.txt"), "w") as f:
            f.write(str(os.getppid()))
        return torch.nn.Linear(4, 4), (torch.randn(2, 4),)
    """
)


def test_workers_fork_from_one_server_that_imported_the_pipeline(tmp_path):
    """Workers do not import torch and ExecuTorch each (about 5 s apiece): they fork from a
    server that did once, and that server serves the next sweep's workers too."""
    (tmp_path / "where.py").write_text(WHERE_FACTORY)
    job = {"model": f"{tmp_path / 'where.py'}:where", "backend": "portable"}
    for _ in range(2):
        rows = compiler.sweep([job, job], workers=2)
        assert [row.status for row in rows] == ["ok", "ok"]
    (server,) = {int(record.read_text()) for record in tmp_path.glob("*.txt")}
    assert server != os.getpid()
    assert b"forkserver" in open(f"/proc/{server}/cmdline", "rb").read()
    with open(f"/proc/{server}/maps") as maps:
        assert "libtorch" in maps.read()  # the server imported the pipeline, torch with it
