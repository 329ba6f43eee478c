"""What a run records about itself in `run.json`, so that it can be judged by its own settings later.

The doctor's thresholds depend on the run: the replica kind (a CPU replica serves one request at a time), the
staleness bound, the requests in flight, and — for the routing note — the replicas' KV block size against the
prompts' length (a prompt shorter than one block shares no prefix block, so 0 % affinity is expected, not a fault).
"""

from __future__ import annotations

import statistics
import time

from .. import __version__
from .pool import run_get


def prompt_token_lengths(trainer, limit: int = 64) -> list[int]:
    """Token counts of the first `limit` training prompts, rendered as the rollout worker renders them."""
    tokenizer, dataset = trainer.processing_class, trainer.train_dataset
    lengths = []
    for row in dataset.select(range(min(limit, len(dataset)))):
        prompt = row["prompt"]
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in newer transformers
        else:
            ids = tokenizer(prompt)["input_ids"]
        lengths.append(len(ids))
    return lengths


def run_settings(loop, resumed_from: str | None = None) -> dict:
    """The settings of `loop` (an `AsyncLoop` after `start()`: TRL's trainer has resolved `max_inflight_tasks`)
    worth keeping with its run."""
    args, cfg, trainer = loop.args, loop.loop, loop.trainer
    samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    # the replicas' vLLM config, as TRL's client reads it; {} when the server does not answer
    info = (run_get(loop.url, "/server_info", 5.0, config_format="json") or {}).get("vllm_config") or {}
    try:
        lengths = prompt_token_lengths(trainer)
    except Exception:  # noqa: BLE001 - a custom dataset or tokenizer: the record just lacks the prompt lengths
        lengths = []
    settings = {
        "grpo_lab": __version__, "model": loop.model, "router": loop.url,
        "launcher": cfg.launcher, "replica_kind": cfg.replica_kind,
        "replicas": len(cfg.replica_urls) or (cfg.replicas if cfg.starts_replicas else None),
        "replica_urls": cfg.replica_urls, "external_router": cfg.router_url,
        "max_staleness": args.max_staleness, "samples_per_step": samples_per_step,
        "max_inflight_tasks": args.max_inflight_tasks,
        "autotune": bool(cfg.autotune), "queue_maxsize": args.queue_maxsize, "max_steps": args.max_steps,
        "seed": args.seed, "loss_backend": args.loss_backend, "tree_attention": trainer.tree_attention,
        "adapter_storage": trainer.adapter_store.url,
        "block_size": (info.get("cache_config") or {}).get("block_size"),
        "max_loras": (info.get("lora_config") or {}).get("max_loras"),
        "run_name": args.run_name, "pool_run": cfg.pool_run_name,
        "pool_weight": cfg.pool_weight if cfg.pool_run_name else None,
        "prompt_tokens_median": statistics.median(lengths) if lengths else None,
        "prompt_tokens_max": max(lengths) if lengths else None,
    }
    key = "resumed_at" if resumed_from else "started_at"
    settings[key] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if resumed_from:
        settings["resumed_from"] = str(resumed_from)
    return settings
