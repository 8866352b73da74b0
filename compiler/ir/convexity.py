"""Delegation-tag groups that a path leaves and re-enters: found, named, and split.

`to_backend` fuses each tag group into one delegate call, one group after another. A
group that a path leaves and comes back into (through a CPU op, or through another
group, which is one call once fused) cannot be one call: torch.fx refuses it with
"Invalid partition, found dependency cycles". Put otherwise, contracting every group to
one vertex must leave the graph acyclic; a cycle of that quotient graph names the
groups and the outside nodes on the path.

ExecuTorch's capability-based partitioners (XNNPACK's, the one our Core ML and MLX
searches use) never merge groups into a cycle, but rules applied after the search
untag nodes (a copy XNNPACK would elide, a returned buffer copy), and an untagged node
between two nodes of one group makes that group non-convex. Such a group is split by
levels: a node's level is the most times a path from the group to it left the group
and came back (found in one pass over the nodes between the group's first op and its
last, in program order, after one pass that finds every split group's span). Every level is convex, and a path that leaves a level only reaches
higher ones; there are as few pieces as the worst such path needs, and the first keeps
every node no path re-enters at.
"""

from __future__ import annotations

import itertools
import logging
from typing import Hashable, Mapping

import attrs
import networkx as nx
import torch

from compiler.ir.graph import DELEGATION_TAG

logger = logging.getLogger(__name__)


@attrs.frozen
class Reentry:
    """A path that leaves tag group `tag` at node `exit` and comes back at node `entry`,
    through `outside`: CPU node names, and other groups as `tag <name>`."""

    tag: str
    exit: str
    outside: tuple[str, ...]
    entry: str

    def __str__(self) -> str:
        path = " -> ".join((f"{self.exit} ({self.tag})", *self.outside, f"{self.entry} ({self.tag})"))
        return f"group {self.tag} is left and re-entered: {path}"


def _in_group(node: torch.fx.Node, tag: str) -> bool:
    """Whether `node` is an op of group `tag`. A weight a group took is no step on a path:
    it has no inputs, and split_constants gives each other group reading it a copy."""
    return node.op != "placeholder" and node.meta.get(DELEGATION_TAG) == tag


def _vertex(node: torch.fx.Node) -> Hashable:
    """A node's vertex of the quotient graph: the tag (a str) of an op in a group, else the node."""
    tag = node.meta.get(DELEGATION_TAG)
    return tag if tag and _in_group(node, tag) else node


def quotient(graph: torch.fx.Graph) -> nx.DiGraph:
    """The graph with every tag group contracted to one vertex; each edge keeps one fx edge
    (`via`: producer, user) that makes it."""
    contracted = nx.DiGraph()
    for node in graph.nodes:
        if node.op == "output":
            continue
        target = _vertex(node)
        contracted.add_node(target)
        for source in node.all_input_nodes:
            start = _vertex(source)
            if start != target and not contracted.has_edge(start, target):
                contracted.add_edge(start, target, via=(source, node))
    return contracted


def _name(vertex: Hashable) -> str:
    return f"tag {vertex}" if isinstance(vertex, str) else vertex.name


def reentries(graph: torch.fx.Graph) -> list[Reentry]:
    """One path per group that a path leaves and re-enters (none when the quotient is acyclic,
    which one pass over the graph shows)."""
    contracted = quotient(graph)
    if nx.is_directed_acyclic_graph(contracted):
        return []
    found = []
    for component in nx.strongly_connected_components(contracted):
        if len(component) < 2:
            continue
        inside = contracted.subgraph(component)
        for tag in sorted(v for v in component if isinstance(v, str)):
            first = next(iter(inside.successors(tag)))
            path = nx.shortest_path(inside, first, tag)  # first ... tag: back into the group
            exit_node = contracted.edges[tag, first]["via"][0]
            entry_node = contracted.edges[path[-2], tag]["via"][1]
            found.append(Reentry(tag, exit_node.name, tuple(_name(v) for v in path[:-1]), entry_node.name))
    return found


@attrs.define
class _Group:
    """Where a group's ops lie in program order, and the weights it took."""

    first: int = -1
    last: int = -1
    weights: list[torch.fx.Node] = attrs.field(factory=list)


def _groups(order: list[torch.fx.Node], tags: set[str]) -> dict[str, _Group]:
    """The span and weights of each group in `tags`, in one pass over the program."""
    groups = {tag: _Group() for tag in tags}
    for index, node in enumerate(order):
        group = groups.get(node.meta.get(DELEGATION_TAG))
        if group is None:
            continue
        if node.op == "placeholder":
            group.weights.append(node)
            continue
        if group.first < 0:
            group.first = index
        group.last = index
    return groups


def _levels(order: list[torch.fx.Node], tag: str, group: _Group) -> dict[torch.fx.Node, int]:
    """Each node of group `tag` -> the most times a path from the group to it left the
    group and came back; one pass over the nodes from the group's first op to its last."""
    level: dict[torch.fx.Node, int] = {}
    left: dict[torch.fx.Node, int] = {}  # outside node -> 1 + the highest level that reaches it
    for node in order[group.first : group.last + 1]:
        sources = node.all_input_nodes
        if _in_group(node, tag):
            level[node] = max((level.get(s, left.get(s, 0)) for s in sources), default=0)
            continue
        reached = [level[s] + 1 if s in level else left[s] for s in sources if s in level or s in left]
        if reached:
            left[node] = max(reached)
    for weight in group.weights:  # with its first reader in the group
        level[weight] = min((level[u] for u in weight.users if u in level), default=0)
    return level


def split_reentered_groups(
    graph: torch.fx.Graph, partitions: Mapping[str, object]
) -> tuple[dict[str, object], list[Reentry]]:
    """Split, in place, every tag group a path leaves and re-enters into groups by level
    (piece 0 keeps the tag, piece k is `<tag>_<k>`, each with the group's spec). Returns
    the partitions with the new tags, and the paths that made each split. (Groups only
    fused ones feed each other, which no capability-based search makes, are left as they
    are, for the invariant to name.)"""
    found = reentries(graph)
    if not found:
        return dict(partitions), []
    order = list(graph.nodes)
    split = dict(partitions)
    groups = _groups(order, {r.tag for r in found})
    was_split = set()
    for tag in sorted(groups):
        pieces: dict[int, str] = {0: tag}
        for node, level in _levels(order, tag, groups[tag]).items():
            if level not in pieces:
                pieces[level] = next(
                    name for k in itertools.count() if (name := f"{tag}_{level}" + "_" * k) not in split
                )
                split[pieces[level]] = partitions[tag]
            node.meta[DELEGATION_TAG] = pieces[level]
        if len(pieces) > 1:
            was_split.add(tag)
            logger.debug("tag group %s split into %d groups", tag, len(pieces))
    return split, [r for r in found if r.tag in was_split]

