"""Refusal rules, one shape on every backend: a rule book asks its rules in the order they were
registered, and docs/refusal-rules.md is what the books generate."""

import pathlib

import pytest
import torch

from compiler.backends import node_rules
from compiler.backends.node_rules import RuleBook, first_refusal

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _node(fn, *inputs) -> torch.fx.Node:
    """The one call node of `fn`'s exported program."""

    class Model(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    program = torch.export.export(Model(), inputs)
    (node,) = [n for n in program.graph.nodes if n.op == "call_function"]
    return node


def _book() -> RuleBook:
    book = RuleBook("Test", "tests.backends.test_node_rules")

    @book.refuses("anything: the first rule")
    def first(node, ctx):
        return f"first refuses {node.name} ({ctx})"

    @book.refuses("anything: the second rule", issue="https://example.com/1")
    def second(node, ctx):
        return f"second refuses {node.name}"

    return book


def test_the_first_rule_registered_that_refuses_gives_the_reason():
    node, book = _node(torch.neg, torch.ones(2)), _book()
    assert [rule.name for rule in book] == ["first", "second"]
    assert first_refusal(node, book, "options") == "first refuses neg (options)"
    assert first_refusal(node, book.without("first")) == "second refuses neg (https://example.com/1)"
    assert [rule.name for rule in book] == ["first", "second"]  # `without` leaves the book as it was
    with pytest.raises(KeyError, match="no refusal rule 'third'"):
        book.without("third")


def test_only_calls_are_judged():
    node = _node(torch.neg, torch.ones(2))
    placeholder = next(n for n in node.graph.nodes if n.op == "placeholder")
    assert first_refusal(placeholder, _book()) is None


def test_a_registered_rule_is_listed_with_its_summary_in_its_backends_section():
    table = _book().table()
    assert table.splitlines()[0] == "## Test"
    assert "| 1 | `first` | anything: the first rule |" in table
    assert "| 2 | `second` | anything: the second rule (https://example.com/1) |" in table
    assert node_rules.page([_book()]).count("## Test") == 1


def test_the_docs_page_is_what_the_rules_generate():
    text = (ROOT / node_rules.DOCUMENT).read_text()
    assert text == node_rules.page(node_rules.rule_books()), (
        f"regenerate it: python -m compiler.backends.node_rules (writes {node_rules.DOCUMENT})"
    )


def test_every_backend_has_a_book_of_uniquely_named_one_line_rules():
    books = node_rules.rule_books()
    assert [book.backend for book in books] == ["XNNPACK", "Core ML", "MLX"]
    for book in books:
        names = [rule.name for rule in book]
        assert len(names) == len(set(names)), book.backend
        for rule in book:
            assert rule.summary and "\n" not in rule.summary and "|" not in rule.summary, rule.name


def test_xnnpack_refuses_a_scaled_addmm_with_its_reason():
    from compiler.backends.xnnpack.rules import RULES

    node = _node(lambda b, x, w: torch.addmm(b, x, w, beta=0.5), torch.ones(3), torch.ones(2, 4), torch.ones(4, 3))
    assert first_refusal(node, RULES) == (
        "XNNPACK 1.5.1 would compute this addmm (beta=0.5) wrongly: its addmm visitor ignores beta and "
        "alpha (it computes bias + input @ weight)"
    )
    assert first_refusal(node, RULES.without("addmm_scaled")) is None


def test_mlx_refuses_integer_floor_division_with_its_reason():
    from compiler.backends.mlx.support import RULES

    node = _node(lambda i: i // 2, torch.arange(6))
    assert first_refusal(node, RULES) == (
        "MLX would get this int64 floor division wrong: it divides integers through mlx::divide, "
        "which returns float (7 // 2 gives 3.5)"
    )


def test_core_ml_refuses_add_with_alpha_naming_the_upstream_issue():
    from compiler.backends.coreml.rules import NODE_RULES, RuleContext, refusal

    node = _node(lambda x, y: torch.add(x, y, alpha=2), torch.ones(2), torch.ones(2))
    assert refusal(node, RuleContext()) == (
        "coremltools converts aten.add.Tensor with alpha != 1 wrongly; multiply the second operand by "
        "alpha in the model instead to delegate it (https://github.com/apple/coremltools/issues/2573)"
    )
    assert first_refusal(node, NODE_RULES.without("add_sub_with_alpha"), RuleContext()) is None


def test_core_ml_refuses_an_antialiased_resize_it_would_compute_without_antialias():
    from compiler.backends.coreml.rules import RuleContext, refusal

    node = _node(lambda x: torch.nn.functional.interpolate(x, size=(4, 4), mode="bilinear", antialias=True),
                 torch.ones(1, 1, 8, 8))
    assert "converts aten._upsample_bilinear2d_aa" in refusal(node, RuleContext())
