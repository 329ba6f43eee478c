"""grpo_lab.serving"""
