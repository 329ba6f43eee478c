"""Prompt formats the recipes use.

`qwen_math` is the Qwen2.5-Math chat format of the async-GRPO LoRA recipe: a system turn asking for a boxed answer, the
problem as the user turn. TRL renders chat prompts with the tokenizer's own chat template; `render_qwen_math`
gives the same text without a tokenizer (the ChatML layout Qwen2.5 uses), for length checks and plain-text runs.
"""

from __future__ import annotations

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."

PROMPT_FORMATS = ("qwen_math", "plain")


def render_qwen_math(problem: str) -> str:
    """The same prompt as ChatML text with the generation prompt appended (what Qwen2.5's template renders)."""
    return (f"<|im_start|>system\n{QWEN_MATH_SYSTEM}<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n"
            "<|im_start|>assistant\n")


def make_prompt(problem: str, fmt: str = "qwen_math"):
    """The prompt of `problem` in format `fmt`: `qwen_math` the recipe's chat (TRL applies the tokenizer's
    chat template), `plain` one line of text."""
    if fmt == "qwen_math":
        return [{"role": "system", "content": QWEN_MATH_SYSTEM}, {"role": "user", "content": problem}]
    if fmt == "plain":
        return f"{problem}\nPut your final answer within \\boxed{{}}.\n"
    raise ValueError(f"Unknown prompt format {fmt!r}; choose one of {PROMPT_FORMATS}.")
