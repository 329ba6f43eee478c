"""The bench every experiment sits on, knowing nothing of GRPO: every environment variable grpo-lab reads
(`environment`, the one reader), where runs write (`outputs`), what a result file records about the run's machine
(`records`), the notebooks' widgets (`widgets`, `live_board`), running notebooks headless (`runner`) and opening
them in JupyterLab (`jupyter`, the `grpo-lab lab` command).

This package imports nothing else from grpo_lab; it is the bottom layer, which every other package may import.
"""
