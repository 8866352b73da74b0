"""Inserting Edge calls in front of a node, each with the value a retrace would give it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._guards import detect_fake_mode

# Metadata a new node takes from the node it replaces: where it came from in the model.
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node")


class Builder:
    """Inserts Edge calls before `node`, each with the fake value the op gives, as a retrace would."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node
        self.graph = node.graph
        self.mode = detect_fake_mode([n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"])
        self.made: list[torch.fx.Node] = []

    def __call__(self, op, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.node):
            new = self.graph.call_function(op, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode or contextlib.nullcontext():
            new.meta["val"] = op(*fake_args, **fake_kwargs)
        new.meta.update({key: self.node.meta[key] for key in _KEPT_META if key in self.node.meta})
        self.made.append(new)
        return new
