"""TRL's `VLLMClient` with a timeout on every call and errors that say which call failed where.

TRL's client waits up to 1800 s (or forever, for `/v1/models` and `/server_info`), so a hung router hangs the
trainer, and its errors read "Request failed: 500, ...". A run on a shared pool sends its token with every call.
"""

from __future__ import annotations

import time

import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .pool import run_get, run_headers


class ControlCallError(RuntimeError):
    """A control call to the rollout server failed; the message names the call, the URL and the answer."""


class BoundedVLLMClient(VLLMClient):
    def __init__(self, server_url: str, server_timeout: float = 240.0, control_timeout_s: float = 600.0):
        super().__init__(server_url, server_timeout)
        self.control_timeout_s = control_timeout_s

    def _call(self, method: str, path: str, *, ok=(200,), **kwargs) -> requests.Response:
        """One control call; a connection error or a 503 (the router restarting on its port, then admitting its
        replicas) is retried with back-off within `control_timeout_s`. A call cut off mid-way may have taken
        effect: each caller below says why doing it again is safe (a 503 comes before anything was done)."""
        url = f"{self.server_url}{path}"
        give_up, pause = time.monotonic() + self.control_timeout_s, 0.2
        self.retried = False
        while True:
            try:
                response = requests.request(method, url, timeout=self.control_timeout_s, headers=run_headers(),
                                            **kwargs)
            except requests.Timeout as error:
                raise ControlCallError(f"{method} {url} did not answer within {self.control_timeout_s:.0f}s "
                                       "(control_timeout_s)") from error
            except requests.ConnectionError as error:
                if time.monotonic() + pause > give_up:
                    raise ControlCallError(f"{method} {url} failed: cannot connect ({error.__class__.__name__}) "
                                           f"for {self.control_timeout_s:.0f}s; is the router (or vLLM server) "
                                           "running?") from error
            else:
                if response.status_code != 503 or time.monotonic() + pause > give_up:
                    break
            self.retried = True
            time.sleep(pause)
            pause = min(pause * 2, 2.0)
        if response.status_code not in ok:
            raise ControlCallError(f"{method} {url} answered {response.status_code}: {response.text[:500]}")
        return response

    def get_max_model_len(self) -> int:
        return self._call("GET", "/v1/models").json()["data"][0]["max_model_len"]

    def get_dtype(self) -> str:
        return self.get_server_info()["model_config"]["dtype"]

    def get_server_info(self) -> dict:
        return self._call("GET", "/server_info", params={"config_format": "json"}).json()["vllm_config"]

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: int | None = None) -> None:
        """A load retried after a lost connection may find the name loaded by the first try: loaded from this very
        path, that is the load done (a new router restored it from its state file)."""
        try:
            self._call("POST", "/v1/load_lora_adapter",
                       json={"lora_name": lora_name, "lora_path": lora_path, "load_inplace": False})
        except ControlCallError:
            if not self.retried or self.loaded_adapters().get(lora_name, "").rstrip("/") != lora_path.rstrip("/"):
                raise

    def unload_lora_adapter(self, lora_name: str, timeout: int | None = None) -> None:
        """A name the server does not hold (404) is not an error, as in TRL."""
        self._call("POST", "/v1/unload_lora_adapter", ok=(200, 404), json={"lora_name": lora_name})

    def pause(self, timeout: int | None = None) -> None:
        self._call("POST", "/pause", params={"mode": "keep"})

    def resume(self, timeout: int | None = None) -> None:
        self._call("POST", "/resume")

    def loaded_adapters(self) -> dict[str, str | None]:
        """Adapters the server holds now (`/v1/models` entries with a parent), name -> path."""
        entries = self._call("GET", "/v1/models").json().get("data", [])
        return {e["id"]: e.get("root") for e in entries if isinstance(e, dict) and e.get("parent")}

    def draining_adapters(self) -> set[str] | None:
        """Adapters the grpo_lab router is still draining (unloaded, completions in flight); None from a server that
        does not say (plain vLLM unloads at once)."""
        state = run_get(self.server_url, "/router/state", min(self.control_timeout_s, 10))
        return set(state.get("draining", {})) if state is not None else None
