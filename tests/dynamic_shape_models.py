"""Small models with a dynamic sequence dimension, importable as `dynamic_shape_models` from
any test module (as `tiny_models`), and how to check a program of
one at lengths other than the example's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import compiler

SEQ = torch.export.Dim("seq", min=2, max=32)


class CausalAttention(torch.nn.Module):
    """A one-block causal LM: token ids -> q/k/v projections viewed into heads -> causal
    SDPA -> heads viewed back -> logits. Every view's target sizes hold the sequence length."""

    def __init__(self, vocab: int = 40, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.out(y + x)


class PositionGather(torch.nn.Module):
    """Gathers by positions made from the sequence length (as transformers' mask builders
    index a cumulative sum): an index whose output size is the dynamic dimension."""

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        return torch.cumsum(x, dim=1)[torch.zeros_like(pos), pos] * 2


def causal_attention(seq: int = 8) -> tuple[torch.nn.Module, tuple, tuple]:
    torch.manual_seed(0)
    return CausalAttention().eval(), (torch.randint(0, 40, (1, seq)),), ({1: SEQ},)


def position_gather(seq: int = 8) -> tuple[torch.nn.Module, tuple, tuple]:
    torch.manual_seed(0)
    return PositionGather().eval(), (torch.randn(1, seq, 4),), ({1: SEQ},)


def inputs_at(inputs: tuple, length: int) -> tuple:
    """The example inputs with their dimension 1 at `length` (token ids stay in range)."""
    torch.manual_seed(length)
    return tuple(
        torch.randint(0, int(x.max()) + 1, (x.shape[0], length)) if not x.is_floating_point()
        else torch.randn(x.shape[0], length, *x.shape[2:])
        for x in inputs
    )


def largest_errors(result, model: torch.nn.Module, inputs: tuple, lengths=(5, 13)) -> dict[int, float]:
    """Length -> the largest absolute difference from eager of the program run at that length."""
    errors = {}
    for length in lengths:
        given = inputs_at(inputs, length)
        with torch.no_grad():
            expected = model(*given)
        (actual,) = compiler.run(result, given)
        assert actual.shape == expected.shape, (length, actual.shape, expected.shape)
        errors[length] = (actual - expected).abs().max().item()
    return errors


def symbolic_input_dims(program) -> list[str]:
    """The symbolic sizes of the program's user inputs, as text (`s70`), resolved through the
    shape environment (a size a stage fixed reads as its number)."""
    names = set(program.graph_signature.user_inputs)
    return [
        str(d.node.expr)
        for n in program.graph.nodes
        if n.op == "placeholder" and n.name in names and isinstance(n.meta.get("val"), torch.Tensor)
        for d in n.meta["val"].shape
        if isinstance(d, torch.SymInt) and not d.node.expr.is_number
    ]
