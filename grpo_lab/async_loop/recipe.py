"""The public async-GRPO LoRA recipe on the async loop: Qwen2.5-Math-1.5B, LoRA r=1, Sanity, vLLM replicas behind
the router.

The settings the Hugging Face blog post on async GRPO with LoRA ended on after five runs (`sanity_args`). It
needs the Hub (weights) unless `model` is a local copy, and GPUs for the replicas:
`grpo_lab.async_loop.notebook.recipe_commands()` prints the `vllm serve` and router lines.
"""

from __future__ import annotations

from ..serving.adapters.slots import DEFAULT_MAX_STALENESS
from .launch import AsyncLoop, LoopConfig, no_checkpointing


def sanity_args(output_dir: str = "runs/sanity-async", **overrides):
    from .config import AsyncGRPOLabConfig

    values = dict(
        output_dir=output_dir, max_steps=500, learning_rate=4e-5, num_generations=8, per_device_train_batch_size=16,
        gradient_accumulation_steps=8, token_budget=16384, max_completion_length=3000,
        max_staleness=DEFAULT_MAX_STALENESS,  # the recipe's 4 is TRL's default
        max_inflight_tasks=384, **no_checkpointing(), bf16=True, logging_steps=1, save_steps=50,
        report_to=[], temperature=1.0)
    values.update(overrides)
    return AsyncGRPOLabConfig(**values)


def sanity_loop(router_url: str, model: str = "Qwen/Qwen2.5-Math-1.5B", dataset_path: str | None = None,
                output_dir: str = "runs/sanity-async", callbacks=None, **overrides) -> AsyncLoop:
    """The recipe's loop against running replicas (`router_url`); call `.train()` on it (or use it with `with`)."""
    from ..tasks.data import load_task_dataset, to_grpo_dataset
    from ..tasks.rewards import math_reward

    dataset = to_grpo_dataset(load_task_dataset("sanity", dataset_path), "qwen_math")
    return AsyncLoop(LoopConfig(router_url=router_url, model=model), sanity_args(output_dir, **overrides),
                     reward_funcs=[math_reward], train_dataset=dataset, callbacks=callbacks)
