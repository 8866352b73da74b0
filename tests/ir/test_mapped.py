"""Weights in mapped files: equal to what was written, read-only, their pages dropped on demand."""

import signal
import subprocess
import sys

import pytest
import torch

from compiler.ir import mapped


def _file_resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


def test_spilled_tensors_equal_what_was_written_and_are_mapped():
    tensors = [torch.randn(300, 700), torch.arange(1000, dtype=torch.int8).reshape(10, 100), torch.randn(5).bfloat16()]
    moved = mapped.spilled(tensors)
    for before, after in zip(tensors, moved):
        assert after.dtype == before.dtype and torch.equal(after, before)
        assert mapped.is_mapped(after) and not mapped.is_mapped(before)


def test_a_write_into_a_mapped_weight_faults_at_once():
    """A write would be lost when its page is dropped: the read-only mapping stops the process instead."""
    code = "import torch; from compiler.ir import mapped; w = mapped.spilled([torch.zeros(1 << 20)])[0]; w.add_(1)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGSEGV


def test_rows_written_block_by_block_make_the_whole():
    whole = torch.randn(1000, 64)
    out = mapped.RowsFile({"value": (torch.float32, (1000, 64)), "other": (torch.int8, (1000, 3))})
    for start in range(0, 1000, 300):
        out.write("value", start, whole[start : start + 300])
        out.write("other", start, torch.full((min(300, 1000 - start), 3), start // 300, dtype=torch.int8))
    with pytest.raises(ValueError, match="do not fit"):
        out.write("value", 900, whole[:200])
    made = out.mapped()
    assert torch.equal(made["value"], whole) and mapped.is_mapped(made["value"])
    assert made["other"][999, 0] == 3 and made["other"][0, 0] == 0


def test_a_cast_into_a_file_is_the_cast():
    weight = mapped.spilled([torch.randn(4096, 512).bfloat16()])[0]
    cast = mapped.cast_into_file(weight, torch.float32, block_bytes=1 << 16)
    assert mapped.is_mapped(cast) and torch.equal(cast, weight.float())


def test_released_pages_leave_the_resident_set_and_read_the_same_again():
    (weight,) = mapped.spilled([torch.randn(64 << 18)])  # 64 MiB
    total = float(weight.sum())
    mapped.release_mapped_pages()
    before = _file_resident()
    assert float(weight.sum()) == total
    read = _file_resident()
    mapped.release_mapped_pages()
    assert read - before > 48 << 20  # reading it mapped its pages in
    assert read - _file_resident() > 48 << 20  # and releasing dropped them
