"""The async-GRPO LoRA recipe as one documented config, and one call that builds its TRL trainer.

The recipe of the Hugging Face blog post on asynchronous GRPO with LoRA adapters across HF Jobs (docs/reward_curves.md;
published: reward 0.145 -> 0.438 over 500 steps). `build_recipe_trainer(RecipeConfig())` validates the config (bad values raise ValueError), then needs the hub for
the tokenizer and weights: without them it fails early with `RecipeUnavailableError` before anything big loads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from grpo_lab.loss.backends import DEFAULT_LOSS_BACKEND, resolve_backend
from grpo_lab.models.chat import PROMPT_FORMATS, render_qwen_math
from grpo_lab.models.hf_compat import checkpointing_args
from grpo_lab.tasks.data import DATASET_NAMES, load_task_dataset, to_grpo_dataset
from grpo_lab.tasks.rewards import math_reward


class RecipeUnavailableError(RuntimeError):
    """The recipe's model or data cannot be had (no network and no local copy)."""


@dataclass
class RecipeConfig:
    """The real recipe. Change fields to explore; `validate()` says what is wrong with a bad combination."""
    model_name: str = "Qwen/Qwen2.5-Math-1.5B"   # hub id or a local folder with the weights
    dataset: str = "sanity"                       # one of DATASET_NAMES
    dataset_path: str | None = None               # local copy (load_from_disk folder / jsonl); None: the hub
    prompt_format: str = "qwen_math"
    lora_r: int = 1
    lora_alpha: int = 2
    lora_target_modules: str | list[str] = "all-linear"
    learning_rate: float = 4e-5
    num_generations: int = 8                      # rollouts per prompt (G)
    completions_per_step: int = 128               # per optimizer step = 16 prompts x 8
    micro_batch_size: int = 8                     # completions per forward/backward (per device)
    max_completion_length: int = 3000
    max_context: int = 4096                       # prompt + completion
    beta: float = 0.0
    temperature: float = 1.0
    loss_backend: str = DEFAULT_LOSS_BACKEND
    max_steps: int = 500
    seed: int = 0
    bf16: bool = True
    gradient_checkpointing: bool = True
    use_vllm: bool = False
    vllm_mode: str = "colocate"                   # or "server" (then vllm_server_base_url)
    vllm_server_base_url: str | None = None
    output_dir: str = "runs/recipe"
    report_to: str = "none"
    extra_args: dict = field(default_factory=dict)  # any other GRPOConfig field

    @property
    def max_prompt_length(self) -> int:
        return self.max_context - self.max_completion_length

    def validate(self):
        check_lora_grpo(self.lora_r, self.num_generations, self.learning_rate)
        if self.completions_per_step < 1 or self.micro_batch_size < 1:
            raise ValueError(f"completions_per_step ({self.completions_per_step}) and micro_batch_size "
                             f"({self.micro_batch_size}) must be >= 1.")
        for name in ("num_generations", "micro_batch_size"):  # whole groups, whole micro-batches per step
            if self.completions_per_step % getattr(self, name):
                raise ValueError(f"completions_per_step={self.completions_per_step} must be a multiple of "
                                 f"{name}={getattr(self, name)}.")
        if self.dataset not in DATASET_NAMES:
            raise ValueError(f"Unknown dataset {self.dataset!r}; choose one of {DATASET_NAMES}.")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"Unknown prompt format {self.prompt_format!r}; choose one of {PROMPT_FORMATS}.")
        resolve_backend(self.loss_backend)
        if self.max_completion_length < 1 or self.max_prompt_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length} leaves no room for a prompt in "
                             f"max_context={self.max_context}.")
        return self


def check_lora_grpo(lora_r: int, num_generations: int, learning_rate: float) -> None:
    """The rules the recipe and the embedded default share (a ValueError naming the setting at fault)."""
    if lora_r < 1:
        raise ValueError(f"lora_r must be >= 1 (got {lora_r}); rank 0 is no adapter at all.")
    if num_generations < 2:
        raise ValueError(f"num_generations (G) must be >= 2 (got {num_generations}): GRPO's advantage is the "
                         "reward minus its group mean, which is always 0 for a group of one.")
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0 (got {learning_rate}).")


def prompt_token_lengths(tokenizer, prompts) -> list[int]:
    """Token count of each prompt as the trainer will render it (chat template when the tokenizer has one)."""
    def length(p) -> int:
        if not isinstance(p, list):
            return len(tokenizer(p)["input_ids"])
        if not getattr(tokenizer, "chat_template", None):
            user = [m["content"] for m in p if m["role"] == "user"][-1]
            return len(tokenizer(render_qwen_math(user))["input_ids"])
        ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding on transformers 5.x

    return [length(p) for p in prompts]


def check_prompts_fit(tokenizer, prompts, cfg: RecipeConfig) -> int:
    """Raise ValueError when a prompt is longer than the context leaves room for; returns the longest length."""
    lengths = prompt_token_lengths(tokenizer, prompts)
    worst = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[worst] > cfg.max_prompt_length:
        raise ValueError(f"Prompt {worst} has {lengths[worst]} tokens, more than max_context - max_completion_length"
                         f" = {cfg.max_context} - {cfg.max_completion_length} = {cfg.max_prompt_length}; raise "
                         "max_context, lower max_completion_length or filter the dataset.")
    return lengths[worst]


@contextlib.contextmanager
def _needs_hub(what: str, name: str, errors: tuple = (Exception,)):
    """A failure to load the recipe's `what` of `name` (OSError, LocalEntryNotFoundError, HTTP errors...) as one
    RecipeUnavailableError that says where it comes from and what to do."""
    try:
        yield
    except errors as e:
        raise RecipeUnavailableError(
            f"The recipe needs the {what} of {name!r}, which could not be loaded ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). It downloads from the Hugging Face hub: check the network and "
            "HF_HUB_OFFLINE, or point model_name/dataset_path at local copies. Offline, use the embedded default "
            "(grpo_lab.tasks.reward_curves.EmbeddedConfig).") from e


def build_recipe_trainer(cfg: RecipeConfig | None = None, callbacks=(), train_dataset=None):
    """Validate, load tokenizer -> data -> weights (failing early offline), and return the GRPO trainer."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = (cfg or RecipeConfig()).validate()
    with _needs_hub("tokenizer", cfg.model_name):  # first: the cheapest thing that needs the network
        tok = AutoTokenizer.from_pretrained(cfg.model_name, padding_side="left", truncation_side="left")
    if train_dataset is None:
        with _needs_hub("dataset", cfg.dataset, (OSError, ConnectionError)):
            ds = load_task_dataset(cfg.dataset, cfg.dataset_path)
        train_dataset = to_grpo_dataset(ds, cfg.prompt_format)
    check_prompts_fit(tok, train_dataset["prompt"], cfg)
    with _needs_hub("weights", cfg.model_name):
        model = AutoModelForCausalLM.from_pretrained(cfg.model_name, dtype=torch.bfloat16 if cfg.bf16 else None)
    from grpo_lab.loss import GRPOLabConfig, GRPOLabTrainer

    vllm = {"use_vllm": True, "vllm_mode": cfg.vllm_mode, "vllm_max_model_length": cfg.max_context,
            "vllm_server_base_url": cfg.vllm_server_base_url} if cfg.use_vllm else {}  # None: TRL's default
    args = GRPOLabConfig(
        output_dir=cfg.output_dir, learning_rate=cfg.learning_rate, max_steps=cfg.max_steps, beta=cfg.beta,
        num_generations=cfg.num_generations, per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.completions_per_step // cfg.micro_batch_size,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, bf16=cfg.bf16,
        **checkpointing_args(cfg.gradient_checkpointing), seed=cfg.seed, logging_steps=1,
        report_to=cfg.report_to, loss_backend=cfg.loss_backend, **vllm, **cfg.extra_args,
    )
    peft = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_target_modules,
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    return GRPOLabTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=train_dataset,
                   processing_class=tok, peft_config=peft, callbacks=list(callbacks))
