"""Every notebook in JupyterLab (started by the user's `grpo-lab lab`) in headless Chromium: open it in a fresh
workspace, set `QUICK = True` in its parameters cell, Run All, wait until no cell shows `[*]`, then check what a user
sees. One run per notebook (a module-scoped fixture) that the tests read; screenshots of the page and of each cell
with a widget or a figure go to the artifacts folder (conftest.py).
"""

from __future__ import annotations

import re

import nbformat
import pytest

from grpo_lab.lab.runner import find_notebooks

from . import checks
from .conftest import ROOT, serving
from .frontends import Lab
from .notebook_table import expect, with_overrides
from .servers import start_lab

pytestmark = pytest.mark.browser

NOTEBOOKS = [p.stem for p in find_notebooks(ROOT / "notebooks")]
RUN_ALL_TIMEOUT_S = 900
QUICK_LINE = re.compile(r"^QUICK\s*=\s*(False|True)\b", re.MULTILINE)


def quick_source(name: str) -> str:
    """The parameters cell with `QUICK = True` and the table's overrides (what a user types)."""
    cell = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0]
    assert "parameters" in cell.metadata.get("tags", []), f"{name}: the first cell must be the parameters cell"
    assert QUICK_LINE.search(cell.source), f"{name}: the parameters cell must have a `QUICK = ...` line"
    return with_overrides(QUICK_LINE.sub("QUICK = True", cell.source, count=1), expect(name).overrides)


@pytest.fixture(scope="session")
def lab(chromium, tmp_path_factory):
    with serving(start_lab, tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="module", params=NOTEBOOKS)
def ran(request, lab, browser, artifacts):
    """The notebook opened in JupyterLab, switched to quick mode in its parameters cell and run with Run All."""
    with checks.notebook_run(Lab(), lab, browser, artifacts, request.param, quick_source(request.param)) as nb:
        yield nb


def test_quick_mode_was_set_in_the_parameters_cell(ran):
    assert "QUICK = True" in ran.page.locator(ran.frontend.cell_sel).first.inner_text()


def test_runs_without_error_output(ran):
    checks.all_cells_ran_without_error_output(ran)


def test_widgets_render_as_controls(ran):
    checks.widgets_render_as_controls(ran)


def test_labels_are_whole(ran):
    checks.labels_are_whole(ran)


def test_expected_figures(ran):
    checks.figures_shown(ran, expect(ran.name).figures_quick)


def test_one_interaction_changes_the_output(ran, artifacts):
    assert checks.interaction_changes_output(ran, artifacts)
