"""All-or-nothing LoRA adapter loads across replicas, and broadcast of the other control calls.

TRL loads each new policy once (`POST /v1/load_lora_adapter`) and then names it in every rollout, so a load the
router reports as done must be done on every replica in service, or on none. A replica that answers "No adapter
found" usually just cannot see the new directory yet (shared storage lag) and is retried until a deadline; any
other failure rolls the load back on the replicas that took it, and the caller gets the upstream's error. An
already-loaded name counts as loaded when the replica reports the same path for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from .upstream import TRANSPORT_ERRORS, Replica, UpstreamClient, now

log = logging.getLogger(__name__)

NO_ADAPTER_MARK = "No adapter found"
ALREADY_MARK = "already been loaded"


@dataclass
class Outcome:
    """What one replica did with one control call."""

    replica: Replica
    ok: bool
    status: int
    message: str
    newly_loaded: bool = False
    retries: int = 0
    transport_error: bool = False


async def _path_loaded_as(client: UpstreamClient, replica: Replica, name: str, timeout: float) -> str | None:
    """The path `replica` reports for adapter `name` in `/v1/models` (vLLM puts it in `root`)."""
    reply = await client.call(replica, "GET", "/v1/models", timeout=timeout)
    for entry in (reply.json() or {}).get("data", []):
        if entry.get("id") == name:
            return entry.get("root")
    return None


async def load_one(client: UpstreamClient, replica: Replica, name: str, path: str, *, deadline_s: float,
                   interval_s: float, timeout_s: float) -> Outcome:
    body = {"lora_name": name, "lora_path": path, "load_inplace": False}
    give_up, pause, retries = now() + deadline_s, interval_s, 0
    while True:
        try:
            reply = await client.call(replica, "POST", "/v1/load_lora_adapter", json_body=body, timeout=timeout_s)
        except (*TRANSPORT_ERRORS, asyncio.TimeoutError) as error:
            return Outcome(replica, False, 502, f"{type(error).__name__}: {error}", retries=retries,
                           transport_error=True)
        text = client.scrub(reply.text())
        if reply.status == 200:
            return Outcome(replica, True, 200, text, newly_loaded=True, retries=retries)
        if reply.status == 400 and ALREADY_MARK in text:
            try:
                loaded = await _path_loaded_as(client, replica, name, timeout_s)
            except (*TRANSPORT_ERRORS, asyncio.TimeoutError) as error:
                return Outcome(replica, False, 502, f"{type(error).__name__}: {error}", retries=retries,
                               transport_error=True)
            if loaded is not None and loaded.rstrip("/") == path.rstrip("/"):
                return Outcome(replica, True, 200, text, retries=retries)
            return Outcome(replica, False, 400, f"{text} (loaded there from {loaded!r}, not {path!r})",
                           retries=retries)
        if reply.status == 404 and NO_ADAPTER_MARK in text and now() + pause < give_up:
            retries += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
            continue
        return Outcome(replica, False, reply.status, text, retries=retries)


async def unload_one(client: UpstreamClient, replica: Replica, name: str, timeout_s: float) -> Outcome:
    """Unload `name`; a replica that does not have it (404) counts as done, as in TRL's own client."""
    try:
        reply = await client.call(replica, "POST", "/v1/unload_lora_adapter", json_body={"lora_name": name},
                                  timeout=timeout_s)
    except (*TRANSPORT_ERRORS, asyncio.TimeoutError) as error:
        return Outcome(replica, False, 502, f"{type(error).__name__}: {error}", transport_error=True)
    ok = reply.status in (200, 404)
    return Outcome(replica, ok, reply.status, client.scrub(reply.text()))


async def load_everywhere(client: UpstreamClient, replicas: list[Replica], name: str, path: str, *,
                          deadline_s: float, interval_s: float, timeout_s: float) -> tuple[bool, list[Outcome]]:
    """Load on every replica or on none. Returns (success, per-replica outcomes)."""
    outcomes = await asyncio.gather(*(load_one(client, r, name, path, deadline_s=deadline_s,
                                               interval_s=interval_s, timeout_s=timeout_s) for r in replicas))
    if all(o.ok for o in outcomes):
        for o in outcomes:
            o.replica.adapters[name] = path
        return True, list(outcomes)
    taken = [o.replica for o in outcomes if o.ok and o.newly_loaded]
    if taken:
        log.warning("adapter %s failed on some replica; rolling back on %d replica(s)", name, len(taken))
        undone = await asyncio.gather(*(unload_one(client, r, name, timeout_s) for r in taken))
        for o in undone:
            if not o.ok:
                log.error("rollback of %s on %s failed: %s %s", name, o.replica.url, o.status, o.message)
    for o in outcomes:
        if o.ok and not o.newly_loaded:
            o.replica.adapters[name] = path  # it was there before this call and stays
    return False, list(outcomes)


async def broadcast(client: UpstreamClient, replicas: list[Replica], method: str, path: str, *, timeout_s: float,
                    params=None, json_body=None) -> list[Outcome]:
    """Send one control call to every replica at once; 200 is success."""

    async def one(replica: Replica) -> Outcome:
        try:
            reply = await client.call(replica, method, path, params=params, json_body=json_body, timeout=timeout_s)
        except (*TRANSPORT_ERRORS, asyncio.TimeoutError) as error:
            return Outcome(replica, False, 502, f"{type(error).__name__}: {error}", transport_error=True)
        return Outcome(replica, reply.status == 200, reply.status, client.scrub(reply.text()))

    return list(await asyncio.gather(*(one(r) for r in replicas)))
