"""Configuration of the prefix-aware router (the proxy TRL's AsyncGRPOTrainer talks to as one vLLM server)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .routing_policy import RoutingConfig


@dataclass
class RouterConfig:
    """Where the router listens, which replicas it fronts, and how it treats them.

    Args:
        replicas: base URLs of the upstream vLLM (or CPU) replicas, e.g. `["http://127.0.0.1:8001", ...]`.
        host: interface to listen on; loopback by default, the proxy has no authentication of its own.
        port: port to listen on; 0 picks a free one (read it back from the handle).
        api_key_env: environment variable holding the bearer token added to every upstream call.
        api_key_file: file holding the token (first line); used when set, instead of the variable.
        routing: the prefix-affinity policy's parameters; `block_size` is replaced by the replicas'
            `cache_config.block_size` when they report one.
        health_interval_s: seconds between background `/health` checks of each replica.
        health_timeout_s: timeout of one check; a replica failing it leaves routing.
        load_retry_deadline_s: how long an adapter load keeps retrying a replica that answers "No adapter found"
            (shared storage not visible there yet) before the whole load is rolled back.
        load_retry_interval_s: first pause between such retries (doubles, capped at 1 s).
        upstream_timeout_s: total timeout of one forwarded completion.
        control_timeout_s: timeout of one control call (load, unload, pause, resume, info).
        max_body_bytes: larger request bodies are refused with 413.
        max_reroutes: how many other replicas a completion is retried on when its replica drops the connection.
        log_level: logging level name for the `python -m` entry point.
    """

    replicas: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_env: str = "VLLM_API_KEY"
    api_key_file: str | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    load_retry_deadline_s: float = 30.0
    load_retry_interval_s: float = 0.05
    upstream_timeout_s: float = 600.0
    control_timeout_s: float = 1800.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_reroutes: int = 2
    log_level: str = "INFO"

    def __post_init__(self):
        if not self.replicas:
            raise ValueError("RouterConfig needs at least one replica URL")
        cleaned = []
        for url in self.replicas:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"duplicate replica URLs in {cleaned}")
        self.replicas = cleaned
        for name in ("health_interval_s", "health_timeout_s", "load_retry_deadline_s", "upstream_timeout_s",
                     "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")

    def read_api_key(self) -> str | None:
        """The upstream bearer token, or None. Kept out of the dataclass so it never shows in a repr or a log."""
        if self.api_key_file:
            with open(self.api_key_file) as f:
                token = f.readline().strip()
            if not token:
                raise ValueError(f"api_key_file {self.api_key_file} is empty")
            return token
        token = os.environ.get(self.api_key_env, "").strip()
        return token or None
