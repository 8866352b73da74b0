"""The lower stage lists each partition's nodes with one read of the program's signature:
ExecuTorch's `to_backend` asks `is_param` (then `is_buffer`, `is_lifted_tensor_constant`)
of every tagged placeholder, and each builds a new dict of every input from the signature,
so listing cost the square of the program's weights. The payload is the same either way."""

from __future__ import annotations

import pytest
import torch
from torch.export.graph_signature import ExportGraphSignature

from executorch.exir.backend import backend_api

import compiler
from compiler.models import examples


class CountParameterReads:
    """Counts reads of a signature's parameters while `to_backend` lists a partition's nodes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listing = False
        self.reads = self.lists = 0
        read = ExportGraphSignature.inputs_to_parameters.fget
        list_nodes = backend_api._get_node_list_with_same_tag

        def counted(signature):
            self.reads += self.listing
            return read(signature)

        def listed(*args, **kwargs):
            self.listing, self.lists = True, self.lists + 1
            try:
                return list_nodes(*args, **kwargs)
            finally:
                self.listing = False

        monkeypatch.setattr(ExportGraphSignature, "inputs_to_parameters", property(counted))
        monkeypatch.setattr(backend_api, "_get_node_list_with_same_tag", listed)


@pytest.mark.parametrize("backend", ["mlx", "xnnpack"])
def test_lowering_reads_the_parameters_once_per_partition_whatever_their_number(backend, monkeypatch):
    reads = {}
    torch.manual_seed(0)
    for depth in (1, 3):
        counts = CountParameterReads(monkeypatch)
        model, inputs = examples.transformer(depth=depth, dim=32, heads=4, seq=8)
        result = compiler.compile(model, inputs, backend)
        assert counts.lists == len(result.stages["partition"].plan.partitions) > 0
        reads[depth] = counts.reads / counts.lists
        (got,) = result.run(*inputs)
        assert (got - model(*inputs)).abs().max() < 1e-4
    # Three times the weights, the same reads per partition's list.
    assert reads[3] == reads[1], reads
