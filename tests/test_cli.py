"""The grpo-lab command: reproduce runs notebooks headless; bad input is one line on stderr, exit status 2."""

import shutil
import subprocess
import sys

import nbformat
import pytest

from grpo_lab import cli


def _tiny_notebook(path, body):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("QUICK = False\nREFRESH_RESULTS = False")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def test_reproduce_quick_runs_every_notebook_with_quick_injected(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    marker = tmp_path / "quick.txt"
    _tiny_notebook(folder / "01_a.ipynb", f"open({str(marker)!r}, 'w').write(str(QUICK))")
    _tiny_notebook(folder / "02_b.ipynb", "x = 1")
    assert cli.main(["reproduce", "--quick", "--notebooks", str(folder), "--executed-dir", str(tmp_path / "ex")]) == 0
    assert marker.read_text() == "True"
    assert (tmp_path / "ex" / "01_a.ipynb").is_file() and (tmp_path / "ex" / "02_b.ipynb").is_file()


def test_refresh_results_is_asked_for_explicitly(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    marker = tmp_path / "refresh.txt"
    _tiny_notebook(folder / "01_a.ipynb", f"open({str(marker)!r}, 'a').write(str(REFRESH_RESULTS))")
    assert cli.main(["reproduce", "--notebooks", str(folder)]) == 0
    assert cli.main(["reproduce", "--notebooks", str(folder), "--refresh-results"]) == 0
    assert marker.read_text() == "FalseTrue"


def test_reproduce_reports_a_failing_notebook(tmp_path, capsys):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _tiny_notebook(folder / "01_bad.ipynb", "raise RuntimeError('broken cell')")
    assert cli.main(["reproduce", "--notebooks", str(folder)]) == 1
    assert "broken cell" in capsys.readouterr().err


def test_reproduce_survives_a_dead_kernel_and_never_writes_over_a_notebook(tmp_path, capsys):
    """A kernel that dies is that notebook's failure (the next one still runs); an executed copy that would land on
    the notebook itself is refused; the executed folder is printed."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _tiny_notebook(folder / "01_dies.ipynb", "import os; os._exit(1)")
    _tiny_notebook(folder / "02_ok.ipynb", "x = 1")
    before = (folder / "02_ok.ipynb").read_bytes()
    assert cli.main(["reproduce", "--notebooks", str(folder), "--executed-dir", str(tmp_path / "ex")]) == 1
    out, err = capsys.readouterr()
    assert "kernel died" in err and "1/2 notebooks ok" in out and str(tmp_path / "ex") in out
    assert cli.main(["reproduce", "--notebooks", str(folder), "--only", "02", "--executed-dir", str(folder)]) == 1
    assert "replace the notebook itself" in capsys.readouterr().err
    assert (folder / "02_ok.ipynb").read_bytes() == before
    (tmp_path / "afile").write_text("")
    assert cli.main(["reproduce", "--notebooks", str(folder), "--only", "02", "--executed-dir",
                     str(tmp_path / "afile")]) == 1
    assert "is a file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["memory", "--model", "Qwen3-99B"], "Unknown model 'Qwen3-99B'"),
    (["memory", "--backends", "trl,turbo"], "Unknown loss_backend 'turbo'"),
    (["memory", "--batch-sizes", "8,-2"], "positive integer"),
    (["max-batch", "--models", "nope"], "Unknown model 'nope'"),
    (["max-batch", "--backends", "x"], "Unknown loss_backend 'x'"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["reproduce", "--notebooks", "/nonexistent/notebooks"], "no notebooks folder"),
])
def test_bad_input_is_a_message_not_a_traceback(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_console_script_is_installed():
    exe = shutil.which("grpo-lab") or str(__import__("pathlib").Path(sys.executable).with_name("grpo-lab"))
    r = subprocess.run([exe, "memory", "--model", "nope"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Unknown model" in r.stderr and "Traceback" not in r.stderr
