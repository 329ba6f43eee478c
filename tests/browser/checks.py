"""The checks every notebook passes in every frontend, on a `NotebookView` after Run All."""

from __future__ import annotations

import contextlib
import re
import uuid
from pathlib import Path

import nbformat
from notebook_parameters import parameters_of

from .frontends import WIDGET_FAILURES, WIDGET_REPR, Frontend, NotebookView
from .notebook_table import EXPECT, expect

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


@contextlib.contextmanager
def notebook_run(frontend: Frontend, server, browser, artifacts, name: str, parameters: str | None = None,
                 timeout_s: float = 900):
    """Open notebook `name` in a new page, type `parameters` over its parameters cell (if given), Run All, wait
    until no cell shows `[*]`, take the screenshots; yields the NotebookView, then closes the page and shuts the
    kernel down."""
    page = browser.new_page()
    console: list[str] = []   # the frontend's console errors and page errors: why a widget did not render
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"[:400])
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"[:400]))
    try:
        nb = frontend.open(page, server, f"notebooks/{name}.ipynb", workspace=f"t-{uuid.uuid4().hex[:8]}")
        if parameters is not None:
            frontend.set_source(page, 0, parameters)
        else:
            parameters = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4).cells[0].source
        nb.params = parameters_of(parameters)
        nb.console = console
        frontend.run_all(page)
        nb.run_seconds = frontend.wait_done(page, timeout_s)
        page.wait_for_timeout(1500)            # the boards' last redraw
        screenshot_cells(nb, artifacts)
        yield nb
    finally:
        page.close()
        server.shutdown_kernels()


def all_cells_ran_without_error_output(nb: NotebookView):
    cells = nb.cells()
    assert all(re.search(r"\[\d+\]", c.prompt) for c in cells), f"cells not run: {[c.prompt for c in cells]}"
    bad = {c.index: c.stderr for c in cells if c.stderr}
    assert not bad, f"error or stderr output (pink blocks) in cells {bad}"


def widgets_render_as_controls(nb: NotebookView):
    cells = nb.cells()
    text = "\n".join(c.text for c in cells)
    for failure in WIDGET_FAILURES:
        assert failure not in text, failure
    reprs = WIDGET_REPR.findall(text)
    assert not reprs, f"widgets shown as text, not as controls: {reprs}"
    assert sum(c.widgets for c in cells) > 0, (
        f"no widget rendered; the frontend's console: {nb.console[-15:]}")
    for what, selector in expect(nb.name).controls.items():
        assert nb.page.locator(selector).count() > 0, f"{what} ({selector}) not rendered"


def labels_are_whole(nb: NotebookView):
    assert nb.cut_labels() == [], "labels, buttons or values cut off"


def figures_shown(nb: NotebookView, at_least: int):
    images = sum(c.images for c in nb.cells())
    assert images >= at_least, f"{images} figures rendered, expected at least {at_least}"


def interaction_changes_output(nb: NotebookView, artifacts) -> str:
    row = EXPECT.get(nb.name)
    assert row is not None and row.interaction is not None, (
        f"{nb.name} has no interaction yet: add a row to EXPECT in tests/browser/notebook_table.py")
    try:
        shown = row.interaction(nb, nb.params)
    finally:                                   # what the user saw, also when it failed
        nb.page.wait_for_timeout(1000)
        screenshot_cells(nb, artifacts, "after-", widgets_only=True)
    return shown


def screenshot_cells(nb: NotebookView, artifacts, prefix: str = "", widgets_only: bool = False):
    """The page as a user sees it, and every cell with a widget (or a figure)."""
    nb.screenshot(artifacts, f"{prefix}page")
    for cell in nb.cells():
        if cell.widgets or (cell.images and not widgets_only):
            nb.screenshot(artifacts, f"{prefix}cell{cell.index:02d}",
                          nb.page.locator(nb.frontend.cell_sel).nth(cell.index))
