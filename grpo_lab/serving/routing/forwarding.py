"""Forwarding one completion: pick a replica, send it, re-send it elsewhere when that replica fails, hedge it when it
is stuck (docs/serving.md: "Re-sends" and "Hedges").

A completion has no side effects and TRL seeds each one, so sending it again gives the same answer. Tries and hedges
together reach at most `max_reroutes + 1` replicas, each at most once, within `upstream_timeout_s`. A try that fails
with a 5xx while another try still runs does not end the race; a 200 or a 4xx does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

from ..wire.completion_batches import completion_json
from .per_try import PerTryDeadlines
from .policy import Decision
from ..wire.upstream import TRANSPORT_ERRORS, Replica, Reply, error_body, now

UPSTREAM_LATENCY_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
PAUSED_RECHECK_S = 0.25  # a due hedge waits while the replicas are paused (a pause holds every completion)


def failure(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> Reply:
    return Reply(status, json.dumps(error_body(message, status, kind, param)).encode(), "application/json")


@dataclass
class _Outcome:
    """What one try came to: `done` (an answer to give the client), `retry` (send it elsewhere) or `timeout` (the
    whole deadline passed)."""

    kind: str
    reply: Reply | None = None
    answer: dict | None = None
    reason: str = ""
    problem: str = ""
    elapsed_s: float = 0.0


@dataclass
class _Try:
    replica: Replica
    decision: Decision
    started: float
    hedge: bool
    run: str | None = None  # the tenant run it is for (`tenant_api`), None without tenancy
    hedge_blocked: bool = False  # no hedge can follow this try (no other replica, or no sends left)
    not_before: float = 0.0  # a due hedge put off (paused replicas, hedge budget spent) until then
    over_budget: bool = False  # its hedge was put off for the budget (counted once)


class Forwarder:
    """The completion path of a `Router`: `forward()` per prompt. One event loop."""

    def __init__(self, pool, client, usage, metrics, config):
        self.pool, self.client, self.usage, self.metrics, self.config = pool, client, usage, metrics, config
        self.deadlines = PerTryDeadlines(config.per_try)
        self.hedges_in_flight = 0
        self.overhead_s: list[float] = []  # router-side time per completion (parse, route, bookkeeping), last 10k
        self.run_routing: dict[str, dict[str, int]] = {}  # tenant run -> routing decisions of its completions
        self.run_in_flight: Counter[tuple[str, int]] = Counter()  # (tenant run, replica number) -> tries there
        # with tenancy, the fair queue's places per replica: a completion it let through goes to a replica with room
        # (prefix affinity among those), or affinity could pile every place onto one replica and idle the others
        self.per_replica_cap: int | None = None
        self._losers: set[asyncio.Task] = set()

    # -- helpers ---------------------------------------------------------------------------------------------------
    async def hashes(self, prompt, model: str) -> list[int]:
        """The prompt's block hashes; none for text (no tokenizer here) or a prompt the replicas will refuse as too
        long (they answer that, as vLLM would); a long prompt is hashed off the event loop."""
        if not isinstance(prompt, list):
            return []
        policy, limit = self.pool.policy, self.pool.max_model_len
        if limit is not None and len(prompt) > limit:
            return []
        if len(prompt) > self.config.hash_off_loop_tokens:
            return await asyncio.get_running_loop().run_in_executor(None, policy.hashes_for, prompt, model)
        return policy.hashes_for(prompt, model)

    def _skip_hedge(self, reason: str) -> None:
        self.metrics.inc("grpo_router_hedges_skipped_total", "Hedges put off or not sent, by reason", reason=reason)

    # -- one try -----------------------------------------------------------------------------------------------
    async def _attempt(self, t: _Try, model: str, raw: bytes, timeout: float) -> _Outcome:
        """Send the completion to `t.replica` and classify the answer. Cancelling this task (the race was lost, or
        the client went away) cancels the upstream call, which drops its connection."""
        replica, decision, policy = t.replica, t.decision, self.pool.policy
        run_key = (t.run, replica.index)
        self.usage.begin(replica.index, model)
        replica.tries += 1
        if t.run is not None:
            self.run_in_flight[run_key] += 1
        call = asyncio.ensure_future(self.client.call(replica, "POST", "/v1/completions", data=raw, timeout=timeout))
        replica.calls.add(call)
        t_up = time.perf_counter()
        probe = False
        try:
            try:
                reply = await call
            except BaseException as error:
                policy.finish(decision, ok=False)
                if isinstance(error, asyncio.CancelledError) and not asyncio.current_task().cancelling():
                    return _Outcome("retry", reason="replica_down",  # cut: it left routing while the try ran
                                    problem=f"{replica.url} stopped answering ({replica.last_error})")
                if isinstance(error, TimeoutError):
                    return _Outcome("timeout")
                if not isinstance(error, TRANSPORT_ERRORS):
                    raise  # this try lost the race, the client went away, or a bug
                probe = True
                outcome = _Outcome("retry", reason="transport", problem=f"{replica.url}: {type(error).__name__}",
                                   elapsed_s=time.perf_counter() - t_up)
        finally:
            replica.calls.discard(call)
            self.usage.end(replica.index, model)
            replica.tries -= 1
            if t.run is not None:
                self.run_in_flight[run_key] -= 1
                if not self.run_in_flight[run_key]:
                    del self.run_in_flight[run_key]
        if probe:  # a dropped keep-alive connection is not a dead replica: out only if it fails a probe too
            if not await self.client.healthy(replica, min(1.0, self.config.health_timeout_s)):
                self.pool.mark_down(replica, f"completion failed: {outcome.problem.split(': ', 1)[-1]}")
            return outcome
        elapsed = time.perf_counter() - t_up
        self.metrics.observe("grpo_router_upstream_latency_seconds", "Upstream completion latency", elapsed,
                             UPSTREAM_LATENCY_BUCKETS, replica=replica.url)
        answer = completion_json(reply) if reply.status == 200 else None
        if reply.status == 200 and answer is None:
            policy.finish(decision, ok=False)
            self.metrics.inc("grpo_router_malformed_answers_total", "200 answers that were not a completion",
                             replica=replica.url)
            self.pool.mark_down(replica, "answered a completion with 200 and a body that is not completion JSON")
            return _Outcome("retry", reason="malformed",
                            problem=f"{replica.url} answered 200 with a body that is not completion JSON")
        policy.finish(decision, ok=reply.status == 200)
        if reply.status == 404 and model in self.pool.live_adapters and model in replica.adapters:
            self.pool.mark_down(replica, f"lost adapter {model} (restarted?)")  # send elsewhere
            return _Outcome("retry", reason="lost_adapter", problem=f"{replica.url} no longer holds {model}")
        return _Outcome("done", reply, answer, elapsed_s=elapsed)

    # -- the race ------------------------------------------------------------------------------------------------
    def _hedge_at(self, t: _Try, max_tokens) -> float | None:
        """When a hedge of try `t` is due (monotonic), or None when none can follow it."""
        if t.hedge_blocked or not self.config.per_try.enabled:
            return None
        return max(max(t.started, self.pool.resumed_at) + self.deadlines.deadline_s(max_tokens), t.not_before)

    def _hedge_allowed(self) -> bool:
        in_flight = sum(self.pool.policy.in_flight)
        return self.hedges_in_flight < max(2, int(self.config.per_try.budget * in_flight))

    async def forward(self, model: str, prompt, raw: bytes, deadline: float, t_start: float,
                      max_tokens=None, run: str | None = None) -> tuple[Reply, dict | None]:
        """Send one completion to the best replica; re-send or hedge it as the module docstring says. Returns
        (reply, parsed answer when 200). `run` (a tenant run's name) labels its routing metrics."""
        pool, policy = self.pool, self.pool.policy
        try:
            hashes = await self.hashes(prompt, model)
        except ValueError as error:
            return failure(400, f"'prompt': {error}", param="prompt"), None
        tried: set[int] = set()
        running: dict[asyncio.Task, _Try] = {}
        hedged = False
        waited_s = 0.0
        last_problem = ""
        fallback: tuple[_Try, _Outcome] | None = None  # a 5xx answer kept while another try may still succeed

        def launch(hedge: bool) -> bool:
            nonlocal hedged
            if len(tried) > self.config.max_reroutes:
                return False
            candidates = [r for r in pool.candidates(model) if r.index not in tried]
            if self.per_replica_cap is not None:
                roomy = [r for r in candidates if policy.in_flight[r.index] < self.per_replica_cap]
                candidates = roomy or candidates
            remaining = deadline - now()
            if not candidates or remaining <= 0:
                return False
            decision = policy.route(hashes, [r.index for r in candidates])
            replica = pool.by_index(decision.replica)
            tried.add(replica.index)
            labels = {"run": run} if run is not None else {}
            self.metrics.inc("grpo_router_routed_total", "Completions routed, by replica and decision",
                             replica=replica.url, decision=decision.kind, **labels)
            if run is not None:
                counts = self.run_routing.setdefault(run, {"affinity": 0, "spilled": 0, "unmatched": 0})
                counts[decision.kind] = counts.get(decision.kind, 0) + 1
            t = _Try(replica, decision, now(), hedge, run)
            task = asyncio.create_task(self._attempt(t, model, raw, remaining))
            running[task] = t
            if hedge:
                hedged = True
                self.hedges_in_flight += 1
                task.add_done_callback(self._hedge_done)
            return True

        launch(hedge=False)
        try:
            while running:
                newest = max(running.values(), key=lambda t: t.started)
                hedge_at = self._hedge_at(newest, max_tokens)
                wake = deadline if hedge_at is None else min(deadline, hedge_at)
                began = time.perf_counter()
                done, _ = await asyncio.wait(running, timeout=max(0.0, wake - now()),
                                             return_when=asyncio.FIRST_COMPLETED)
                waited_s += time.perf_counter() - began
                for task in done:
                    t = running.pop(task)
                    outcome = task.result()
                    if outcome.kind == "timeout":
                        return await self._timed_out(t.replica), None
                    if outcome.kind == "retry":
                        last_problem = outcome.problem
                        self.metrics.inc("grpo_router_reroutes_total", "Completions re-sent to another replica, "
                                         "by reason", reason=outcome.reason)
                        continue
                    if outcome.reply.status >= 500 and running:
                        fallback = t, outcome  # another try may still answer
                        continue
                    return self._won(t, outcome, hedged, max_tokens, t_start, waited_s)
                if not done and now() >= deadline:
                    break
                due = self._hedge_at(newest, max_tokens)
                if not done and due is not None and now() >= due:  # the newest try's per-try deadline passed
                    if pool.paused:
                        newest.not_before = now() + PAUSED_RECHECK_S
                    elif not self._hedge_allowed():
                        if not newest.over_budget:
                            newest.over_budget = True
                            self._skip_hedge("budget")
                        newest.not_before = now() + PAUSED_RECHECK_S
                    elif launch(hedge=True):
                        self.metrics.inc("grpo_router_hedges_total", "Completions also sent to another replica "
                                         "after a per-try deadline, by the replica that was too slow",
                                         replica=newest.replica.url)
                    else:
                        newest.hedge_blocked = True
                        self._skip_hedge("no_replica")
                if not running and fallback is None:
                    launch(hedge=False)  # every try so far failed: re-send
        finally:
            for task in running:
                task.cancel()
                self._keep_until_done(task)
        if fallback is not None:
            return self._won(*fallback, hedged, max_tokens, t_start, waited_s)
        if now() >= deadline:
            return failure(504, f"no answer within the {self.config.upstream_timeout_s}s deadline "
                                f"({last_problem or 'no replica answered'})", "GatewayTimeout"), None
        if last_problem:
            return failure(502, f"no replica could serve `{model}`: {last_problem} (tried {len(tried)})",
                           "BadGateway"), None
        return failure(503, f"no in-service replica holds `{model}`", "ServiceUnavailable"), None

    def _won(self, t: _Try, outcome: _Outcome, hedged: bool, max_tokens, t_start: float,
             waited_s: float) -> tuple[Reply, dict | None]:
        """The answer given to the client; the tries still running lost (cancelled by `forward`'s finally)."""
        reply = outcome.reply
        if hedged:
            self.metrics.inc("grpo_router_hedge_wins_total", "Hedged completions, by the try that answered first",
                             winner="hedge" if t.hedge else "first")
        if reply.status == 200:
            self.deadlines.observe(max_tokens, outcome.elapsed_s)
        else:
            self.metrics.inc("grpo_router_upstream_errors_total", "Non-200 completion answers",
                             replica=t.replica.url, status=str(reply.status))
        overhead = time.perf_counter() - t_start - waited_s
        self.metrics.observe("grpo_router_overhead_seconds", "Router time per completion, upstream excluded",
                             overhead, OVERHEAD_BUCKETS)
        self.overhead_s.append(overhead)
        if len(self.overhead_s) > 20_000:
            del self.overhead_s[:10_000]
        return reply, outcome.answer

    async def _timed_out(self, replica: Replica) -> Reply:
        if not await self.client.healthy(replica, min(1.0, self.config.health_timeout_s)):
            self.pool.mark_down(replica, "no answer to a completion before its deadline, and no /health answer")
        return failure(504, f"replica {replica.url} did not answer within {self.config.upstream_timeout_s}s",
                       "GatewayTimeout")

    def _hedge_done(self, task: asyncio.Task) -> None:
        self.hedges_in_flight -= 1

    def _keep_until_done(self, task: asyncio.Task) -> None:
        """A cancelled loser still releases its claims and adapter usage when it next runs; keep a reference."""
        if not task.done():
            self._losers.add(task)
            task.add_done_callback(self._losers.discard)

    def state(self) -> dict:
        m = self.metrics
        return {"enabled": self.config.per_try.enabled, "hedges": m.value("grpo_router_hedges_total"),
                "won_by_hedge": m.value("grpo_router_hedge_wins_total", winner="hedge"),
                "won_by_first": m.value("grpo_router_hedge_wins_total", winner="first"),
                "skipped": m.value("grpo_router_hedges_skipped_total"), "in_flight": self.hedges_in_flight,
                "per_try_deadline_s": self.deadlines.snapshot()}
