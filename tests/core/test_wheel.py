"""An installed, non-editable wheel ships `grpo_lab.loss.kernel` and no top-level `kernels` module, and every
file of results/ and data/ (the notebooks read the committed results from the installed package on Colab)."""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SHIPPED_FOLDERS = {"results": "grpo_lab/reference_results", "data": "grpo_lab/data_files"}


def _project_files(folder: str) -> list[str]:
    """The files of `folder` as committed (git ls-files in a clone; a walk of the folder otherwise)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", folder], capture_output=True, text=True,
                             check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]


def test_wheel_installs_the_grpo_lab_kernel_not_top_level_kernels(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(dist), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    # setuptools warns (and will one day leave the files out) for a data folder missing from `packages`
    assert "absent from the `packages` configuration" not in build.stderr, build.stderr[-3000:]
    wheel = next(dist.glob("grpo_lab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "grpo_lab/loss/kernel/__init__.py" in names
    assert "grpo_lab/loss/heads/__init__.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    assert "grpo_lab/data_files/configs/Qwen3-0.6B.json" in names
    packages = [p.relative_to(ROOT).as_posix() for p in (ROOT / "grpo_lab").rglob("__init__.py")]
    left_out = [p for p in packages if p not in names]  # a sub-package missing from pyproject's `packages`
    assert not left_out, f"not in the wheel: {left_out}; list each package in pyproject's `packages`"
    for folder, package in SHIPPED_FOLDERS.items():
        files = _project_files(folder)
        assert files, folder
        missing = [f for f in files if f"{package}/{Path(f).relative_to(folder)}" not in names]
        assert not missing, (f"not in the wheel: {missing}; list each folder under {folder}/ in pyproject's "
                             "`packages` and its file types in `package-data`")

    # A fresh environment that sees this one's packages (torch, trl, ...) but not the source tree: a .pth adds
    # this environment's site-packages after its own, so the installed wheel is what `import grpo_lab` finds.
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True)
    code = (
        "import importlib.util, grpo_lab.loss.kernel, grpo_lab.models as m;"
        "print(grpo_lab.loss.kernel.__file__);"
        "print(importlib.util.find_spec('kernels') is None or 'grpo_lab' not in str(importlib.util.find_spec('kernels').origin));"
        "print(m.load_model_config('Qwen3-0.6B').hidden_size)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kernels_file, no_top_level, hidden = out.stdout.split()
    assert str(env_dir) in kernels_file and "site-packages" in kernels_file
    assert no_top_level == "True"
    assert hidden == "1024"


def test_a_checkout_root_on_sys_path_does_not_shadow_hugging_face_kernels():
    """`python -m ...` from the repository root puts the root first on sys.path; a top-level `kernels` package there
    would shadow Hugging Face's `kernels`, which transformers imports when it is installed (a hard dependency from
    transformers 5.25), and every model import would fail."""
    code = ("import importlib.util, pathlib, sys; spec = importlib.util.find_spec('kernels');"  # not <root>/kernels
            "where = [pathlib.Path(p).resolve() for p in ((spec and spec.submodule_search_locations) or [])];"
            "print(pathlib.Path(sys.argv[1]).resolve() / 'kernels' not in where);"
            "from transformers import Qwen2ForCausalLM; print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "ok"], out.stdout
