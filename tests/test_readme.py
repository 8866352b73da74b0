"""The README's two set-up commands stay true: CI runs the test command verbatim."""

import pathlib

import pytest

from compiler.tools import readme

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:6] if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("name", list(readme.GENERATED))
def test_each_generated_readme_section_is_what_the_code_generates(name):
    text = (ROOT / "README.md").read_text()
    assert readme.section(text, name) == readme.generator(name)().strip(), (
        "regenerate it: python -m compiler.tools.readme README.md"
    )
