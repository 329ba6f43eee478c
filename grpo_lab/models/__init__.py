"""Models without downloads: exact public configs and random-init models (`configs`), the chat formats the recipes
prompt with (`chat`), and the few places transformers changed its names between releases (`hf_compat`).

Memory depends on shapes, not weights, so a random-init model of a public config gives honest memory figures
offline. This package imports nothing else from grpo_lab.
"""

from .configs import (TINY_CONFIGS, build_model, known_model_names, load_model_config,  # noqa: F401
                      shipped_model_names)

__all__ = ["TINY_CONFIGS", "build_model", "known_model_names", "load_model_config", "shipped_model_names"]
