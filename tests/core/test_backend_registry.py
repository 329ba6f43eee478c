"""`grpo_lab.loss.backends` is the one home of the loss-backend names: no other module of grpo_lab writes a list of
them (a tuple, list, set or dict literal naming two or more, or a "naive,trl" string), so a new backend is one line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from grpo_lab.loss import backends

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpo_lab"
REGISTRY = PACKAGE / "loss" / "backends.py"
NAMES = set(backends.LOSS_BACKENDS)


def backend_lists(source: str) -> list[int]:
    """Lines of `source` holding a literal collection of two or more loss-backend names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.fullmatch(r"\w+(\s*,\s*\w+)+", node.value):
            items = [ast.Constant(part.strip()) for part in node.value.split(",")]
        else:
            continue
        named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & NAMES
        if len(named) >= 2:
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("snippet", ['B = ("naive", "trl")', 'B = ["grpo_lab", "liger", "x"]', 'B = {"naive", "trl"}',
                                     'C = {"naive": "red", "trl": "blue"}', 'f(backends="naive,trl,grpo_lab")'])
def test_the_scan_sees_a_list_of_backend_names(snippet):
    assert backend_lists(snippet)


def test_one_name_or_other_lists_are_not_backend_lists():
    assert backend_lists('if b == "naive": x = ("naive", "fused"); y = ("fp32", "bf16")') == []


def test_no_backend_name_list_outside_the_registry():
    lists = {str(p.relative_to(ROOT)): lines for p in sorted(PACKAGE.rglob("*.py")) if p != REGISTRY
             if (lines := backend_lists(p.read_text()))}
    assert lists == {}, "import the names from grpo_lab.loss.backends"


def test_the_registry_is_consistent():
    assert backends.DEFAULT_LOSS_BACKEND in backends.LOSS_BACKENDS
    assert set(backends.LOGPROB_BACKENDS) < NAMES and set(backends.REFERENCE_BACKENDS) <= NAMES
    assert sorted(backends.DISPLAY_ORDER) == sorted(NAMES) and backends.DISPLAY_ORDER[0] == backends.BASELINE_BACKEND
    assert set(backends.BACKEND_COLORS) == set(backends.BACKEND_MARKERS) == NAMES
    assert backends.in_display_order(["liger", "x", "trl", "liger"]) == ["trl", "liger", "x"]
    for name in NAMES:
        assert name in backends.BACKEND_HELP and backends.resolve_backend(name) == name
