"""A KV cache in buffers updated as transformers' StaticCache does it (index_copy_ at the call's
positions, or its fallback `cache[:, :, positions] = new`), for any number of tokens: both become
`index_put` with one position index, which MLX runs as IndexCopyNode inside the delegate that owns
the cache, calls of different lengths in sequence equal to eager."""

import pytest
import torch
import torch.nn.functional as F

import compiler
from compiler.backends.mlx.interpreter import MLXGraph
from compiler.running.reference import ReferenceExecutor

CACHE, VOCAB = 16, 32


class CachedAttention(torch.nn.Module):
    """One attention block whose keys and values go into a buffer cache at `positions`, then
    attention over the whole cache, masked to the positions written so far."""

    def __init__(self, fallback: bool, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.fallback, self.heads = fallback, heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, VOCAB)
        self.register_buffer("keys", torch.zeros(1, heads, CACHE, dim // heads))
        self.register_buffer("values", torch.zeros(1, heads, CACHE, dim // heads))

    def forward(self, ids, positions):
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if self.fallback:
            self.keys[:, :, positions] = k
            self.values[:, :, positions] = v
        else:
            self.keys.index_copy_(2, positions, k)
            self.values.index_copy_(2, positions, v)
        mask = torch.arange(CACHE)[None, :] <= positions[:, None]
        y = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d) + x)


def _tokens(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (1, count)), torch.arange(start, start + count)


@pytest.mark.parametrize("fallback", [False, True], ids=["index_copy_", "index_put_"])
def test_cache_update_of_any_length_runs_inside_one_delegate_and_matches_eager(fallback):
    torch.manual_seed(0)
    model = CachedAttention(fallback).eval()
    seq = torch.export.Dim("seq", min=1, max=CACHE)
    result = compiler.compile(model, _tokens(0, 2), "mlx", dynamic_shapes=({1: seq}, {0: seq}))

    (updates,) = [row for row in result.report.placement if row.op == "aten.index_put.default"]
    assert updates.count == 2 and updates.where == "MLXBackend", updates
    assert result.program.delegates == ("MLXBackend",)
    (payload,) = ReferenceExecutor(result.pte).program.backend_delegate_data
    graph = MLXGraph(bytes(payload.data))
    copies = [node.fields for chain in graph.chains for node in chain if node.kind == "IndexCopyNode"]
    owned = {idx for idx, _ in graph.mutable_buffers}
    # Each cache written where the delegate keeps it, not copied into a new tensor.
    assert len(copies) == 2 and all(f["dst"] == f["out"] and f["dst"].idx in owned for f in copies), copies

    calls, start = [], 0
    for count in (5, 1, 3, 1, 6):  # a prompt, then decode steps and chunks of other lengths
        calls.append(("forward", _tokens(start, count)))
        start += count
    check = compiler.check_methods(result, calls, {"forward": model})
    (row,) = check.methods
    assert row.calls == 5 and row.worst_error < 1e-5 and check.passed, check.describe()
    assert model.keys.abs().sum() == 0  # the check ran eager from the model as built and put it back


class PutThenReadAgain(torch.nn.Module):
    def forward(self, x, rows, positions):
        return torch.ops.aten.index_put.default(x, [None, positions], rows) * 2 + x


def test_a_put_whose_destination_is_read_again_writes_a_new_tensor():
    """Into the destination's slot only where nothing reads it after the put: here x is read again."""
    inputs = (torch.randn(3, 8), torch.randn(3, 2), torch.tensor([6, 1]))
    result = compiler.compile(PutThenReadAgain().eval(), inputs, "mlx")
    (row,) = [row for row in result.report.placement if row.op == "aten.index_put.default"]
    assert row.where == "MLXBackend", row
    (got,) = compiler.run(result, inputs)
    torch.testing.assert_close(got, PutThenReadAgain()(*inputs))


class BroadcastPut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.ones(2, 8))

    def forward(self, x, positions):
        self.cache[:, positions] = 0.0
        return self.cache * x


def test_a_put_of_broadcast_values_stays_on_the_cpu_and_says_why():
    inputs = (torch.randn(2, 8), torch.tensor([1, 5]))
    result = compiler.compile(BroadcastPut().eval(), inputs, "mlx")
    (row,) = [row for row in result.report.placement if row.op == "aten.index_put.default"]
    assert row.where == "cpu", row
    assert "values of shape [] where IndexCopyNode takes [2, 2]" in row.reason, row.reason
    (got,) = compiler.run(result, inputs)
    expected = torch.ones(2, 8)
    expected[:, [1, 5]] = 0.0
    torch.testing.assert_close(got, expected * inputs[0])
