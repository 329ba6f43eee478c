"""All-or-nothing LoRA adapter loads across replicas, and broadcast of the other control calls.

TRL loads each new policy once and then names it in every rollout, so a load the router reports as done must be done
on every replica in service, or on none: "No adapter found" (storage lag) is retried until a deadline, a replica that
cannot be reached leaves routing, any other failure or a cancel rolls the load back (docs/serving.md, "Loads adapters
all-or-nothing"); a replica whose rollback fails is reported (`on_stale`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..wire.upstream import TRANSPORT_ERRORS, Replica, UpstreamClient, now

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
    uncertain: bool = False  # the call broke off: the replica may or may not have loaded the adapter
    left_loaded: bool = False  # its rollback unload failed: the replica may still serve the adapter
    no_adapter: bool = False  # still "No adapter found" when the retry deadline passed
    elapsed_s: float = 0.0


async def _path_loaded_as(client: UpstreamClient, replica: Replica, name: str, timeout: float) -> str | None:
    """The path `replica` reports for adapter `name` in `/v1/models` (vLLM puts it in `root`)."""
    reply = await client.call(replica, "GET", "/v1/models", timeout=timeout)
    return next((e.get("root") for e in (reply.json() or {}).get("data", []) if e.get("id") == name), None)


async def load_one(client: UpstreamClient, replica: Replica, name: str, path: str, *, deadline_s: float,
                   interval_s: float, timeout_s: float) -> Outcome:
    body = {"lora_name": name, "lora_path": path, "load_inplace": False}
    began = now()
    give_up, pause, retries = began + deadline_s, interval_s, 0
    while True:
        try:
            reply = await client.call(replica, "POST", "/v1/load_lora_adapter", json_body=body, timeout=timeout_s)
        except TRANSPORT_ERRORS as error:
            return _unreachable(replica, error, retries)
        text = client.scrub(reply.text())
        if reply.status == 200:
            return Outcome(replica, True, 200, text, newly_loaded=True, retries=retries)
        if reply.status == 400 and ALREADY_MARK in text:
            try:
                loaded = await _path_loaded_as(client, replica, name, timeout_s)
            except TRANSPORT_ERRORS as error:
                return _unreachable(replica, error, retries)
            if loaded is not None and loaded.rstrip("/") == path.rstrip("/"):
                return Outcome(replica, True, 200, text, retries=retries)
            return Outcome(replica, False, 400, f"{text} (loaded there from {loaded!r}, not {path!r})",
                           retries=retries)
        if reply.status == 404 and NO_ADAPTER_MARK in text:
            left = give_up - now()
            if left > 0:
                retries += 1
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 1.0)
                continue
            return Outcome(replica, False, reply.status, text, retries=retries, no_adapter=True,
                           elapsed_s=now() - began)
        return Outcome(replica, False, reply.status, text, retries=retries)


async def unload_one(client: UpstreamClient, replica: Replica, name: str, timeout_s: float) -> Outcome:
    """Unload `name`; a replica that does not have it (404) counts as done, as in TRL's own client."""
    replica.begin_transition(name)
    try:
        reply = await client.call(replica, "POST", "/v1/unload_lora_adapter", json_body={"lora_name": name},
                                  timeout=timeout_s)
        ok = reply.status in (200, 404)
        if ok:
            replica.adapters.pop(name, None)  # before the transition ends, so no adapter check sees it half done
        return Outcome(replica, ok, reply.status, client.scrub(reply.text()))
    except TRANSPORT_ERRORS as error:
        return _unreachable(replica, error)
    finally:
        replica.end_transition(name)


OnStale = Callable[[Replica, str], None]


def _unreachable(replica: Replica, error: BaseException, retries: int = 0) -> Outcome:
    return Outcome(replica, False, 502, f"{type(error).__name__}: {error}", retries=retries, transport_error=True)


async def load_everywhere(client: UpstreamClient, replicas: list[Replica], name: str, path: str, *,
                          deadline_s: float, interval_s: float, timeout_s: float,
                          on_stale: OnStale | None = None) -> tuple[bool, list[Outcome]]:
    """Load on every replica or on none. Returns (success, per-replica outcomes).

    `on_stale(replica, reason)` is called for each replica whose rollback failed, also when this is cancelled.
    The name stays "in transition" on every target until the load is committed or rolled back, so an adapter check
    of a replica never mistakes a half-done load for a stray adapter."""
    for replica in replicas:
        replica.begin_transition(name)
    try:
        epochs = [r.epoch for r in replicas]
        tasks = [asyncio.ensure_future(load_one(client, r, name, path, deadline_s=deadline_s, interval_s=interval_s,
                                                timeout_s=timeout_s)) for r in replicas]
        try:
            if tasks:
                await asyncio.wait(tasks)
        except BaseException:  # cancelled: stop the loads, then undo whatever they may have done, even if cancelled
            await asyncio.shield(_abandon(client, tasks, replicas, name, timeout_s, on_stale))
            raise
        outcomes = [_settled(client, task, replica) for task, replica in zip(tasks, replicas)]
        failed = [o for o in outcomes if not o.ok]
        if failed and len(failed) < len(outcomes) and all(o.transport_error for o in failed):
            # only replicas that cannot be reached failed (died mid-load): they leave routing (the caller marks them
            # down) and get the live set, this adapter included, when they are re-admitted; every replica left in
            # service holds it, so the load stands instead of failing the whole run
            failed = []
        if not failed:
            for o, epoch in zip(outcomes, epochs):
                if o.ok and o.replica.epoch == epoch:  # re-admitted meanwhile: its admission decided what it holds
                    o.replica.adapters[name] = path
            return True, outcomes
        await asyncio.shield(_roll_back(client, outcomes, name, timeout_s, on_stale))  # a cancel must not cut it
        for o in outcomes:
            if o.ok and not o.newly_loaded:
                o.replica.adapters[name] = path  # it was there before this call and stays
        return False, outcomes
    finally:
        for replica in replicas:
            replica.end_transition(name)


def _settled(client: UpstreamClient, task: asyncio.Future, replica: Replica) -> Outcome:
    """A finished load task as an outcome; one that raised or was cancelled may have loaded the adapter or not."""
    if task.cancelled():
        return Outcome(replica, False, 503, "load interrupted", uncertain=True)
    error = task.exception()
    if error is None:
        return task.result()
    log.error("loading on %s raised %s", replica.url, client.scrub(f"{type(error).__name__}: {error}"))
    return Outcome(replica, False, 502, client.scrub(f"{type(error).__name__}: {error}"), uncertain=True,
                   transport_error=isinstance(error, TRANSPORT_ERRORS))


async def _abandon(client: UpstreamClient, tasks: list[asyncio.Future], replicas: list[Replica], name: str,
                   timeout_s: float, on_stale: OnStale | None) -> None:
    """Cancel the loads still running, then roll back every replica that took the load or may have."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await _roll_back(client, [_settled(client, t, r) for t, r in zip(tasks, replicas)], name, timeout_s, on_stale)


async def _roll_back(client: UpstreamClient, outcomes: list[Outcome], name: str, timeout_s: float,
                     on_stale: OnStale | None) -> None:
    """Unload `name` where this call loaded it or may have; flag (and report) each replica where that fails."""
    taken = [o for o in outcomes if (o.ok and o.newly_loaded) or o.uncertain]
    if not taken:
        return
    log.warning("adapter %s failed on some replica; rolling back on %d replica(s)", name, len(taken))
    undone = await asyncio.gather(*(unload_one(client, o.replica, name, timeout_s) for o in taken),
                                  return_exceptions=True)
    for o, u in zip(taken, undone):
        if isinstance(u, Outcome) and u.ok:
            continue
        why = f"{u.status} {u.message}" if isinstance(u, Outcome) else client.scrub(f"{type(u).__name__}: {u}")
        o.left_loaded = True
        log.error("rollback of %s on %s failed: %s", name, o.replica.url, why)
        if on_stale is not None:
            on_stale(o.replica, f"rollback unload of adapter {name} failed ({why}); it may still hold it")


async def broadcast(client: UpstreamClient, replicas: list[Replica], method: str, path: str, *, timeout_s: float,
                    params=None, json_body=None) -> list[Outcome]:
    """Send one control call to every replica at once; 200 is success."""

    async def one(replica: Replica) -> Outcome:
        try:
            reply = await client.call(replica, method, path, params=params, json_body=json_body, timeout=timeout_s)
        except TRANSPORT_ERRORS as error:
            return _unreachable(replica, error)
        return Outcome(replica, reply.status == 200, reply.status, client.scrub(reply.text()))

    return list(await asyncio.gather(*(one(r) for r in replicas)))
