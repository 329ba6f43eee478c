"""Colab compatibility: Colab's kernels run ipywidgets 7.7.1, which speaks widget protocol 2 (controls model module
1.5.0) to Colab's own frontend. Here the notebooks run under ipywidgets 7.7.1 in a frontend that speaks that protocol:
the classic Notebook (nbclassic) with widgetsnbextension 3.6, in headless Chromium, from `./.venv-colab` (made by
scripts/install_browser.sh: those three packages over ./.venv's). As committed (showing the committed results),
Run All; every widget must render as a control, each notebook's interaction must work, and the widget models the
frontend received must be protocol 2's.
"""

from __future__ import annotations

import functools
import os
import subprocess

import nbformat
import pytest

from grpo_lab.lab.runner import find_notebooks

from . import checks
from .conftest import ROOT, missing_or_fail, serving
from .frontends import Classic
from .notebook_table import expect, with_overrides
from .servers import start_classic

pytestmark = pytest.mark.browser

NOTEBOOKS = [p.stem for p in find_notebooks(ROOT / "notebooks")]
COLAB_IPYWIDGETS = "7.7.1"
PROTOCOL_2_MODULES = {"@jupyter-widgets/controls": "1.5.0", "@jupyter-widgets/base": "1.2.0",
                      "@jupyter-widgets/output": "1.0.0"}

# the widget models the classic frontend holds: (module, module version, model name)
_MODELS_JS = """
async () => {
  const manager = (Jupyter.WidgetManager && Jupyter.WidgetManager._managers[0]) ||
                  (Jupyter.notebook.kernel.widget_manager);
  const models = await Promise.all(Object.values(manager._models));
  return models.map(m => [m.get('_model_module'), m.get('_model_module_version'), m.get('_model_name')]);
}
"""


def colab_python():
    venv = os.environ.get("GRPO_LAB_COLAB_VENV") or ROOT / ".venv-colab"
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        missing_or_fail(f"no ipywidgets-{COLAB_IPYWIDGETS} environment at {venv}")
    code = "import ipywidgets, widgetsnbextension, nbclassic, grpo_lab; " \
           "print(ipywidgets.__version__, widgetsnbextension.__version__)"
    probe = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    if probe.returncode != 0:
        missing_or_fail(f"{venv} is not usable: {probe.stderr.strip()[-400:]}")
    ipyw, nbext = probe.stdout.split()
    assert ipyw == COLAB_IPYWIDGETS and nbext.startswith("3.6."), (ipyw, nbext)
    return python


@pytest.fixture(scope="session")
def classic(chromium, tmp_path_factory):
    with serving(functools.partial(start_classic, colab_python()), tmp_path_factory.mktemp("classic")) as server:
        yield server


@pytest.fixture(scope="module", params=NOTEBOOKS)
def ran(request, classic, browser, artifacts):
    """The notebook as committed (01-03: QUICK = False, the committed results, the forms and boards) with the
    table's overrides typed in, Run All."""
    name, overrides = request.param, expect(request.param).overrides
    source = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0].source
    parameters = with_overrides(source, overrides) if overrides else None
    with checks.notebook_run(Classic(), classic, browser, artifacts, name, parameters, timeout_s=600) as nb:
        yield nb


def test_runs_without_error_output(ran):
    checks.all_cells_ran_without_error_output(ran)


def test_widgets_render_as_controls(ran):
    checks.widgets_render_as_controls(ran)


def test_widget_models_are_protocol_2(ran):
    models = ran.page.evaluate(_MODELS_JS)
    assert models, "the frontend holds no widget model"
    wrong = {(m, v) for m, v, _ in models if m in PROTOCOL_2_MODULES and v != PROTOCOL_2_MODULES[m]}
    assert not wrong, f"widget models of another protocol: {wrong}"
    unknown = {m for m, _, _ in models if m not in PROTOCOL_2_MODULES}
    assert not unknown, f"widgets outside core ipywidgets (Colab needs a custom widget manager for them): {unknown}"


def test_labels_are_whole(ran):
    checks.labels_are_whole(ran)


def test_expected_figures(ran):
    checks.figures_shown(ran, expect(ran.name).figures_committed)


def test_one_interaction_changes_the_output(ran, artifacts):
    assert checks.interaction_changes_output(ran, artifacts)
