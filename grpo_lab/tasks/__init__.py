"""grpo_lab.tasks: data + rewards for the GRPO recipes, and the embedded default of notebook 03.

data (Sanity / GSM8K / MATH-500 loaders), prompts (qwen_math), rewards (math-verify, last boxed answer),
tiny (char tokenizer + ~0.6M Qwen2, 2-digit addition), sft (warm start, sampling), sanity (the 20-80 % filter),
recipe (the seed recipe's config + one-call trainer), reward_curves (pipeline runner, CSV/PNG, GPU CLI),
board (live widgets board + TrainerCallback), notebook (what notebook 03 calls).
"""
