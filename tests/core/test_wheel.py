"""An installed, non-editable wheel ships `kernels/` as `grpo_lab.kernels` and no top-level `kernels` module."""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_grpo_lab_kernels_not_top_level_kernels(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True)
    wheel = next(dist.glob("grpo_lab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "grpo_lab/kernels/__init__.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    assert "grpo_lab/data_files/configs/Qwen3-0.6B.json" in names

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
        "import importlib.util, grpo_lab.kernels, grpo_lab.models as m;"
        "print(grpo_lab.kernels.__file__);"
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
