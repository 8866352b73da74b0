"""The garbage collector during a compile: it scans only what the compile made, the lower
stage frees the copies of the weights `to_backend` leaves in reference cycles, and the
process's own freeze is left as it was."""

import gc

import torch

import compiler
from compiler.driver.instruments import Instrument


class Stack(torch.nn.Module):
    """Linears XNNPACK takes, each its own delegate: the cumsums between them stay on the CPU."""

    def __init__(self, depth: int = 4, width: int = 256):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.cumsum(layer(x), dim=-1)
        return x


class AfterLower(Instrument):
    """What a full collection right after the lower stage would free, and the collector's view."""

    def __init__(self):
        self.freeze_counts = []
        self.cyclic_tensor_bytes = None

    def before_stage(self, stage, artifact):
        self.freeze_counts.append(gc.get_freeze_count())

    def after_stage(self, stage, before, after):
        if stage != "lower":
            return
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            storages = {}
            for obj in gc.garbage:
                if isinstance(obj, torch.Tensor) and not obj.is_meta and type(obj) in (torch.Tensor, torch.nn.Parameter):
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            self.cyclic_tensor_bytes = sum(storages.values())
        finally:
            gc.set_debug(0)
            gc.garbage.clear()


def _compile(instrument):
    torch.manual_seed(0)
    return compiler.compile(Stack().eval(), (torch.randn(2, 256),), "xnnpack", instruments=[instrument])


def test_lower_leaves_no_weights_in_reference_cycles():
    seen = AfterLower()
    gc.disable()  # whether the collector's own schedule got to them first is luck
    try:
        artifact = _compile(seen)
    finally:
        gc.enable()
    weights = 4 * 256 * 257 * 4
    # to_backend deep-copies each partition's program for XNNPACK's preprocess, whose passes
    # keep the copy in cycles: without the stage's collection, a copy of every weight.
    assert seen.cyclic_tensor_bytes is not None and seen.cyclic_tensor_bytes < weights / 10
    assert artifact.report.stage("lower").metrics["collect_s"] >= 0.0


def test_the_collector_sees_only_the_compile_and_is_restored_after():
    assert gc.get_freeze_count() == 0
    seen = AfterLower()
    _compile(seen)
    # Everything that existed before the compile was out of the collector's view ...
    assert all(count > 10_000 for count in seen.freeze_counts)
    # ... and is back in it after.
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_objects_keeps_its_freeze():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen = AfterLower()
        _compile(seen)
        # Not unfrozen by the compile (some frozen objects die on their own meanwhile).
        assert all(count > frozen // 2 for count in seen.freeze_counts)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
