"""grpo_lab.backends"""
