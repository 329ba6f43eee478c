"""grpo_lab.tasks: data + rewards for the GRPO recipes, and the embedded default of notebook 03.

data (Sanity / GSM8K / MATH-500 loaders, prompts in the `grpo_lab.models.chat` formats), rewards (math-verify, last
boxed answer), tiny (char tokenizer + ~0.6M Qwen2, 2-digit addition), sft (warm start, sampling), embedded_model (the
offline chat model the async loop and the replicas serve), sanity (the 20-80 % filter), recipe (the async-GRPO LoRA
recipe's config + one-call trainer), reward_curves (pipeline runner, CSV/PNG, GPU CLI), board (the trainer callback
that feeds `grpo_lab.lab.live_board`), notebook (what notebook 03 calls).
"""
