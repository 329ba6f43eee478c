"""Every notebook in JupyterLab (started by the user's `grpo-lab lab`) in headless Chromium: open it in a fresh
workspace, set `QUICK = True` in its parameters cell, Run All, wait until no cell shows `[*]`, then check what a user
sees. One run per notebook (a module-scoped fixture) that the tests read; screenshots of the page and of each cell
with a widget or a figure go to the artifacts folder (conftest.py).
"""

from __future__ import annotations

import os
import re
import uuid

import nbformat
import pytest

from grpo_lab.notebook_runner import find_notebooks

from . import checks
from .conftest import ROOT, notebook_tree, shutdown_kernels
from .frontends import Lab
from .notebook_table import expect, parameters_of
from .servers import start_lab

pytestmark = pytest.mark.browser

NOTEBOOKS = [p.stem for p in find_notebooks(ROOT / "notebooks")]
RUN_ALL_TIMEOUT_S = 900
QUICK_LINE = re.compile(r"^QUICK\s*=\s*False\b", re.M)


def quick_source(name: str) -> tuple[str, dict]:
    """The parameters cell with `QUICK = True`, and its values (what a user would edit)."""
    cell = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0]
    assert "parameters" in cell.metadata.get("tags", []), f"{name}: the first cell must be the parameters cell"
    assert QUICK_LINE.search(cell.source), f"{name}: the parameters cell must have a `QUICK = False` line"
    source = QUICK_LINE.sub("QUICK = True", cell.source, count=1)
    return source, parameters_of(source)


@pytest.fixture(scope="session")
def lab(chromium, tmp_path_factory):
    base = tmp_path_factory.mktemp("lab")
    root = notebook_tree(base / "root")
    server = start_lab(root, base, dict(os.environ, GRPO_LAB_OUTPUT_DIR=str(base / "outputs")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=NOTEBOOKS)
def ran(request, lab, browser, artifacts):
    """The notebook opened in JupyterLab, switched to quick mode in its parameters cell and run with Run All."""
    name = request.param
    source, params = quick_source(name)
    page = browser.new_page()
    frontend = Lab()
    try:
        nb = frontend.open(page, lab, f"notebooks/{name}.ipynb", workspace=f"t-{uuid.uuid4().hex[:8]}")
        frontend.set_source(page, 0, source)
        nb.params = params
        frontend.run_all(page)
        nb.run_seconds = frontend.wait_done(page, RUN_ALL_TIMEOUT_S)
        page.wait_for_timeout(1500)            # the boards' last redraw
        checks.screenshot_cells(nb, artifacts)
        yield nb
    finally:
        page.close()
        shutdown_kernels(lab)


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
