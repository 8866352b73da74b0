"""The README's two set-up commands stay true: CI runs the test command verbatim."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:6] if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_the_readme_option_table_is_the_one_generated_from_the_configuration():
    from compiler.config import options_table

    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- options-table:begin -->\n", "<!-- options-table:end -->"
    table = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert table.strip() == options_table(), "regenerate it: python -m compiler.config --readme README.md"
