"""Every loop setting has one home (`grpo_lab.async_loop.loop_settings`): the command lines are generated from it, and
a default written again anywhere else in grpo_lab fails here.

The generated parsers' defaults are the dataclasses' by construction (checked below for every field); the AST scan
forbids what used to drift: a literal `max_staleness` (its home is `serving.adapters.slots.DEFAULT_MAX_STALENESS`)
as a default, a keyword argument or a dict entry anywhere in grpo_lab, and in `grpo_lab/async_loop` a literal equal
to a loop setting's default given as another default, keyword argument or dict entry under that setting's name.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from grpo_lab.async_loop import command, serve_pool
from grpo_lab.async_loop.loop_settings import LoopSettings, PoolSettings
from grpo_lab.lab.settings import default_of, without_none
from grpo_lab.serving.replicas import cpu_replica
from grpo_lab.serving.replicas.config import CPUReplicaConfig
from grpo_lab.serving.router import server as router_server
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.adapters.slots import DEFAULT_MAX_STALENESS

PACKAGE = Path(__file__).resolve().parents[2] / "grpo_lab"
HOMES = {PACKAGE / "async_loop" / "loop_settings.py", PACKAGE / "serving" / "adapters" / "slots.py"}
# the names other classes give a loop setting (LoopConfig, PoolConfig, QuickSettings, the trainer's config)
ALIASES = {"steps": "max_steps", "router_port": "port", "pool_weight": "run_weight", "lease_s": "run_lease",
           "rollout_failure_timeout_s": "rollout_failure_timeout", "replica_urls": "replica_url",
           "pool_run_name": "pool_run", "allow_base_model": "base_model"}


# settings whose default is a convention other code rightly writes for its own purposes: 0 for a free port or a
# dataset's seed, the loopback address
CONVENTIONS = {"port", "seed", "host"}
# a published recipe's own values, which happen to equal some loop defaults (its max_staleness is still scanned)
RECIPES = {PACKAGE / "async_loop" / "recipe.py"}


def loop_defaults() -> dict[str, object]:
    """Each loop setting's literal default (numbers and strings: the values that could be written again)."""
    out = {}
    for settings in (LoopSettings, PoolSettings):
        for f in dataclasses.fields(settings):
            if f.name in CONVENTIONS:
                continue
            if isinstance(f.default, (int, float, str)) and not isinstance(f.default, bool):
                out.setdefault(f.name, f.default)
    out.update({alias: out[name] for alias, name in ALIASES.items() if name in out})
    return out


def _literal(node):
    """The value of a number or string literal (a negative number included), or a sentinel."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        node = ast.Constant(-node.operand.value) if isinstance(node.operand.value, (int, float)) else node
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) and \
            not isinstance(node.value, bool):
        return node.value
    return _literal


def named_literals(tree: ast.AST):
    """(line, name, literal) for every default, keyword argument and dict entry that gives a name a literal."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            yield from ((d.lineno, a.arg, _literal(d)) for a, d in pairs)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = node.value  # `x: int = 4`, or a dataclass's `x: int = field(default=4, ...)`
            if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
                value = next((k.value for k in value.keywords if k.arg == "default"), value)
            yield node.lineno, node.target.id, _literal(value)
        elif isinstance(node, ast.Call):
            yield from ((k.value.lineno, k.arg, _literal(k.value)) for k in node.keywords if k.arg)
        elif isinstance(node, ast.Dict):
            yield from ((v.lineno, k.value, _literal(v)) for k, v in zip(node.keys, node.values)
                        if isinstance(k, ast.Constant) and isinstance(k.value, str))


def violations(source: str, in_async_loop: bool, defaults: dict[str, object]) -> list[tuple[int, str]]:
    found = []
    for line, name, value in named_literals(ast.parse(source)):
        if value is _literal:
            continue
        if name == "max_staleness" and isinstance(value, int):
            found.append((line, f"max_staleness={value!r} (use DEFAULT_MAX_STALENESS)"))
        elif in_async_loop and name in defaults and value == defaults[name] and type(value) is type(defaults[name]):
            home = f"LoopSettings.{ALIASES.get(name, name)}"
            found.append((line, f"{name}={value!r} repeats a loop default (use {home})"))
    return found


def test_no_loop_default_is_written_outside_its_home():
    defaults = loop_defaults()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in HOMES:
            continue
        in_async_loop = (PACKAGE / "async_loop") in path.parents and path not in RECIPES
        for line, what in violations(path.read_text(), in_async_loop, defaults):
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, in_async_loop, expected", [
    ("def f(max_staleness: int = 4): pass", False, 1),
    ("class C:\n    max_staleness: int = 4\n", False, 1),
    ("class C:\n    max_staleness: int = field(default=4, metadata={})\n", False, 1),
    ("class C:\n    tree_attention: str = dataclasses.field(default='auto')\n", True, 1),
    ("register(name, max_staleness=2)", False, 1),
    ("RUN = {'max_staleness': 4}", False, 1),
    ("def f(max_staleness=DEFAULT_MAX_STALENESS): pass", False, 0),
    ("values = dict(max_steps=20, learning_rate=3e-3)", True, 2),
    ("values = dict(max_steps=20, learning_rate=3e-3)", False, 0),
    ("class Q:\n    steps: int = 20\n    queue_maxsize: int = 1024\n", True, 2),
    ("def f(max_inflight_tasks=-1): pass", True, 1),
    ("def f(max_steps=LoopSettings.max_steps, seed=7): pass", True, 0),
])
def test_the_scan_finds_a_default_written_again(source, in_async_loop, expected):
    assert len(violations(source, in_async_loop, loop_defaults())) == expected


@pytest.mark.parametrize("parser, settings", [(command.build_parser, LoopSettings),
                                              (serve_pool.build_parser, PoolSettings)])
def test_the_generated_parser_is_the_dataclass(parser, settings):
    """Every field is one dashed flag with help; parsing nothing gives the dataclass's defaults."""
    p = parser()
    flags = {option: action for action in p._actions for option in action.option_strings}
    for f in dataclasses.fields(settings):
        dashed = "--" + f.name.replace("_", "-")
        flag = dashed if dashed in flags else "--no-" + dashed[2:]
        assert flag in flags and flags[flag].help, f.name
        assert flags[flag].dest == f.name
    assert p.parse([]) == settings()


def leaf_defaults(config_type, path=()):
    """`{dest: default}` of each field of `config_type`, a nested dataclass's fields flattened (`per_try.cap_s`)."""
    out = {}
    for f in dataclasses.fields(config_type):
        nested = without_none(typing.get_type_hints(config_type)[f.name])
        if dataclasses.is_dataclass(nested):
            out.update(leaf_defaults(nested, (*path, f.name)))
        else:
            out[".".join((*path, f.name))] = default_of(f)
    return out


@pytest.mark.parametrize("parser, config", [
    (router_server.build_parser, RouterConfig(replicas=["http://127.0.0.1:9"])),
    (cpu_replica.build_parser, CPUReplicaConfig())])
def test_the_serving_command_lines_are_their_configs(parser, config):
    """The router's and the CPU replica's flags are generated from their config dataclasses: each field (nested
    ones flattened) has one flag whose default is the field's, and parsing only what is required gives the config
    the dataclass itself gives."""
    p = parser()
    defaults = {action.dest: action.default for action in p._actions}
    for dest, default in leaf_defaults(type(config)).items():
        assert dest in defaults and defaults[dest] == default, dest
    assert p.parse(["--replica", "http://127.0.0.1:9"] if isinstance(config, RouterConfig) else [])[0] == config


def test_a_config_file_sets_settings_and_flags_override_it(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("max_steps: 7\nlearning_rate: 0.001\nreport_to: [tensorboard]\ngroup_versions: false\n")
    s = command.parse_settings(["--config", str(config), "--max-steps", "9"])
    assert (s.max_steps, s.learning_rate, s.report_to, s.group_versions) == (9, 0.001, ["tensorboard"], False)
    assert command.parse_settings([f"--config={config}"]).max_steps == 7


@pytest.mark.parametrize("text, flag, word", [
    ("max_steps: 0\n", "--max-steps", ">= 1"),
    ("max_steps: ten\n", "--max-steps", "integer"),
    ("loss_backend: liger\n", "--loss-backend", "liger"),
    ("max_stepz: 3\n", "--config", "max_stepz"),
    ("- a list\n", "--config", "mapping"),
    ("max_steps: [\n", "--config", "not a YAML file"),
])
def test_a_bad_config_file_is_one_line_naming_the_setting(text, flag, word, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert command.main(["--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and word in err and "Traceback" not in err, err


def test_derived_values_follow_max_staleness():
    from grpo_lab.serving.adapters.slots import max_loras_for

    for staleness in (0, DEFAULT_MAX_STALENESS, 9):
        s = LoopSettings(max_staleness=staleness)
        assert s.adapter_slots == max_loras_for(staleness)
        assert s.inflight == max(staleness, 1) * s.samples_per_step
    assert PoolSettings().adapter_slots % max_loras_for(DEFAULT_MAX_STALENESS) == 0
