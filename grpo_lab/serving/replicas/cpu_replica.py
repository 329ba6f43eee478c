"""A CPU replica: an OpenAI-compatible server on transformers + PEFT that honours vLLM's contract for async GRPO.

It answers every endpoint TRL 1.16's AsyncGRPOTrainer and the router call (`wire.vllm_routes`) with vLLM's shapes and
status codes (a name already loaded is a 400, a missing adapter path a 404 "No adapter found"), plus `/metrics` with
vLLM's prefix-cache counters. Use it for tests and notebooks; use `vllm serve` (see `vllm_launcher`) for real runs.

    python -m grpo_lab.serving.replicas.cpu_replica --model tiny-qwen3 --port 0   # prints "READY <port>" once listening
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from grpo_lab.lab import environment
from grpo_lab.lab.settings_parser import ConfigParser

from .generation import CLIENT_CLOSED, Engine, RequestError, SamplingParams
from ..adapters.storage import lineage_of
from ..wire.app_thread import serve_app
from ..wire.client_watch import client_gone
from ..wire.metrics import Registry
from .config import CPUReplicaConfig
from ..wire.vllm_routes import add_vllm_routes, error_response, unauthorized

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics")


class CPUReplica:
    def __init__(self, config: CPUReplicaConfig, engine: Engine | None = None):
        self.config = config
        self.engine = engine or Engine(config)
        self._api_key = environment.bearer_key(config.api_key_env)
        self._generate_pool = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self._control_pool = ThreadPoolExecutor(1, thread_name_prefix="control")
        self.started = int(time.time())
        self.unknown_model_requests = 0  # completions naming a model this replica did not hold when they came
        self.unloaded_under_requests = 0  # completions whose model was unloaded while they waited or ran
        self.abandoned_requests = 0  # completions stopped because their client had left
        self.in_progress = 0  # completions accepted and not answered yet (waiting for the generation thread or running)
        self.served_by_family: Counter = Counter()  # completions generated, by model name less its version suffix

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[self._auth])
        add_vllm_routes(app.router, self)
        app.router.add_get("/metrics", self.metrics)  # vLLM's prefix-cache counters, for the benchmarks
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in OPEN_PATHS and (refused := unauthorized(request, self._api_key)):
            return refused
        return await handler(request)

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except ValueError as error:
            raise RequestError(400, f"malformed JSON body: {error}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the JSON body must be an object")
        return body

    # -- info ---------------------------------------------------------------------------------------------------
    async def health(self, request):
        return web.Response(text="")

    def vllm_config(self) -> dict:
        c = self.config
        return {
            "model_config": {"model": c.served_model_names[0], "served_model_name": c.served_model_names[0],
                             "max_model_len": c.max_model_len, "dtype": f"torch.{c.dtype}",
                             "logprobs_mode": "processed_logprobs"},
            "cache_config": {"block_size": c.block_size, "enable_prefix_caching": c.prefix_cache_blocks > 0},
            "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "lora_config": {"max_lora_rank": c.max_lora_rank, "max_loras": c.max_loras, "max_cpu_loras": c.max_loras},
            "backend": "grpo_lab.cpu_replica",
        }

    async def server_info(self, request):
        return web.json_response({"vllm_config": self.vllm_config()})

    async def models(self, request):
        base = self.config.served_model_names
        card = lambda i, root, parent: {"id": i, "object": "model", "created": self.started, "owned_by": "grpo_lab",
                                        "root": root, "parent": parent, "max_model_len": self.config.max_model_len}
        data = [card(n, self.config.model, None) for n in base]
        data += [card(n, p, base[0]) for n, p in list(self.engine.adapters.items())]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request):
        e, reg, name = self.engine, Registry(), self.config.served_model_names[0]
        reg.inc("vllm:prefix_cache_queries_total", "Prefix-cache queried tokens", e.cache.query_tokens,
                model_name=name)
        reg.inc("vllm:prefix_cache_hits_total", "Prefix-cache hit tokens", e.cache.hit_tokens, model_name=name)
        reg.inc("vllm:request_success_total", "Finished completions", e.requests, model_name=name)
        reg.inc("vllm:generation_tokens_total", "Generated tokens", e.generated_tokens, model_name=name)
        reg.set("vllm:lora_adapters_loaded", "Adapters loaded", len(e.adapters), model_name=name)
        reg.inc("grpo_replica_unknown_model_total", "Completions naming a model not held here when they came",
                self.unknown_model_requests)
        reg.inc("grpo_replica_unloaded_under_completion_total", "Completions whose model was unloaded before they "
                "finished", self.unloaded_under_requests)
        reg.inc("grpo_replica_abandoned_total", "Completions stopped because their client had left",
                self.abandoned_requests)
        for family, count in sorted(self.served_by_family.items()):
            reg.inc("grpo_replica_completions_total", "Completions generated, by the model's name less its -vN "
                    "version suffix (one series per adapter lineage: a shared pool's run's completions add up)",
                    count, model_family=family)
        for work, seconds in sorted(e.work_seconds.items()):  # generate, adapter_load, adapter_unload
            reg.inc("grpo_replica_work_seconds_total", "Wall seconds spent per kind of work (one completion at a "
                    "time; adapter changes on a thread of their own, between tokens)", round(seconds, 6), work=work)
            reg.inc("grpo_replica_work_total", "Times each kind of work was done", e.work_count[work], work=work)
        reg.set("grpo_replica_completions_in_progress", "Completions accepted and not answered yet",
                self.in_progress)
        reg.set("grpo_replica_prefix_cache_blocks", "Blocks held by the prefix cache", len(e.cache))
        return web.Response(text=reg.render(), content_type="text/plain")

    # -- completions --------------------------------------------------------------------------------------------
    async def completions(self, request):
        try:
            body = await self._body(request)
            model, prompt = body.get("model"), body.get("prompt")
            if not isinstance(model, str):
                raise RequestError(400, "'model' must be a string")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                prompt = prompt[0]  # a batch of one
            if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise RequestError(400, "'prompt' must be a list of token ids (the CPU replica has no tokenizer)")
            if body.get("stream"):
                raise RequestError(400, "streaming is not supported by the CPU replica")
            params = SamplingParams.from_request(body)
            self.engine.check_model(model)
        except RequestError as error:
            if error.kind == "NotFoundError":
                self.unknown_model_requests += 1  # sent here for a model this replica does not hold: misrouted
            return error_response(error.status, error.message, error.kind)
        self.in_progress += 1
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._generate_pool, functools.partial(
                self.engine.generate, model, prompt, params, aborted=lambda: client_gone(request)))
        except RequestError as error:
            if error.kind == "NotFoundError":  # held on arrival, unloaded before or while it ran
                self.unloaded_under_requests += 1
            elif error.kind == CLIENT_CLOSED:
                self.abandoned_requests += 1
            return error_response(error.status, error.message, error.kind)
        finally:
            self.in_progress -= 1
        self.served_by_family[lineage_of(model)] += 1  # per lineage, not per version: series that do not grow
        logprobs = {"token_logprobs": out["logprobs"], "tokens": [f"token_id:{t}" for t in out["token_ids"]],
                    "top_logprobs": out["top_logprobs"], "text_offset": [0] * len(out["token_ids"])}
        choice = {"index": 0, "text": "", "token_ids": out["token_ids"], "logprobs": logprobs,
                  "finish_reason": out["finish_reason"], "stop_reason": None}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt
        n_out = len(out["token_ids"])
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out,
                      "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}},
        })

    # -- control ------------------------------------------------------------------------------------------------
    async def _adapter_call(self, request, fields: tuple[str, ...], change, done: str) -> web.Response:
        """Load or unload (`change(*fields)` on the control thread), answered as vLLM does."""
        try:
            body = await self._body(request)
            values = [body.get(f) for f in fields]
            if not all(isinstance(v, str) and v for v in values):
                raise RequestError(400, f"{' and '.join(repr(f) for f in fields)} must be non-empty string(s)")
            await asyncio.get_running_loop().run_in_executor(self._control_pool, change, *values)
        except RequestError as error:
            return error_response(error.status, error.message, error.kind)
        log.info("adapter %s %s", values[0], done)
        return web.Response(text=f"Success: LoRA adapter '{values[0]}' {done} successfully.")

    async def load_adapter(self, request):
        return await self._adapter_call(request, ("lora_name", "lora_path"), self.engine.load_adapter, "added")

    async def unload_adapter(self, request):
        return await self._adapter_call(request, ("lora_name",), self.engine.unload_adapter, "removed")

    async def pause(self, request):
        mode = request.query.get("mode", "keep")
        if mode != "keep":
            return error_response(400, f"the CPU replica supports mode=keep only, got {mode!r}")
        self.engine.running.clear()
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self.engine.running.set()
        return web.json_response({"status": "running"})

    async def is_paused(self, request):
        return web.json_response({"is_paused": not self.engine.running.is_set()})


def build_parser() -> ConfigParser:
    """The command line, generated from `CPUReplicaConfig`, and two flags of the process itself."""
    p = ConfigParser(CPUReplicaConfig, prog="python -m grpo_lab.serving.replicas.cpu_replica",
                     description=__doc__.split("\n")[0])
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when stdin closes, so a crashed parent (test, notebook) leaves no replica behind")
    return p


def _clean_up_on_sigterm(engine: Engine) -> None:
    """SIGTERM (how `processes` stops a replica) still ends the process at once, by that signal, but first
    removes the adapter copies it made from object stores: exit handlers do not run on a death by signal."""
    def handler(signum, frame):
        engine.remove_adapter_copies()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def _exit_on_stdin_eof() -> None:
    sys.stdin.read()  # returns when the parent closes the pipe or dies
    os._exit(0)


async def _serve(replica: CPUReplica) -> None:
    _, port = await serve_app(replica.app(), replica.config.host, replica.config.port)
    print(f"READY {port}", flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    config, args = build_parser().parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.exit_with_parent:
        threading.Thread(target=_exit_on_stdin_eof, daemon=True).start()
    replica = CPUReplica(config)
    _clean_up_on_sigterm(replica.engine)
    try:
        asyncio.run(_serve(replica))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
