"""The embedded task of the async loop: 2-digit addition as chat prompts, graded by the math reward.

Pairs come from `grpo_lab.tasks.tiny.addition_problems` (the same fixed split the SFT warm start used: training pool
vs held-out pool), rendered as `[{"role": "user", "content": "12+34="}]` with the gold in `answer`, which is what
`grpo_lab.tasks.rewards.math_reward` grades (a module-level function, so it can be sent to the rollout worker).
"""

from __future__ import annotations

from datasets import Dataset

from ..tasks.embedded_model import chat_messages
from ..tasks.rewards import math_reward
from ..tasks.tiny import addition_problems

REWARD_FUNCS = [math_reward]


def addition_dataset(n: int = 1024, seed: int = 0) -> Dataset:
    """`n` problems of the training pool (the held-out pool is left for evaluation)."""
    rows = addition_problems(seed=seed)[0][:n]
    return Dataset.from_list([{"prompt": chat_messages(r["problem"]), "answer": r["answer"]} for r in rows])
