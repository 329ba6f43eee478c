"""The environment is read in one module, `grpo_lab.lab.environment`, documented in one table (docs/environment.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from grpo_lab.lab import environment

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpo_lab"
THE_READER = PACKAGE / "lab" / "environment.py"
READING_METHODS = {"get", "setdefault", "items", "keys", "values"}  # `pop`, `update`, `[k] = v` write


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def environment_reads(source: str) -> list[int]:
    """Lines of `source` that read the process environment (passing `os.environ` on whole is not reading it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in READING_METHODS and _is_environ(node.func.value):
                lines.append(node.lineno)  # os.environ.get(...)
            elif node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
                lines.append(node.lineno)  # os.getenv(...)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            lines.append(node.lineno)  # os.environ[...]
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            lines.append(node.lineno)  # ... in os.environ
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and {a.name for a in node.names} & {"environ", "getenv"}:
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("snippet", [
    "import os\nx = os.environ.get('GRPO_LAB_DEBUG')", "import os\nx = os.environ['HF_HUB_OFFLINE']",
    "import os\nx = os.getenv('TRL_EXPERIMENTAL_SILENCE')", "import os\nx = 'GRPO_LAB_CACHE' in os.environ",
    "import os\nos.environ.setdefault('TRL_EXPERIMENTAL_SILENCE', '1')", "from os import environ\nx = environ['A']",
])
def test_the_scan_sees_every_way_of_reading(snippet):
    assert environment_reads(snippet)


def test_passing_the_environment_on_or_writing_it_is_not_reading():
    source = ("import os, subprocess\nsubprocess.run(['x'], env={**os.environ, 'A': '1'})\nenv = dict(os.environ)\n"
              "os.environ['A'] = '1'\nos.environ.pop('A', None)\nos.environ.update({'B': '2'})")
    assert environment_reads(source) == []


def test_no_module_but_the_one_reader_reads_the_environment():
    readers = {str(path.relative_to(ROOT)): lines for path in sorted(PACKAGE.rglob("*.py")) if path != THE_READER
               if (lines := environment_reads(path.read_text()))}
    assert readers == {}, "read the environment through grpo_lab.lab.environment (docs/environment.md)"


def test_every_variable_named_in_the_package_is_a_documented_one():
    """A GRPO_LAB_* / HF_* / TRL_* name written as a string anywhere in grpo_lab is in `VARIABLES`."""
    named = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"(GRPO_LAB|HF|TRL)_[A-Z0-9_]+", node.value):
                named.add(node.value)
    assert named - set(environment.VARIABLES) == set()


def test_the_docs_table_lists_exactly_the_variables():
    text = (ROOT / "docs" / "environment.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}
    assert documented == set(environment.VARIABLES)
    assert "docs/environment.md" in (ROOT / "README.md").read_text()


def test_accessors_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv("GRPO_LAB_DEBUG", raising=False)
    assert environment.debug() is False
    monkeypatch.setenv("GRPO_LAB_DEBUG", "1")
    assert environment.debug() is True
    monkeypatch.setenv("GRPO_LAB_CACHE", str(tmp_path))
    assert environment.cache_dir() == tmp_path
    monkeypatch.delenv("GRPO_LAB_CACHE")
    assert environment.cache_dir() == Path.home() / ".cache" / "grpo-lab"
    monkeypatch.setenv("GRPO_LAB_PROBE_TIMEOUT", "12.5")
    assert environment.probe_timeout_s() == 12.5
    monkeypatch.setenv("GRPO_LAB_VLLM_VENV", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert environment.vllm_venv() == tmp_path / "grpo-lab" / "vllm-cpu-venv"


@pytest.mark.parametrize("value, offline", [("1", True), ("true", True), ("YES", True), ("on", True),
                                            ("0", False), ("false", False), ("no", False), ("", False)])
def test_hub_offline_is_read_as_huggingface_hub_reads_it(monkeypatch, value, offline):
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert environment.hub_offline() is offline is (value.upper() in ENV_VARS_TRUE_VALUES)


def test_bearer_keys_and_kernel_variables(monkeypatch):
    monkeypatch.setenv("GRPO_LAB_TEST_KEY", "  secret \n")
    assert environment.bearer_key("GRPO_LAB_TEST_KEY") == "secret"
    monkeypatch.setenv("GRPO_LAB_TEST_KEY", "  ")
    assert environment.bearer_key("GRPO_LAB_TEST_KEY") is None and environment.bearer_key(None) is None
    assert environment.kernel_variables({"GRPO_LAB_TMA": "0", "GRPO_LAB_OTHER": "1", "TMA": "1"}) == {"TMA": "0"}


def test_grpo_lab_sets_only_what_the_user_left_unset(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "0")
    environment.silence_trl_experimental()
    assert environment.set_default("TRL_EXPERIMENTAL_SILENCE", "1") == "0"
    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE")
    environment.silence_trl_experimental()
    assert environment.set_default("TRL_EXPERIMENTAL_SILENCE", "0") == "1"
