"""Execute the notebooks headless (papermill over nbclient), in quick mode by default.

    python -m grpo_lab.lab.runner notebooks/01_memory_vs_batch.ipynb       # → executed copy + outputs/
    grpo-lab reproduce --quick                                                   # every notebook under notebooks/

Each notebook runs in its own folder with `QUICK=True` injected after its `parameters` cell and writes to the scratch
`outputs/` (`lab.outputs`; `refresh_results=True` injects `REFRESH_RESULTS=True`: the committed results/ instead).
Executed copies go to `executed_dir` (a temporary folder unless given), never over the committed notebooks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


class NotebookFailed(RuntimeError):
    pass


def find_notebooks(folder: str | Path = "notebooks") -> list[Path]:
    folder = Path(folder)
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith((".", "_")) and
                  ".ipynb_checkpoints" not in p.parts)


def has_parameters_cell(path: Path) -> bool:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells)


def run_notebook(path: str | Path, parameters: dict | None = None, executed_dir: str | Path | None = None,
                 quick: bool = True, timeout_s: int = 900, kernel_name: str = "python3",
                 refresh_results: bool = False, kernel_manager_class: type | None = None) -> Path:
    """Execute one notebook; returns the executed copy's path. Raises `NotebookFailed` with the failing cell, also
    for a cell that took its whole `timeout_s` (a wait nbclient can end without an error). The kernel's client polls
    in short slices (`headless_kernel`) unless `kernel_manager_class` says otherwise."""
    import papermill as pm

    from .headless_kernel import HeadlessKernelManager  # jupyter_client: the notebooks extra, like papermill

    path = Path(path).resolve()
    params = {"QUICK": True} if quick else {}
    if refresh_results:
        params["REFRESH_RESULTS"] = True
    params.update(parameters or {})
    if executed_dir is None:
        executed_dir = Path(tempfile.mkdtemp(prefix="grpo_lab_executed_"))
    out = Path(executed_dir).resolve() / path.name
    if out == path:
        raise NotebookFailed(f"{path.name}: the executed copy would replace the notebook itself; give another "
                             "executed_dir")
    if out.parent.exists() and not out.parent.is_dir():
        raise NotebookFailed(f"{path.name}: executed_dir {out.parent} is a file, not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    try:
        inject = params if has_parameters_cell(path) else {}
        executed = pm.execute_notebook(str(path), str(out), parameters=inject, cwd=str(path.parent),
                                       kernel_name=kernel_name, progress_bar=False, execution_timeout=timeout_s,
                                       log_output=False,
                                       kernel_manager_class=kernel_manager_class or HeadlessKernelManager)
    except pm.PapermillExecutionError as e:
        raise NotebookFailed(f"{path.name}: cell {e.exec_count} failed: {e.ename}: {e.evalue}") from None
    except CellTimeoutError as e:
        first = (str(e).strip().splitlines() or ["Cell execution timed out"])[0]
        raise NotebookFailed(f"{path.name}: {first} (cell timeout {timeout_s}s)") from None
    except DeadKernelError as e:
        raise NotebookFailed(f"{path.name}: the kernel died ({e})") from None
    except (ValueError, OSError) as e:  # not a notebook (bad JSON / nbformat), unreadable file
        raise NotebookFailed(f"{path.name}: could not be run: {type(e).__name__}: {e}") from None
    waited = timed_out_cells(executed, timeout_s)
    if waited:
        raise NotebookFailed(f"{path.name}: cell {waited[0][0]} took {waited[0][1]:.0f}s, its whole {timeout_s}s "
                             "timeout, and was not reported as timed out: not ok (executed copy: "
                             f"{out})")
    return out


def timed_out_cells(nb, timeout_s: float) -> list[tuple[int, float]]:
    """(execution count or index, seconds) of the code cells of an executed notebook that ran for `timeout_s` or
    more by papermill's clock: nbclient ends a wait that long without an error when the reply was there all along
    (see `headless_kernel`), so such a cell is a timeout, never ok."""
    cells = []
    for index, cell in enumerate(nb.cells):
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.cell_type == "code" and duration is not None and duration >= timeout_s:
            cells.append((cell.get("execution_count") or index, float(duration)))
    return cells


def run_all(notebooks: list[Path], executed_dir: str | Path | None = None, quick: bool = True,
            stop_on_error: bool = False, refresh_results: bool = False) -> list[tuple[Path, str, float]]:
    """Execute `notebooks` into one `executed_dir`: (notebook, "ok" | error message, seconds) for each."""
    if executed_dir is None:
        executed_dir = Path(tempfile.mkdtemp(prefix="grpo_lab_executed_"))
    if notebooks:
        print(f"executed copies (with outputs) → {executed_dir}", flush=True)
    report = []
    for nb in notebooks:
        t0 = time.perf_counter()
        try:
            run_notebook(nb, executed_dir=executed_dir, quick=quick, refresh_results=refresh_results)
            status = "ok"
        except NotebookFailed as e:
            status = str(e)
        seconds = time.perf_counter() - t0
        report.append((nb, status, seconds))
        if stop_on_error and status != "ok":
            break
        print(f"{nb.name}: {status} ({seconds:.0f}s)", flush=True)
    return report


def main(argv=None) -> int:
    """`grpo-lab reproduce` (also `python -m` of this module): the notebooks named, else all of the folder."""
    ap = argparse.ArgumentParser(prog="grpo-lab reproduce",
                                 description="Execute the notebooks headless; what they measure goes to outputs/ "
                                             "(git-ignored) unless --refresh-results.")
    ap.add_argument("paths", nargs="*", help="notebook files (default: every notebook of --notebooks)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True, help="CPU quick mode (default)")
    mode.add_argument("--full", action="store_true",
                      help="execute with the notebooks' own parameters (as committed they show the H200 results; "
                           "measuring needs RUN_HERE=True in a notebook and a GPU)")
    ap.add_argument("--notebooks", default="notebooks", help="folder of notebooks (default: notebooks/)")
    ap.add_argument("--only", nargs="*", default=None, help="run only notebooks whose name contains one of these")
    ap.add_argument("--executed-dir", default=None, help="where executed copies go (default: a temporary folder)")
    ap.add_argument("--stop-on-error", action="store_true")
    ap.add_argument("--refresh-results", action="store_true",
                    help="write the measured files into the committed results/ (maintainers refreshing them) "
                         "instead of outputs/")
    a = ap.parse_args(argv)
    notebooks = [Path(p) for p in a.paths]
    missing = [p for p in notebooks if not p.is_file()]
    if missing:
        print(f"error: no notebook {missing[0]}", file=sys.stderr)
        return 2
    if not notebooks and not Path(a.notebooks).is_dir():
        print(f"error: no notebooks folder {a.notebooks!r} (run from the repository root or pass --notebooks)",
              file=sys.stderr)
        return 2
    notebooks = [p for p in notebooks or find_notebooks(a.notebooks)
                 if not a.only or any(o in p.name for o in a.only)]
    report = run_all(notebooks, executed_dir=a.executed_dir, quick=not a.full, stop_on_error=a.stop_on_error,
                     refresh_results=a.refresh_results)
    if not report:
        print("error: no notebooks found", file=sys.stderr)
        return 2
    bad = [r for r in report if r[1] != "ok"]
    print(f"{len(report) - len(bad)}/{len(report)} notebooks ok")
    for nb, status, _ in bad:
        print(f"FAILED {nb.name}: {status}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
