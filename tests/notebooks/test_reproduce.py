"""What a user's plain `scripts/reproduce.sh` leaves: every notebook ran, its measurements are in the git-ignored
outputs/ folder of the checkout (never relative to notebooks/, never over the committed results/), `git status`
is clean, and no notebook printed warnings or errors."""

from pathlib import Path

import nbformat
import pytest

from grpo_lab.lab.runner import find_notebooks

from .conftest import ROOT, git

NOTEBOOKS = find_notebooks(ROOT / "notebooks")
# the figure folder each notebook writes to (a new notebook that writes results adds its folder here)
FIGURES = {"01_memory_vs_batch": "memory_vs_batch", "02_fsdp_max_batch": "fsdp_max_batch",
           "03_sanity_reward_curves": "reward_curves"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_committed_stripped_with_parameters_first(path: Path):
    nb = nbformat.read(path, as_version=4)
    assert "parameters" in nb.cells[0].metadata.get("tags", []), "the first cell must be papermill's parameters cell"
    assert "QUICK" in nb.cells[0].source
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), \
        "commit notebooks with their outputs stripped"


@pytest.mark.slow
def test_plain_reproduce_leaves_the_checkout_clean(reproduced):
    assert git(reproduced.clone, "status", "--porcelain", "--untracked-files=all") == ""
    assert not (reproduced.clone / "notebooks" / "results").exists()
    assert {p.name for p in (reproduced.clone / "notebooks").iterdir()} == {p.name for p in NOTEBOOKS}
    for stem, figure in FIGURES.items():
        written = sorted(p.name for p in reproduced.outputs(figure).iterdir())
        assert any(n.endswith(".csv") for n in written) and any(n.endswith(".png") for n in written), (stem, written)
    # 05 writes each sweep into a folder of its own, outputs/sweep/<date-time>/: its ranked table and figure
    sweeps = [p.parent for p in reproduced.outputs("sweep").rglob("sweep.json")]
    assert sweeps and all((s / "summary.csv").exists() and (s / "sweep.png").exists() for s in sweeps), sweeps
    assert f"{len(NOTEBOOKS)}/{len(NOTEBOOKS)} notebooks ok" in reproduced.log


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_executed_notebooks_show_figures_and_no_errors_or_warnings(reproduced, name):
    nb = reproduced.executed_notebook(name)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert [o for o in outputs if "image/png" in o.get("data", {})], "no figure in the executed notebook"
    assert not [o for o in outputs if o.output_type == "error"]
    stderr = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stderr")
    assert "Warning" not in stderr and "deprecated" not in stderr, stderr[-2000:]
