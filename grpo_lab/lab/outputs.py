"""Where a notebook or a command writes what it measures: never relative to the folder it happens to run in.

A run on the user's machine goes to a scratch folder, so it can never replace the committed results:

1. `out_dir` when the user chose one (a relative path is taken from the repository root in a checkout, else from
   the current folder);
2. `<repository root>/results/<figure>` only when asked to refresh the committed results (`refresh=True`:
   `REFRESH_RESULTS = True` in a notebook, `grpo-lab reproduce --refresh-results`);
3. `$GRPO_LAB_OUTPUT_DIR/<figure>` when that variable is set;
4. `<repository root>/outputs/<figure>` in a checkout (git-ignored), else `./grpo_lab_outputs/<figure>` (Colab, an
   installed package).

The repository root is found from the current folder upwards, so a notebook kernel running in `notebooks/` and a
command run from the root resolve to the same folders.
"""

from __future__ import annotations

import contextlib
import os
from importlib import resources
from pathlib import Path

from . import environment

OUTPUT_ENV = environment.OUTPUT_DIR
SCRATCH = "outputs"                 # under the repository root; listed in .gitignore
SCRATCH_OUTSIDE_A_CHECKOUT = "grpo_lab_outputs"


def repo_root(start: str | os.PathLike | None = None) -> Path | None:
    """The grpo-lab checkout containing `start` (default: the current folder), or None outside one."""
    here = Path(start or Path.cwd()).resolve()
    for base in (here, *here.parents):
        if (base / "pyproject.toml").is_file() and (base / "grpo_lab").is_dir() and (base / "notebooks").is_dir():
            return base
    return None


def committed_results(folder: str) -> Path:
    """The committed `results/<folder>`: shipped as `grpo_lab.reference_results` when installed, else the checkout's."""
    with contextlib.suppress(ModuleNotFoundError, FileNotFoundError):
        path = Path(str(resources.files("grpo_lab.reference_results").joinpath(folder)))
        if path.is_dir():
            return path
    return Path(__file__).resolve().parents[2] / "results" / folder


def output_dir(figure: str, out_dir: str | os.PathLike | None = None, refresh: bool = False) -> Path:
    """The folder a run of `figure` (e.g. "memory_vs_batch") writes to, made if missing; see the module docstring for
    the order."""
    root = repo_root()
    if out_dir:
        p = Path(out_dir).expanduser()
        if not p.is_absolute():
            p = (root or Path.cwd()) / p
    elif refresh:
        if root is None:
            raise ValueError("REFRESH_RESULTS needs a clone of grpo-lab (it rewrites the committed results/); "
                             "outside one, leave it False or give an output folder")
        p = root / "results" / figure
    elif environment.output_dir() is not None:
        p = environment.output_dir() / figure  # resolved
    else:
        p = (root / SCRATCH if root is not None else Path.cwd() / SCRATCH_OUTSIDE_A_CHECKOUT) / figure
    if p.exists() and not p.is_dir():
        raise ValueError(f"the output folder {p} is a file")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:   # a file where a folder of the path should be
        raise ValueError(f"cannot make the output folder {p}: {e}") from None
    return p
