"""Imported once by the fork server so each fresh probe process starts without paying for the imports.

Importing these modules does not initialise CUDA, so every forked probe still gets a fresh CUDA context and a fresh
allocator (`probe.run_point` falls back to spawn should one ever find it initialised)."""

import torch  # noqa: F401
import accelerate  # noqa: F401
import tokenizers  # noqa: F401
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
import trl.trainer.grpo_trainer  # noqa: F401
import transformers.trainer  # noqa: F401
import transformers.trainer_callback  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401
from peft import LoraConfig, get_peft_model  # noqa: F401
import datasets.arrow_dataset  # noqa: F401

import grpo_lab.models  # noqa: F401
import grpo_lab.loss.trl_switch  # noqa: F401
