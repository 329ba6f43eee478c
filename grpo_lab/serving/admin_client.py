"""Membership changes of a router in another process, over `POST`/`DELETE /router/replicas` (`admin_api`).

It has the methods of `router_thread.RouterHandle` that a launcher uses (`add_replica`, `remove_replica`,
`replicas`), so `ray_replicas` drives a router in this process or one elsewhere alike. The admin key is read from an
environment variable or a file, never passed as an argument, and sent only in the Authorization header.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request


class RouterAdminClient:
    """`RouterAdminClient("http://router:8000", key_env="GRPO_ROUTER_ADMIN_KEY")`."""

    def __init__(self, url: str, key_env: str | None = None, key_file: str | None = None, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        key = None
        if key_file:
            with open(key_file) as f:
                key = f.readline().strip() or None
        elif key_env:
            key = os.environ.get(key_env, "").strip() or None
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"

    def __repr__(self) -> str:
        return f"RouterAdminClient({self.url!r})"

    def _call(self, method: str, body: dict | None, timeout_s: float) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + "/router/replicas", data=data, method=method,
                                         headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return answer.status, json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as error:
            text = error.read().decode("utf-8", "replace")
            if error.code == 404 and method == "DELETE":
                return 404, {}
            raise RuntimeError(f"{method} {self.url}/router/replicas answered {error.code}: {text[:300]}") from None

    def add_replica(self, url: str, wait_s: float = 0.0) -> dict:
        return self._call("POST", {"url": url, "wait_s": wait_s}, self.timeout_s + wait_s)[1]

    def remove_replica(self, url: str, drain_s: float | None = None) -> dict | None:
        body = {"url": url} if drain_s is None else {"url": url, "drain_s": drain_s}
        status, answer = self._call("DELETE", body, self.timeout_s + (drain_s or 0.0))
        return None if status == 404 else answer

    def replicas(self) -> list[dict]:
        return self._call("GET", None, self.timeout_s)[1]["replicas"]
