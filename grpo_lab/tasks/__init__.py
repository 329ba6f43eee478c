"""grpo_lab.tasks: data + rewards for the GRPO recipes, and the embedded default of notebook 03.

Modules: data, rewards, tiny (the 2-digit addition task and model), sft, sanity, recipe, reward_curves, board, notebook
(what notebook 03 calls) and embedded_model (the offline chat model the async loop and the replicas serve).
"""
