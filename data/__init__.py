"""Small data shipped with grpo-lab (installed as `grpo_lab.data_files`): exact public model configs, mini data sets."""
