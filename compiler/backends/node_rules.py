"""Refusal rules, one shape on every backend: a small check saying why its backend must not
take a node (or None), registered with a one-line summary in the backend's `RuleBook` and
asked in the order registered, so the first rule that refuses a node gives its reason.

A check is `(node, ctx) -> str | None`, `ctx` being what its backend passes: Core ML its
`RuleContext` (the user's options), MLX and XNNPACK None. The books' summaries make
docs/refusal-rules.md, which a test keeps equal to them:

    python -m compiler.backends.node_rules      # rewrite docs/refusal-rules.md (run from the project's root)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

import attrs
import torch

Check = Callable[[torch.fx.Node, Any], Optional[str]]

DOCUMENT = "docs/refusal-rules.md"


@attrs.frozen
class Rule:
    """One refusal rule: its check, under the function's name, and the summary the docs list."""

    name: str
    summary: str
    check: Check
    issue: Optional[str] = None  # the upstream issue it works around, added to its reasons


@attrs.define
class RuleBook:
    """A backend's refusal rules in the order they are asked: the order decides which reason a
    node refused by several rules is given, so it is part of each rule's behaviour."""

    backend: str  # as the docs name it
    module: str  # where the rules live, for the docs' reader
    rules: list[Rule] = attrs.field(factory=list)

    def refuses(self, summary: str, issue: Optional[str] = None) -> Callable[[Check], Check]:
        """Decorator: register the check as the book's next rule (the check itself is returned,
        so it stays a plain function of its module)."""

        def register(check: Check) -> Check:
            self.rules.append(Rule(check.__name__, summary, check, issue))
            return check

        return register

    def without(self, name: str) -> RuleBook:
        """This book without the rule `name`: what the backend does where that rule is missing."""
        if name not in {rule.name for rule in self.rules}:
            raise KeyError(f"{self.backend} has no refusal rule {name!r}")
        return attrs.evolve(self, rules=[rule for rule in self.rules if rule.name != name])

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def table(self) -> str:
        """The book's section of docs/refusal-rules.md: its rules in the order they are asked."""
        path = self.module.replace(".", "/") + ".py"
        lines = [
            f"## {self.backend}",
            "",
            f"Registered in [{path}](../{path}), asked in this order:",
            "",
            "| # | rule | refuses |",
            "|---|---|---|",
        ]
        for number, rule in enumerate(self.rules, 1):
            issue = f" ({rule.issue})" if rule.issue else ""
            lines.append(f"| {number} | `{rule.name}` | {rule.summary}{issue} |")
        return "\n".join(lines)


def first_refusal(node: torch.fx.Node, rules: Iterable[Rule], ctx: Any = None) -> Optional[str]:
    """The reason of the first of `rules` that refuses `node` (with the issue it works around),
    or None; only calls are judged."""
    if node.op != "call_function":
        return None
    for rule in rules:
        reason = rule.check(node, ctx)
        if reason:
            return f"{reason} ({rule.issue})" if rule.issue else reason
    return None


def rule_books() -> tuple[RuleBook, ...]:
    """Every backend's refusal rules (its `Backend.refusal_rules`), in the targets table's order."""
    from compiler import backends

    found = (backends.load(name).refusal_rules for name in backends.available())
    return tuple(book for book in found if book is not None)


def page(books: Iterable[RuleBook]) -> str:
    """docs/refusal-rules.md: a section per backend listing its refusal rules."""
    opening = [
        "# Refusal rules",
        "",
        "[README](../README.md) · [backends](backends.md)",
        "",
        "<!-- Generated from the rules by `python -m compiler.backends.node_rules`; do not edit. -->",
        "",
        "Each backend asks its refusal rules of every call node before the node may be delegated",
        "(Core ML: of every call but a tuple access, which goes where the op it reads goes). The",
        "first rule that refuses a node keeps it off the backend: the node runs on the CPU, and the",
        "placement report gives that rule's reason, which names the node's own values (and the",
        "upstream issue the rule works around, where it has one). Each rule is a small function",
        "registered in the module named below with `@RULES.refuses(summary)` (Core ML's:",
        "`@NODE_RULES.refuses(summary, issue=...)`); its summary is the line listed here. Core ML's",
        "partition rules, which judge a node inside a proposed partition (what it reads from",
        "outside, who uses its result) after each partition search, are in the same module and not",
        "listed.",
    ]
    return "\n\n".join(["\n".join(opening), *(book.table() for book in books)]) + "\n"


if __name__ == "__main__":
    with open(DOCUMENT, "w") as f:
        f.write(page(rule_books()))
