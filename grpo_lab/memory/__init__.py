"""grpo_lab.memory"""
