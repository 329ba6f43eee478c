"""A fake vLLM replica that answers completions after a fixed delay, to load-test the router without a model.

It serves the endpoints the router probes and `/v1/completions` with a canned TRL-shaped answer after `--delay-s`
(± `--jitter`), so the router's own overhead can be measured with hundreds of requests in flight.

    python -m grpo_lab.serving.replicas.fake_replica --ports 0 0 --delay-s 0.2   # prints "READY <port> <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

from aiohttp import web

from grpo_lab.lab import environment

from ..wire.app_thread import serve_app
from ..wire.vllm_routes import unauthorized

ANSWER = {"object": "text_completion", "model": "fake",
          "choices": [{"index": 0, "text": "", "token_ids": [1, 2, 3],
                       "logprobs": {"token_logprobs": [-1.0, -1.0, -1.0]}, "finish_reason": "length"}]}


def make_app(delay_s: float, jitter: float = 0.0, model: str = "fake") -> web.Application:
    info = {"vllm_config": {"model_config": {"model": model, "max_model_len": 4096, "dtype": "torch.bfloat16"},
                            "cache_config": {"block_size": 16}, "parallel_config": {"data_parallel_size": 1},
                            "lora_config": {"max_lora_rank": 16, "max_loras": 6}}}
    models = {"object": "list", "data": [{"id": model, "root": model, "parent": None, "max_model_len": 4096}]}
    token = environment.bearer_key("VLLM_API_KEY") or ""

    @web.middleware
    async def auth(request, handler):  # like vLLM's --api-key: everything but /health needs the bearer token
        if request.path != "/health" and (refused := unauthorized(request, token)):
            return refused
        return await handler(request)

    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[auth])
    served = {"n": 0}

    async def completions(request):
        await request.read()
        served["n"] += 1
        service = delay_s * (1 + jitter * (2 * random.random() - 1))
        await asyncio.sleep(service)
        # the service time rides in the body, so a client behind the router can subtract it
        return web.Response(text=json.dumps({**ANSWER, "service_s": service}), content_type="application/json")

    app.router.add_get("/health", lambda r: _ok(""))
    app.router.add_get("/server_info", lambda r: _ok(json.dumps(info), "application/json"))
    app.router.add_get("/v1/models", lambda r: _ok(json.dumps(models), "application/json"))
    app.router.add_get("/served", lambda r: _ok(json.dumps(served), "application/json"))  # test hook
    app.router.add_post("/v1/completions", completions)
    return app


async def _ok(text: str, content_type: str = "text/plain"):
    return web.Response(text=text, content_type=content_type)


async def _serve(host: str, ports: list[int], delay_s: float, jitter: float) -> None:
    served = [await serve_app(make_app(delay_s, jitter), host, port) for port in ports]
    print("READY " + " ".join(str(port) for _, port in served), flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m grpo_lab.serving.replicas.fake_replica")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (a Ray node's IP for a cluster)")
    p.add_argument("--ports", type=int, nargs="+", default=[0])
    p.add_argument("--delay-s", type=float, default=0.2, help="mean service time of a completion")
    p.add_argument("--jitter", type=float, default=0.5, help="service time is uniform in delay*(1 +- jitter)")
    args = p.parse_args(argv)
    asyncio.run(_serve(args.host, args.ports, args.delay_s, args.jitter))


if __name__ == "__main__":
    main()
