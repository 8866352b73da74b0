"""Refusal rules as the MLX and XNNPACK backends keep them: a tuple of small functions,
each saying why its backend must not take a node (or None), asked in order."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

NodeRule = Callable[[torch.fx.Node], Optional[str]]


def first_refusal(node: torch.fx.Node, rules: Iterable[NodeRule]) -> Optional[str]:
    """The reason of the first of `rules` that refuses `node`, or None; only calls are judged."""
    if node.op != "call_function":
        return None
    for rule in rules:
        reason = rule(node)
        if reason:
            return reason
    return None
