"""Configuration of the prefix-aware router (the proxy TRL's AsyncGRPOTrainer talks to as one vLLM server)."""

from __future__ import annotations

import ipaddress
import os
import posixpath
from dataclasses import dataclass
from urllib.parse import urlsplit

from grpo_lab.lab import environment
from grpo_lab.lab.settings import Range, check_fields, setting

from ..routing.per_try import PerTryConfig
from ..routing.policy import RoutingConfig
from ..routing.registry import DEFAULT_POLICY, POLICIES, check_policy_name
from ..tenancy.runs import TenancyConfig

POSITIVE = Range(0, open=True)


@dataclass
class RouterConfig:
    """Where the router listens, which replicas it fronts, and how it treats them. `python -m grpo_lab.router`'s
    flags are generated from these fields (`lab.settings_parser`; each entry below is its flag's help).

    Args:
        replicas: base URLs of the upstream vLLM (or CPU) replicas, e.g. `["http://127.0.0.1:8001", ...]`.
        host: interface to listen on; loopback by default. Any other address is refused unless client
            authentication (`client_api_key_env`/`client_api_key_file`) and `adapter_roots` are set, or `insecure`.
        port: port to listen on; 0 picks a free one (read it back from the handle).
        api_key_env: environment variable holding the bearer token added to every upstream call.
        api_key_file: file holding the token (first line); used when set, instead of the variable.
        client_api_key_env: environment variable holding the key every client must send (`Authorization: Bearer
            <key>`) on every endpoint, `/health`, `/pause`, `/server_info` and `/metrics` included. Separate from the
            upstream token. None (default): no client authentication.
        client_api_key_file: file holding that key (first line); used when set, instead of the variable.
        insecure: allow a non-loopback `host` without client authentication or adapter roots (an open proxy that
            loads adapters from any path: only on a trusted network).
        adapter_roots: storage roots (local directories or fsspec-style URLs) that `lora_path` must lie under; a
            path outside them is refused with 400. Empty: any path (fine on loopback).
        routing_policy: which routing policy spreads completions over the replicas: a name in
            `routing.registry.POLICIES` (default `DEFAULT_POLICY`, prefix affinity).
        routing: the routing policy's parameters; `block_size` is replaced by the replicas'
            `cache_config.block_size` when they report one.
        health_interval_s: seconds between background `/health` checks of each replica.
        health_timeout_s: timeout of one check; a replica failing it leaves routing.
        load_retry_deadline_s: how long an adapter load keeps retrying a replica that answers "No adapter found"
            (shared storage not visible there yet) before the whole load is rolled back.
        load_retry_interval_s: first pause between such retries (doubles, capped at 1 s).
        upstream_timeout_s: deadline of one forwarded completion, re-sends included (504 after it). A replica that
            stops answering is caught sooner by the health checks (`health_timeout_s`), and its completions are re-sent.
        control_timeout_s: timeout of one control call (load, unload, pause, resume, info).
        max_body_bytes: larger request bodies are refused with 413.
        body_read_timeout_s: a client that has not sent its whole body within this gets 408 (slow-body clients
            cannot hold handlers open).
        hash_off_loop_tokens: prompts longer than this are hashed in a worker thread, so one huge prompt does not
            stall every other request on the event loop.
        unload_drain_timeout_s: an unloaded adapter stops receiving new completions at once, but each replica
            unloads it only when its completions using it have finished, or after this many seconds. While it
            drains it still takes one of the replica's `max_loras` slots, and a load that needs the slot waits
            (at most this long) for the drain.
        max_reroutes: how many other replicas a completion is retried on when its replica drops the connection, or
            hedged on when it is stuck (`per_try`).
        per_try: per-try deadlines: a completion that has not answered within a deadline derived from recent
            completion latencies is also sent to another replica, the first answer wins (`per_try.PerTryConfig`).
        admin_api_key_env: environment variable holding the key that changes the router's membership (`POST` and
            `DELETE /router/replicas`, `Authorization: Bearer <admin key>`). Separate from the client key and the
            upstream token. With no admin key, membership changes are allowed only on a loopback router (with the
            client key, if one is set); otherwise they are refused with 403.
        admin_api_key_file: file holding that key (first line); used when set, instead of the variable.
        remove_drain_timeout_s: a replica removed from the membership gets no new completions at once; those still
            running there may finish for this long, then they are re-sent to other replicas.
        tenancy: several training runs share the replicas (`tenancy.TenancyConfig`): each registers through
            `POST /router/runs` (admin key) and gets its own token, adapter namespace, share of adapter slots and fair
            share of completions. It needs an admin key and replaces the single client key. None: one client.
        log_level: logging level name for the `python -m` entry point.
        state_file: where the router keeps the live adapters and its pause state (`router.state_file`),
            so that a router restarted after a crash takes them back instead of guessing them from the replicas.
            None: nothing kept (a router that is never restarted).
    """

    replicas: list[str] = setting(list, flag="replica", required=True)
    host: str = "127.0.0.1"
    port: int = setting(8000, check=Range(0, high=65535))
    api_key_env: str = "VLLM_API_KEY"
    api_key_file: str | None = None
    routing_policy: str = setting(DEFAULT_POLICY, help=(
        f"how completions are spread over the replicas: one of {', '.join(POLICIES)}"))
    routing: RoutingConfig = setting(RoutingConfig)
    health_interval_s: float = setting(1.0, flag="health-interval", check=POSITIVE)
    health_timeout_s: float = setting(5.0, flag="health-timeout", check=POSITIVE)
    load_retry_deadline_s: float = setting(30.0, flag="load-retry-deadline", check=POSITIVE)
    load_retry_interval_s: float = setting(0.05, flag="load-retry-interval", check=POSITIVE)
    upstream_timeout_s: float = setting(600.0, flag="upstream-timeout", check=POSITIVE)
    control_timeout_s: float = setting(1800.0, flag="control-timeout", check=POSITIVE)
    max_body_bytes: int = setting(8 * 1024 * 1024, check=Range(1024))
    body_read_timeout_s: float = setting(60.0, flag="body-read-timeout", check=POSITIVE)
    hash_off_loop_tokens: int = setting(4096, check=Range(0))
    unload_drain_timeout_s: float = setting(120.0, flag="unload-drain-timeout", check=POSITIVE)
    max_reroutes: int = setting(2, check=Range(0))
    client_api_key_env: str | None = None
    client_api_key_file: str | None = None
    insecure: bool = False
    adapter_roots: list[str] = setting(list, flag="adapter-root")
    per_try: PerTryConfig = setting(PerTryConfig, prefix="per-try-", flags={
        "enabled": "hedge", "floor_s": "per-try-floor", "cap_s": "per-try-cap", "initial_s": "per-try-initial"})
    admin_api_key_env: str | None = None
    admin_api_key_file: str | None = None
    remove_drain_timeout_s: float = setting(30.0, flag="remove-drain-timeout", check=Range(0))
    tenancy: TenancyConfig | None = setting(None, switch="tenancy", flags={
        "lease_s": "run-lease", "allow_base_model": "base-model"})
    log_level: str = "INFO"
    state_file: str | None = None

    def __post_init__(self):
        if not self.replicas:
            raise ValueError("RouterConfig needs at least one replica URL")
        cleaned = [replica_url(url) for url in self.replicas]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"duplicate replica URLs in {cleaned}")
        self.replicas = cleaned
        check_policy_name(self.routing_policy)
        check_fields(self)
        self.adapter_roots = [normalize_root(root) for root in self.adapter_roots]
        if self.tenancy is not None:
            if not self.admin_api_key_env and not self.admin_api_key_file:
                raise ValueError("tenancy needs an admin key (admin_api_key_env or admin_api_key_file): it is what "
                                 "registers runs and hands out their tokens")
            if self.client_api_key_env or self.client_api_key_file:
                raise ValueError("tenancy gives each run a key of its own: leave the client key unset")
        if not is_loopback(self.host) and not self.insecure:
            missing = []
            if not self.client_api_key_env and not self.client_api_key_file and self.tenancy is None:
                missing.append("client authentication (--client-api-key-env or --client-api-key-file)")
            if not self.adapter_roots:
                missing.append("adapter storage roots (--adapter-root, repeatable)")
            if missing:
                raise ValueError(
                    f"refusing to listen on {self.host!r} (not loopback) without {' and '.join(missing)}: anyone who "
                    "reaches the port could load adapters from any path and pause the replicas. Set them, or pass "
                    "--insecure on a network you trust.")

    def read_api_key(self) -> str | None:
        """The upstream bearer token, or None. Kept out of the dataclass so it never shows in a repr or a log."""
        return read_secret(self.api_key_file, self.api_key_env, "api_key_file")

    def read_client_api_key(self) -> str | None:
        """The key clients must present, or None; an authentication that was asked for but is empty is an error."""
        return read_secret(self.client_api_key_file, self.client_api_key_env, "client_api_key_file",
                           asked="client authentication is on")

    def read_admin_api_key(self) -> str | None:
        """The key that may change the membership, or None; asked for but empty is an error, as for the client key."""
        return read_secret(self.admin_api_key_file, self.admin_api_key_env, "admin_api_key_file",
                           asked="an admin key is asked for")


def replica_url(url) -> str:
    """A replica's base URL as the router keys it (http or https, a host, no credentials, query or fragment, no
    trailing slash); ValueError otherwise. Credentials never ride in a URL: the upstream token is `api_key_env`."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError:
        raise ValueError(f"replica URL {url!r} is not a valid URL") from None
    if not parts.hostname or "@" in parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"replica URL must be http(s)://host[:port][/path] without credentials, query or fragment, "
                         f"got {url!r}")
    return url.rstrip("/")


def read_secret(path: str | None, env: str | None, what: str, asked: str = "") -> str | None:
    """A secret from the first line of `path` if given, else from the environment variable `env`; ValueError naming
    `what` when the file cannot be read or is empty (never the secret itself), or saying what `asked` for it when
    the variable `env` is named but unset or empty."""
    if path:
        try:
            with open(path) as f:
                token = f.readline().strip()
        except OSError as error:
            raise ValueError(f"cannot read {what} {path}: {error.strerror}") from None
        if not token:
            raise ValueError(f"{what} {path} is empty")
        return token
    key = environment.bearer_key(env)
    if key is None and asked and env:
        raise ValueError(f"{asked} but the variable {env} is unset or empty")
    return key


def is_loopback(host: str) -> bool:
    """True for localhost and the loopback ranges (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _normalized(path: str) -> str | None:
    """`path` with its scheme kept and the rest normalised; None for a relative local path."""
    scheme, sep, rest = path.partition("://")
    if sep:
        return f"{scheme}://{posixpath.normpath(rest) if rest else ''}"
    return os.path.normpath(path) if os.path.isabs(path) else None


def normalize_root(root: str) -> str:
    """A storage root in the form `adapter_path_error` compares against: scheme kept, path normalised."""
    if not isinstance(root, str) or not root.strip():
        raise ValueError(f"an adapter root must be a non-empty path or URL, got {root!r}")
    normal = _normalized(root)
    if normal is None:
        raise ValueError(f"adapter root {root!r} must be an absolute path (the replicas resolve lora_path themselves)")
    return normal


def adapter_path_error(path: str, roots: list[str]) -> str | None:
    """Why `path` may not be loaded (outside every root, or relative, or with '..'), or None when it may.

    The check is on the path as written (the router may not see the replicas' storage); a path that exists here is
    also checked after resolving symlinks."""
    if not roots:
        return None
    _, sep, rest = path.partition("://")
    if ".." in (rest if sep else path).replace("\\", "/").split("/"):
        return f"lora_path {path!r} contains '..'"
    candidate = _normalized(path)
    if candidate is None:
        return f"lora_path {path!r} is relative; give an absolute path under {', '.join(roots)}"
    real = os.path.realpath(candidate) if not sep and os.path.exists(candidate) else candidate
    for root in roots:
        if all(_under(p, root) for p in (candidate, real)):
            return None
    return f"lora_path {path!r} is outside the router's adapter roots ({', '.join(roots)})"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
