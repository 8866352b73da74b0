"""The README's two set-up commands stay true (CI runs the test command verbatim), and the
generated sections of docs/ are what the code (or the committed measurements) give."""

import json
import pathlib
import re

import pytest

from compiler.tools import readme

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:6] if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("name", list(readme.GENERATED))
def test_each_generated_section_is_what_the_code_generates(name):
    text = (ROOT / readme.document(name)).read_text()
    assert readme.section(text, name) == readme.generator(name)().strip(), (
        "regenerate it: python -m compiler.tools.readme"
    )


def test_the_model_suite_table_is_the_committed_results():
    from benchmarks import model_suite  # light: builds no model

    with open(ROOT / "benchmarks" / "results" / "model_suite.json") as f:
        results = json.load(f)["results"]
    text = (ROOT / readme.document("model-suite-table")).read_text()
    assert readme.section(text, "model-suite-table") == model_suite.table(results), (
        "regenerate it: python -m benchmarks.model_suite --json benchmarks/results/model_suite.json "
        f"--doc {readme.document('model-suite-table')}"
    )


def test_the_performance_section_is_the_committed_results():
    from benchmarks import performance  # reads the results' JSON, measures nothing

    text = (ROOT / readme.document("performance-table")).read_text()
    rendered = performance.render()
    assert "| xnnpack | stack, depth 48 |" in rendered and "Run time" in rendered
    assert readme.section(text, "performance-table") == rendered.strip(), (
        "regenerate it: python -m benchmarks.performance --doc docs/performance.md"
    )


def _documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_generated_sections_live_only_in_their_document():
    for path in _documents():
        text = path.read_text()
        for name in [*readme.GENERATED, *readme.MEASURED]:
            if path != ROOT / readme.document(name):
                assert f"<!-- {name}:begin -->" not in text, f"{path.relative_to(ROOT)} holds a copy of {name}"


def test_doc_links_resolve_inside_the_project():
    for path in _documents():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{path.relative_to(ROOT)} links outside the project: {target}"
            assert resolved.exists(), f"{path.relative_to(ROOT)} links to a missing file: {target}"


def test_the_readme_reads_in_five_minutes():
    """At most 200 lines: the two commands, what it is, a short tour, links; the rest is in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_readme_test_command_installs_what_every_default_test_needs():
    """A test that skips without a module (importorskip, find_spec) has it installed by the README's
    test command, unless it is not in the default run (the Ray sweep is `-m slow`)."""
    import tomllib

    command = (ROOT / "README.md").read_text().splitlines()[4]
    installed = set(re.search(r"-e '\.\[([\w,]+)\]'", command).group(1).split(","))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in installed for r in project["optional-dependencies"][extra])]
    packages = {re.match(r"[\w.-]+", r).group(0).lower() for r in requirements}
    distributions = {"model_explorer": "ai-edge-model-explorer", "mlx.core": "mlx"}
    slow_only = {"ray"}
    needed = set()
    for path in (ROOT / "tests").rglob("*.py"):
        needed |= set(re.findall(r"(?:importorskip|find_spec)\(\"([\w.]+)\"", path.read_text()))
    assert needed, "the scan found no skipping test"
    missing = sorted(m for m in needed - slow_only if distributions.get(m, m).lower() not in packages)
    assert not missing, f"default tests skip without {missing}: add their extra to the README's test command"
    sweeps = (ROOT / "tests" / "test_sweep.py").read_text()
    assert sweeps.count('find_spec("ray")') == 1
    assert '@pytest.mark.slow\n@pytest.mark.skipif(importlib.util.find_spec("ray")' in sweeps
