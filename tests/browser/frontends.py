"""Drive a notebook the way a user does, in JupyterLab or in the classic Notebook (nbclassic), through Playwright.

Both drivers offer the same verbs (open, edit the parameters cell, Run All, wait until no cell shows `[*]`, read
what every code cell shows), so the checks and the per-notebook interactions are written once. Widget DOM is shared
by ipywidgets 7.7 and 8.x (`.jupyter-widgets`, `.widget-label`, `.jupyter-button`, `.widget-readout` ...).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

# A widget shown as text instead of a control: the frontend has no widget manager, or the model never arrived.
WIDGET_REPR = re.compile(r"^\s*(VBox|HBox|Box|IntProgress|FloatProgress|Button|Output|HTML|Label|Text|IntText|FloatText|"
                         r"IntSlider|FloatSlider|FloatLogSlider|SelectionSlider|Dropdown|SelectMultiple|Checkbox|"
                         r"Tab|Accordion)\(", re.MULTILINE)
WIDGET_FAILURES = ("Error displaying widget", "Loading widget", "model not found", "Failed to load model class")

# One JS pass over the notebook: per code cell its prompt and what its outputs show.
_COLLECT_JS = """
([cellSel, promptSel, outputSel, stderrSel]) => Array.from(document.querySelectorAll(cellSel)).map((cell, i) => {
  const outputs = Array.from(cell.querySelectorAll(outputSel));
  const imgs = Array.from(cell.querySelectorAll(outputSel + ' img')).filter(
      im => im.complete && im.naturalWidth > 0 && (im.src || '').startsWith('data:image/png'));
  return {
    index: i,
    prompt: (cell.querySelector(promptSel) || {innerText: ''}).innerText.trim(),
    text: outputs.map(o => o.innerText).join('\\n'),
    stderr: Array.from(cell.querySelectorAll(stderrSel)).map(o => o.innerText),
    images: imgs.length,
    widgets: cell.querySelectorAll('.jupyter-widgets').length,
  };
})
"""

# Labels, buttons and text boxes whose content does not fit (ipywidgets cuts them with an ellipsis).
_CUT_JS = """
() => Array.from(document.querySelectorAll(
    '.jupyter-widgets .widget-label, .jupyter-widgets button.jupyter-button, .jupyter-widgets .widget-text input'))
  .filter(el => el.offsetParent !== null && el.scrollWidth > el.clientWidth + 1)
  .map(el => (el.tagName === 'INPUT' ? 'input: ' + el.value : el.innerText.trim()) +
             ` (${el.scrollWidth}px of content in ${el.clientWidth}px)`)
"""


@dataclass
class CellView:
    index: int
    prompt: str
    text: str
    stderr: list[str]
    images: int
    widgets: int


@dataclass
class NotebookView:
    """A notebook open in a browser page; the tests and interactions go through it."""
    page: object
    name: str
    frontend: Frontend
    params: dict = field(default_factory=dict)      # the parameters cell's values as run
    run_seconds: float = 0.0
    screenshots: list = field(default_factory=list)
    console: list = field(default_factory=list)     # the page's console errors/warnings and page errors

    def cells(self) -> list[CellView]:
        f = self.frontend
        raw = self.page.evaluate(_COLLECT_JS, [f.cell_sel, f.prompt_sel, f.output_sel, f.stderr_sel])
        return [CellView(**c) for c in raw]

    def cut_labels(self) -> list[str]:
        return self.page.evaluate(_CUT_JS)

    def cell(self, contains: str):
        """The code cell whose source contains `contains` (a locator)."""
        return self.page.locator(self.frontend.cell_sel).filter(has_text=contains).first

    def screenshot(self, folder, label: str, locator=None):
        path = folder / f"{self.frontend.name}-{self.name}-{label}.png"
        (locator or self.page).screenshot(path=str(path))
        self.screenshots.append(path)
        return path


class Frontend:
    name = ""
    cell_sel = prompt_sel = output_sel = stderr_sel = editor_sel = ""

    def url(self, server, path: str, workspace: str) -> str:
        raise NotImplementedError

    def wait_loaded(self, page, timeout_s: float):
        raise NotImplementedError

    def run_all(self, page):
        raise NotImplementedError

    def open(self, page, server, path: str, workspace: str, timeout_s: float = 120) -> NotebookView:
        page.goto(self.url(server, path, workspace))
        self.wait_loaded(page, timeout_s)
        return NotebookView(page, path.rsplit("/", 1)[-1].removesuffix(".ipynb"), self)

    def set_source(self, page, index: int, source: str):
        """Replace code cell `index`'s source as a user would: click into it, select all, type."""
        editor = page.locator(self.cell_sel).nth(index).locator(self.editor_sel).first
        editor.click()
        page.keyboard.press("Control+a")
        page.keyboard.insert_text(source)
        page.keyboard.press("Escape")

    def prompts(self, page) -> list[str]:
        return [t.strip() for t in page.locator(f"{self.cell_sel} {self.prompt_sel}").all_inner_texts()]

    def wait_done(self, page, timeout_s: float, expect_all: bool = True) -> float:
        """Until no cell shows `[*]` (and every cell has run when `expect_all`); returns the seconds waited.
        The kernel's idle status is not used: it flickers to idle between the cells of a Run All."""
        t0 = time.monotonic()
        stable = 0
        while time.monotonic() - t0 < timeout_s:
            prompts = self.prompts(page)
            busy = any("*" in p for p in prompts)
            unrun = any(not re.search(r"\d", p) for p in prompts)
            stable = stable + 1 if prompts and not busy and not (expect_all and unrun) else 0
            if stable >= 3:          # three polls in a row: a queued cell would have started by then
                return time.monotonic() - t0
            page.wait_for_timeout(500)
        raise TimeoutError(f"cells still running or not run after {timeout_s:.0f}s: {self.prompts(page)}")


class Lab(Frontend):
    """JupyterLab 4 (ipywidgets 8.x through jupyterlab_widgets)."""
    name = "lab"
    cell_sel = ".jp-Notebook .jp-CodeCell"
    prompt_sel = ".jp-InputPrompt"
    output_sel = ".jp-OutputArea-output"
    stderr_sel = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'
    editor_sel = ".cm-content"

    def url(self, server, path, workspace):
        # a fresh workspace, reset: no layout or open tabs from an earlier run
        return f"{server.url}/lab/workspaces/{workspace}/tree/{path}?reset&token={server.token}"

    def wait_loaded(self, page, timeout_s):
        page.wait_for_selector(f"{self.cell_sel} {self.editor_sel}", timeout=timeout_s * 1000)
        page.wait_for_selector(".jp-StatusBar-TextItem:has-text('| Idle')", timeout=timeout_s * 1000)
        page.keyboard.press("Control+b")   # fold the file browser away: the notebook gets the page's width

    def run_all(self, page):
        page.locator(".lm-MenuBar-item", has_text="Run").first.click()
        page.locator('li[data-command="runmenu:run-all"]').click()


_WIDGETS_READY = """() => {
    try {
        const area = require("notebook/js/outputarea").OutputArea;
        return area.output_types.includes("application/vnd.jupyter.widget-view+json")
            && Jupyter.notebook.kernel.widget_manager !== undefined;
    } catch (e) { return false; }
}"""


_KERNEL_QUIET = """() => {
    const k = Jupyter.notebook.kernel;
    return !!k && k.is_connected() && Object.keys(k.info_reply || {}).length > 0
        && Object.keys(k._msg_callbacks || {}).length === 0;
}"""


class Classic(Frontend):
    """The classic Notebook frontend (nbclassic) with widgetsnbextension 3.6: ipywidgets 7.7.1, protocol 2."""
    name = "classic"
    cell_sel = "#notebook-container .cell.code_cell"
    prompt_sel = ".input_prompt"
    output_sel = ".output_area"
    stderr_sel = ".output_stderr, .output_error"
    editor_sel = ".CodeMirror"

    def url(self, server, path, workspace):
        return f"{server.url}{server.prefix}/notebooks/{path}?token={server.token}"

    def _wait_page(self, page, timeout_s):
        """The notebook's cells are drawn and its kernel is connected."""
        page.wait_for_selector(f"{self.cell_sel} {self.editor_sel}", timeout=timeout_s * 1000)
        page.wait_for_function("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && "
                               "Jupyter.notebook.kernel.is_connected()", timeout=timeout_s * 1000)

    def wait_loaded(self, page, timeout_s):
        self._wait_page(page, timeout_s)
        # widgetsnbextension gives the kernel its widget manager and registers the widget-view output type when its
        # nbextension loads; a cell run before then shows no widget at all. On a loaded machine the extension can
        # also load after the kernel was created and never attach a manager to it (seen in CI): reload once, as a
        # user facing a notebook without widgets would.
        for attempt in (1, 2):
            try:
                page.wait_for_function(_WIDGETS_READY, timeout=min(60.0, timeout_s) * 1000)
                break
            except Exception:  # noqa: BLE001 - Playwright's TimeoutError; the second attempt raises it
                if attempt == 2:
                    raise
                page.reload()
                self._wait_page(page, timeout_s)
        # The new widget manager first asks the kernel for the widgets it already has (a "jupyter.widget.control"
        # comm; a kernel that has not imported ipywidgets yet closes it, and the manager falls back to a comm_info
        # request and re-opens a comm to every widget listed). Cells run before that has finished get their
        # widgets' comms re-opened under them and show nothing (seen in CI on a cold first notebook: "Control comm
        # was closed too early"). So: Run All only once the kernel has answered kernel_info and no request has been
        # pending for 2 s.
        quiet_since, deadline = None, time.monotonic() + min(60.0, timeout_s)
        while time.monotonic() < deadline:
            if page.evaluate(_KERNEL_QUIET):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= 2.0:
                    return
            else:
                quiet_since = None
            page.wait_for_timeout(250)
        raise TimeoutError("the classic frontend's kernel never went quiet (kernel_info answered, nothing pending)")

    def run_all(self, page):
        page.locator("#celllink").click()
        page.locator("#run_all_cells a").click()
