"""grpo_lab.tasks"""
