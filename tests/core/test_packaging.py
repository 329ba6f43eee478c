"""The project's own install files agree: environment.yml installs the package with its extras, CI runs README's
test command, and the extras name what the notebooks and backends import."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_environment_yml_uses_conda_forge_and_installs_the_extras():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"][0] == "conda-forge"
    deps = env["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and any(str(d).startswith("pip") for d in deps)
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    extras = set(re.search(r"\[(.*)\]", pip[0]).group(1).split(","))
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras <= declared and {"notebooks", "liger"} <= extras


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/reproduce.sh" in readme
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    # each optional tier's install and the switch that makes its skip a failure, then README's test command
    tiers = {"bash scripts/install_browser.sh": "export GRPO_LAB_REQUIRE_BROWSER=1",
             "bash scripts/vllm_cpu_env.sh": "export GRPO_LAB_REQUIRE_VLLM=1"}
    assert ci_lines[-1] == "bash scripts/test.sh"
    # and the Ray tier's real-vLLM actor test, which reuses the vLLM tier's venv; and the network namespaces of the
    # Ray tier's nodes and the S3 server, required (CI runs as root)
    assert ci_lines[:-1] == [line for pair in tiers.items() for line in pair] + ["export GRPO_LAB_RAY_VLLM=1",
                                                                                 "export GRPO_LAB_REQUIRE_NETNS=1"]
    assert "bash scripts/install_browser.sh" in readme and "GRPO_LAB_RAY_VLLM" in readme
    assert "GRPO_LAB_REQUIRE_NETNS" in readme


def test_extras_pin_what_the_issue_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("ipywidgets>=7.7,<9") for d in extras["notebooks"])
    assert any(d.startswith("liger-kernel") for d in extras["liger"])
    assert any(d.startswith("vllm") for d in extras["vllm"])
    core = " ".join(project["dependencies"])
    for name in ("trl", "peft", "transformers", "datasets", "torch", "triton"):
        assert name in core
