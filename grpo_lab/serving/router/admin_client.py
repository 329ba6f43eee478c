"""A router's admin calls from another process: membership over `/router/replicas` (`admin_api`), runs sharing its
replicas over `/router/runs` (`tenant_api`), with the methods of `thread.RouterHandle` a launcher uses, so a router
in this process or elsewhere is driven alike. The admin key comes from a variable or a file, never an argument.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request

from ..adapters.slots import DEFAULT_MAX_STALENESS
from .config import read_secret


class RouterAdminError(RuntimeError):
    """The router refused an admin call; `status` is its HTTP status, the message its own words."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RouterAdminClient:
    """`RouterAdminClient("http://router:8000", key_env="GRPO_ROUTER_ADMIN_KEY")`."""

    def __init__(self, url: str, key_env: str | None = None, key_file: str | None = None, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        key = read_secret(key_file, key_env, "admin key file")  # the file wins over the variable
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _call(self, method: str, body: dict | None, timeout_s: float, path: str = "/router/replicas"
              ) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return answer.status, json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as error:
            text = error.read().decode("utf-8", "replace")
            if error.code == 404 and method == "DELETE":
                return 404, {}
            with contextlib.suppress(ValueError, KeyError, TypeError):
                text = json.loads(text)["error"]["message"]
            raise RouterAdminError(f"{method} {self.url}{path} answered {error.code}: {str(text)[:500]}",
                                   error.code) from None

    def add_replica(self, url: str, wait_s: float = 0.0) -> dict:
        return self._call("POST", {"url": url, "wait_s": wait_s}, self.timeout_s + wait_s)[1]

    def remove_replica(self, url: str, drain_s: float | None = None) -> dict | None:
        body = {"url": url} if drain_s is None else {"url": url, "drain_s": drain_s}
        status, answer = self._call("DELETE", body, self.timeout_s + (drain_s or 0.0))
        return None if status == 404 else answer

    def replicas(self) -> list[dict]:
        return self._call("GET", None, self.timeout_s)[1]["replicas"]

    def register_run(self, name: str, max_staleness: int = DEFAULT_MAX_STALENESS, weight: float = 1.0, replace: bool = False) -> dict:
        """Register a training run on a router with tenancy: its description and its `token` (shown this once)."""
        body = {"name": name, "max_staleness": max_staleness, "weight": weight, "replace": replace}
        return self._call("POST", body, self.timeout_s, "/router/runs")[1]

    def remove_run(self, name: str) -> dict | None:
        """Remove a run (its adapters are unloaded after their drain); None when the router has no such run."""
        status, answer = self._call("DELETE", None, self.timeout_s, "/router/runs/" + urllib.parse.quote(name))
        return None if status == 404 else answer

    def runs(self) -> dict:
        """The registered runs (never their tokens), the pool's adapter slots and how many are taken."""
        return self._call("GET", None, self.timeout_s, "/router/runs")[1]
