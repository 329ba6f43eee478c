"""The bench every experiment sits on, knowing nothing of GRPO (its modules: docs/architecture.md). The bottom layer:
it imports nothing else from grpo_lab, and every other package may import it.
"""
