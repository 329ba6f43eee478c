"""A notebook's parameters cell read as a user would: its literal `NAME = value` assignments (the browser tier and
the headless notebook tests both read them)."""

from __future__ import annotations

import ast


def parameters_of(source: str) -> dict:
    """The literal assignments of a parameters cell."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out
