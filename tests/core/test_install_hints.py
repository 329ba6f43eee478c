"""Issue 43 #11: a message that says how to install an extra names an install that works. No package index serves
grpo-lab, so `pip install 'grpo-lab[ray]'` fails; every such message comes from `lab.install.install_hint` (a clone
or the git URL), and names an extra pyproject.toml declares."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

from grpo_lab.lab.install import REPOSITORY, install_hint

ROOT = Path(__file__).resolve().parents[2]


def test_no_message_names_a_distribution_no_index_serves():
    bare = re.compile(r"""pip install ['"]?grpo[-_]lab\[""")
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "grpo_lab").rglob("*.py") if p.name != "install.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert hits == []


def test_every_extra_a_message_names_is_declared():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {m for p in (ROOT / "grpo_lab").rglob("*.py")
             for m in re.findall(r"""install_hint\(['"]([\w-]+)['"]\)""", p.read_text())}
    assert {"ray", "trackers", "s3", "liger", "notebooks", "bench"} <= named
    assert named <= declared, named - declared


def test_the_hint_installs_from_a_clone_or_the_repository():
    assert install_hint("s3", "ray") == (f'pip install -e ".[s3,ray]" in a clone of grpo-lab, or pip install '
                                         f'"grpo-lab[s3,ray] @ git+{REPOSITORY}"')


def test_the_command_without_ray_says_how_to_install_it(monkeypatch, capsys):
    from grpo_lab.async_loop import command

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert command.main(["--launcher", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"grpo-lab async-loop: error: --launcher ray: Ray is not installed: {install_hint('ray')}"
