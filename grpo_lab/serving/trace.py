"""Synthetic GRPO rollout traces with the shape of seed 2's run, for replaying through the router.

Shape (DESIGN.md §4, §7): N prompts that all start with the same chat-template tokens (23 for the qwen_math
template), prompt lengths a shifted log-normal with the Sanity set's median 95 / p90 240 / max 1,072 tokens,
G rollouts per prompt issued together, prompts visited in a fresh random order each epoch. The policy version is not in the
trace: it bumps when the trainer has consumed enough completions, which only a replay knows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class TraceConfig:
    """Parameters of a synthetic GRPO trace.

    Args:
        num_prompts: distinct prompts (1,460 in the Sanity set).
        group_size: rollouts per prompt (G), issued at the same time.
        num_groups: groups in the trace; defaults to one epoch (`num_prompts`). Seed 2 ran 64,728 rollouts.
        template_tokens: leading tokens every prompt shares (system prompt + chat template).
        min_prompt_tokens: the shortest prompt: template + the shortest question (~12 tokens) + the assistant
            header; lengths are `min + log-normal`, so the quantiles below hold and no prompt is shorter.
        median_prompt_tokens, p90_prompt_tokens, max_prompt_tokens: the prompt-length spread (template included).
        median_completion_tokens, max_completion_tokens: completion-length spread, for service times.
        vocab_size: token ids are drawn below this.
        seed: RNG seed; the same config always gives the same trace.
    """

    num_prompts: int = 1460
    group_size: int = 8
    num_groups: int | None = None
    template_tokens: int = 23
    min_prompt_tokens: int = 40
    median_prompt_tokens: int = 95
    p90_prompt_tokens: int = 240
    max_prompt_tokens: int = 1072
    median_completion_tokens: int = 700
    max_completion_tokens: int = 3000
    vocab_size: int = 151_936
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1 or self.group_size < 1:
            raise ValueError("num_prompts and group_size must be >= 1")
        if not (self.template_tokens < self.min_prompt_tokens < self.median_prompt_tokens < self.p90_prompt_tokens
                <= self.max_prompt_tokens):
            raise ValueError("need template_tokens < min < median < p90 <= max prompt tokens")


@dataclass
class TraceGroup:
    """One prompt's G rollouts: they arrive together."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    completion_tokens: list[int]  # one per rollout


def _lognormal(rng: random.Random, median: float, p90: float) -> float:
    sigma = math.log(p90 / median) / 1.2815515655446004  # z of the 90th percentile
    return math.exp(rng.gauss(math.log(median), sigma))


def make_prompts(config: TraceConfig) -> list[list[int]]:
    rng = random.Random(config.seed)
    template = [rng.randrange(config.vocab_size) for _ in range(config.template_tokens)]
    prompts = []
    for _ in range(config.num_prompts):
        low = config.min_prompt_tokens
        n = low + round(_lognormal(rng, config.median_prompt_tokens - low, config.p90_prompt_tokens - low))
        n = min(n, config.max_prompt_tokens)
        prompts.append(template + [rng.randrange(config.vocab_size) for _ in range(n - config.template_tokens)])
    return prompts


def generate_trace(config: TraceConfig | None = None) -> list[TraceGroup]:
    """The trace's groups in arrival order."""
    config = config or TraceConfig()
    prompts = make_prompts(config)
    rng = random.Random(config.seed + 1)
    num_groups = config.num_groups if config.num_groups is not None else config.num_prompts
    median_c = config.median_completion_tokens
    groups, order = [], []
    for g in range(num_groups):
        if not order:
            order = list(range(config.num_prompts))
            rng.shuffle(order)
        p = order.pop()
        lengths = [min(max(round(_lognormal(rng, median_c, 2.5 * median_c)), 1), config.max_completion_tokens)
                   for _ in range(config.group_size)]
        groups.append(TraceGroup(g, p, prompts[p], lengths))
    return groups
