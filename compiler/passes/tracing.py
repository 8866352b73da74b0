"""The shape environment's pending symbols, kept across a trace that more than one stage makes."""

from __future__ import annotations

import contextlib

import torch
from torch.export import ExportedProgram

@contextlib.contextmanager
def unbacked_symbols_kept_in(program: ExportedProgram):
    """Tracing a data-dependent size leaves a fresh unbacked symbol pending in the shape
    environment the program shares with every trace of it; left there, the next trace
    (the decompose stage after a dry run that dropped a node) fails with "Pending unbacked
    symbols {u4, ...} not in returned outputs"."""
    mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in program.graph.nodes])
    shape_env = getattr(mode, "shape_env", None)
    before = list(shape_env.pending_fresh_unbacked_symbols) if shape_env is not None else None
    try:
        yield
    finally:
        if shape_env is not None:
            shape_env.pending_fresh_unbacked_symbols[:] = before
