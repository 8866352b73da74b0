"""Where a failed compile's reproducer goes: only where the caller asked, bounded in the cache folder."""

import os
import shutil
import tempfile

import pytest

import compiler
from compiler.driver import instruments
from compiler.driver.config import options
from compiler.driver.instruments import KEPT_REPRODUCERS, default_reproducer_dir
from compiler.ir.errors import StageFailure
from compiler.driver.stage_files import load_stage_file


class FailsAtFold(compiler.Instrument):
    """Fails the run as the fold stage starts: a failure after capture, so there is a stage input to save."""

    def before_stage(self, stage, artifact):
        if stage == "fold":
            raise RuntimeError("fold exploded")


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The temp, cache and home folders, each empty and private to the test."""
    folders = {name: tmp_path / name for name in ("tmp", "cache", "home")}
    for folder in folders.values():
        folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folders["tmp"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(folders["cache"]))
    monkeypatch.setenv("HOME", str(folders["home"]))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches the temp folder it found first
    return folders


def failing_compile(small_model, **options) -> StageFailure:
    model, inputs = small_model
    with pytest.raises(StageFailure) as err:
        compiler.compile(model, inputs, instruments=[FailsAtFold()], **options)
    assert "fold exploded" in str(err.value)
    return err.value


def test_library_use_writes_no_reproducer_anywhere(small_model, places):
    assert tempfile.gettempdir() == str(places["tmp"])
    error = failing_compile(small_model)
    assert error.reproducer_path is None
    assert "resume with" not in str(error)
    assert {name: os.listdir(folder) for name, folder in places.items()} == {"tmp": [], "cache": [], "home": []}


def test_the_cache_folder_keeps_the_newest_reproducers_each_in_its_own_folder(small_model, places):
    cache = default_reproducer_dir()
    assert cache == str(places["cache"] / "staged-compiler" / "reproducers")
    os.makedirs(os.path.join(cache, "notes"))  # not a reproducer folder: never removed
    errors = [failing_compile(small_model, reproducer_dir=cache) for _ in range(KEPT_REPRODUCERS + 5)]

    folders = sorted(os.listdir(cache))
    assert folders.pop() == "notes"
    assert len(folders) == KEPT_REPRODUCERS
    assert all("-fold-" in name for name in folders)
    kept = [os.path.dirname(e.reproducer_path) for e in errors[-KEPT_REPRODUCERS:]]
    assert sorted(os.path.basename(folder) for folder in kept) == folders  # the newest, in name order
    for folder in folders:
        assert os.listdir(os.path.join(cache, folder)) == ["precision.stage"]
        assert load_stage_file(os.path.join(cache, folder, "precision.stage")).stage == "precision"

    newest = errors[-1].reproducer_path
    assert f"the stage input was saved to {newest}" in str(errors[-1])
    assert f"resume with: compiler.compile(None, resume_from={newest!r})" in str(errors[-1])
    assert os.listdir(places["tmp"]) == []


def test_a_folder_removed_by_another_process_meanwhile_is_no_error(small_model, places, monkeypatch):
    cache = default_reproducer_dir()
    for _ in range(KEPT_REPRODUCERS):
        failing_compile(small_model, reproducer_dir=cache)
    oldest = os.path.join(cache, sorted(os.listdir(cache))[0])

    rmtree = shutil.rmtree

    def removed_first_by_another_process(path, *args, **kwargs):
        rmtree(path)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(instruments.shutil, "rmtree", removed_first_by_another_process)
    error = failing_compile(small_model, reproducer_dir=cache)
    assert not os.path.exists(oldest)
    assert os.path.isfile(error.reproducer_path)
    assert len(os.listdir(cache)) == KEPT_REPRODUCERS


def test_with_a_dump_folder_the_reproducer_is_saved_in_it(small_model, places):
    dump = places["home"] / "dump"
    error = failing_compile(small_model, dump_dir=str(dump))
    assert error.reproducer_path == str(dump / "precision.stage")
    assert f"the stage input was saved to {error.reproducer_path}" in str(error)
    assert load_stage_file(error.reproducer_path).stage == "precision"
    assert os.listdir(places["tmp"]) == [] and os.listdir(places["cache"]) == []


def test_a_folder_the_caller_named_is_never_pruned(small_model, places):
    chosen = places["home"] / "reproducers"
    for _ in range(2):
        error = failing_compile(small_model, reproducer_dir=str(chosen))
    assert error.reproducer_path == str(chosen / "precision.stage")
    assert os.listdir(chosen) == ["precision.stage"]


def test_the_option_help_states_how_many_are_kept():
    help_text = {spec.name: spec.help for spec in options()}["reproducer_dir"]
    assert f"newest {KEPT_REPRODUCERS}" in help_text
