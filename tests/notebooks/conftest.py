"""One headless run of every notebook, as `scripts/reproduce.sh` does it, in a throwaway clone of this checkout.

The clone holds the working tree's tracked files (uncommitted edits included) committed into a fresh git repository,
so the tests can check what a user's plain run leaves behind (`git status` clean, nothing under notebooks/) and read
what it measured from `outputs/`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Reproduced:
    clone: Path                 # the throwaway checkout the notebooks ran in
    executed: Path              # executed copies of the notebooks (with outputs)
    log: str                    # what `grpo-lab reproduce` printed

    def outputs(self, figure: str) -> Path:
        return self.clone / "outputs" / figure

    def executed_notebook(self, name: str):
        return nbformat.read(self.executed / name, as_version=4)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def clone_working_tree(dest: Path) -> Path:
    """Copy the tracked files as they are in the working tree into `dest` and commit them there."""
    files = git(ROOT, "ls-files", "-z", "--cached").split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git(dest, "init", "-q")
    git(dest, "-c", "user.name=test", "-c", "user.email=test@localhost", "add", "-A")
    git(dest, "-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-q", "-m", "snapshot")
    return dest


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory) -> Reproduced:
    """`grpo-lab reproduce --quick` (what scripts/reproduce.sh runs after making its venv) in a clone; every notebook
    must succeed."""
    base = tmp_path_factory.mktemp("reproduce")
    clone = clone_working_tree(base / "clone")
    executed = base / "executed"
    env = {k: v for k, v in os.environ.items() if k != "GRPO_LAB_OUTPUT_DIR"}  # the default location is under test
    run = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "reproduce", "--quick", "--executed-dir",
                          str(executed)], cwd=clone, env=env, capture_output=True, text=True, timeout=1500,
                         check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return Reproduced(clone=clone, executed=executed, log=log)
