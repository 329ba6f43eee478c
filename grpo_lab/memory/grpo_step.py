"""Real TRL GRPO training steps on a random-init model, instrumented for peak memory per phase.

Offline: a word-level tokenizer built in code, prompts and completions of exact lengths; synthetic completions
reach TRL through `rollout_func`, so the step measured is TRL's own scoring, loss, backward and optimizer step
(docs/memory.md). The meter's peak is reset between the `generation` and `train` phases of each step.
"""

from __future__ import annotations

import time
import zlib

import torch
from transformers import TrainerCallback

from grpo_lab.lab import environment
from grpo_lab.models import build_model, load_model_config

from .fsdp import apply_lora, init_process_group, keep_trainer_from_rewrapping, shard_fsdp2
from .meter import check_budget, device_info, prepare_probe_device
from .spec import PointSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_tokenizer(config):
    """A fast tokenizer with one word per token id (`t0 … t{V-1}`), specials at the config's ids.

    The specials match whole words only (`single_word=True`): otherwise a special such as `t1` is also found inside
    `t174`, which then splits into several tokens and the prompts come out longer than `prompt_len` (and of unequal
    length, so padded) — as they did for the tiny configs, whose specials are ids 0-2."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = config.vocab_size
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = config.eos_token_id if config.eos_token_id is not None else vocab_size - 1
    eos = eos[0] if isinstance(eos, list) else eos
    pad = config.pad_token_id if config.pad_token_id is not None else eos
    bos = config.bos_token_id if config.bos_token_id is not None else eos
    def special(i: int) -> AddedToken:
        return AddedToken(f"t{i}", single_word=True, special=True, normalized=False)

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special(eos), pad_token=special(pad),
                                   bos_token=special(bos), unk_token=special(0))


def _special_ids(tokenizer) -> set[int]:
    return {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, 0) if i is not None}


def _ordinary_ids(vocab_size: int, specials: set[int], n: int, gen: torch.Generator) -> list[int]:
    ids = torch.randint(3, vocab_size, (n,), generator=gen).tolist()
    return [i if i not in specials else 3 + (i % (vocab_size - 3)) for i in ids]


def build_dataset(tokenizer, vocab_size: int, prompt_len: int, n_prompts: int, seed: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    specials = _special_ids(tokenizer)
    prompts = [" ".join(f"t{i}" for i in _ordinary_ids(vocab_size, specials, prompt_len, gen)) for _ in range(n_prompts)]
    return Dataset.from_dict({"prompt": prompts})


def length_reward(completions, completion_ids, **kwargs):
    """A deterministic, content-dependent reward so advantages are non-zero (its value is irrelevant to memory).
    TRL passes every reward function the completions' token ids."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def synthetic_rollout(completion_len: int, vocab_size: int, specials: set[int], seed: int):
    """A TRL `rollout_func`: tokenise the prompts and return random completions of exactly `completion_len` tokens.

    Completions depend only on (prompt text, step, seed), so a 2-process run sees the same data as a 1-process run."""

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids, completion_ids = [], []
        counts: dict[str, int] = {}
        for p in prompts:
            prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
            k = counts.get(p, 0)
            counts[p] = k + 1
            s = zlib.crc32(f"{seed}|{trainer.state.global_step}|{k}|{p}".encode())
            completion_ids.append(_ordinary_ids(vocab_size, specials, completion_len, torch.Generator().manual_seed(s)))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def num_generations_for(batch_size: int, world_size: int) -> tuple[int, int]:
    """(num_generations, steps_per_generation) so that one optimizer step holds exactly `batch_size` sequences.

    GRPO needs groups of >= 2; the smallest divisor >= 2 of the global batch is used (memory does not depend on it).
    A global batch of 1 generates a group of 2 and trains on it over 2 optimizer steps of 1 sequence (never gradient
    accumulation, whose no-sync path transformers only supports for models it sharded itself)."""
    total = batch_size * world_size
    if total == 1:
        return 2, 2
    return next(g for g in range(2, total + 1) if total % g == 0), 1


def model_config_of(spec: PointSpec):
    """The transformers config of `spec.model`: a shipped config, or a hub id's / folder's with `pretrained`."""
    if spec.pretrained:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.model)
    return load_model_config(spec.model)


def make_trainer(spec: PointSpec, output_dir: str, device: torch.device, callbacks=()):
    """The GRPO trainer for `spec`: `grpo_lab.loss.GRPOLabTrainer` with `loss_backend=spec.loss_backend`."""
    from grpo_lab.loss import GRPOLabConfig, GRPOLabTrainer  # TRL: imported with the first trainer, in the probe

    model_config = model_config_of(spec)
    tokenizer = build_tokenizer(model_config)
    num_generations, steps_per_generation = num_generations_for(spec.batch_size, spec.world_size)
    global_batch = spec.batch_size * spec.world_size * steps_per_generation
    n_prompts = max(1, global_batch // num_generations) * (spec.steps + 1)
    dataset = build_dataset(tokenizer, model_config.vocab_size, spec.prompt_len, n_prompts, spec.seed)

    # TRL's default activation checkpointing stays on (what the planner's `gradient_checkpointing=True` models)
    args = GRPOLabConfig(
        output_dir=output_dir, per_device_train_batch_size=spec.batch_size, gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation, num_generations=num_generations,
        max_completion_length=spec.completion_len, max_steps=spec.steps, learning_rate=1e-5, beta=spec.beta,
        num_iterations=spec.num_iterations, bf16=spec.dtype == "bf16", seed=spec.seed, data_seed=spec.seed,
        logging_strategy="no", save_strategy="no", log_level="error", report_to="none", disable_tqdm=True,
        use_cpu=device.type == "cpu", dataloader_num_workers=0, shuffle_dataset=False,
        loss_backend=spec.loss_backend,
        generation_kwargs={"min_new_tokens": spec.completion_len} if spec.generation == "model" else None)
    # The model is created on its device in its final dtype (no fp32 master copy): the `bf16` points are pure bf16
    # training, the `fp32` points pure fp32. LoRA is applied here (not by TRL) so the FSDP2 path can shard the PEFT
    # model before the trainer wraps it; under FSDP2 every rank builds the full model, then shards it.
    if spec.pretrained:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=TORCH_DTYPES[spec.dtype],
                                                     attn_implementation="sdpa").to(device)
    else:
        model = build_model(spec.model, dtype=TORCH_DTYPES[spec.dtype], seed=spec.seed, device=str(device))
    if spec.lora_r > 0:
        model = apply_lora(model, spec.lora_r)
    if spec.fsdp:
        init_process_group(device)
        # Liger's loss runs the backbone and reads the head weight outside the root forward: keep those replicated
        model = shard_fsdp2(model, device, replicate_root=spec.loss_backend == "liger",
                            flag=not spec.extra.get("without_transformers_flag", False))
    rollout = None
    if spec.generation == "synthetic":
        environment.silence_trl_experimental()
        rollout = synthetic_rollout(spec.completion_len, model_config.vocab_size, _special_ids(tokenizer), spec.seed)
    trainer = GRPOLabTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset,
                             processing_class=tokenizer, rollout_func=rollout, callbacks=list(callbacks))
    if spec.fsdp:
        keep_trainer_from_rewrapping(trainer, model)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # what `disable_tqdm` puts in the progress bar's place
    return trainer


class PhaseRecorder(TrainerCallback):
    """Splits each optimizer step into generation and training phases and keeps the peak of each (a trainer
    callback, plus `wrap` around the trainer's scoring and loss)."""

    def __init__(self, meter, budget_bytes: int | None = None, capture_grads: bool = False, base: int = 0):
        self.meter, self.budget, self.capture_grads, self.base = meter, budget_bytes, capture_grads, base
        self.gen_peaks: list[dict] = []
        self.train_peaks: list[dict] = []
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] | None = None
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self.meter.reset_peak()
        self._t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.capture_grads and model is not None:  # keeps the last step's
            self.grads = _collect_lora_grads(model)

    def on_step_end(self, args, state, control, **kw):
        self.meter.sync()
        self.step_times.append(time.perf_counter() - self._t0)
        self.train_peaks.append(self.meter.peak())
        check_budget(self.meter, self.train_peaks[-1]["peak"] - self.base, self.budget)

    def wrap(self, trainer):
        original_gen = trainer._generate_and_score_completions
        original_loss = trainer.compute_loss

        def generate_and_score(*a, **k):
            out = original_gen(*a, **k)
            self.meter.sync()
            self.gen_peaks.append(self.meter.peak())
            check_budget(self.meter, self.gen_peaks[-1]["peak"] - self.base, self.budget)
            self.meter.reset_peak()
            return out

        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            out = original_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            loss = out[0] if isinstance(out, tuple) else out
            self.losses.append(float(loss.detach().float().cpu()))
            return out

        trainer._generate_and_score_completions = generate_and_score
        trainer.compute_loss = compute_loss


def _collect_lora_grads(model) -> dict:
    """LoRA gradients as full (gathered) numpy arrays, keyed by parameter name without wrapper prefixes."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None and "lora_" in name:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a DTensor: gathered
            grads[name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")] = (
                g.detach().float().cpu().numpy().copy())
    return grads


def run_grpo_steps(spec: PointSpec, output_dir: str, capture_grads: bool = False) -> dict:
    """Build the trainer and run `spec.steps` optimizer steps; return the phase peaks (bytes), times and losses."""
    device, meter = prepare_probe_device(spec.device, spec.budget_bytes)
    base = meter.current()
    rec = PhaseRecorder(meter, spec.budget_bytes, capture_grads, base)
    trainer = make_trainer(spec, output_dir, device, callbacks=[rec])
    rec.wrap(trainer)
    setup_bytes = meter.current()
    trainer.train()
    result = {
        "peak_bytes": max(p["peak"] for p in rec.train_peaks),
        "peak_generation_bytes": max(p["peak"] for p in rec.gen_peaks) if rec.gen_peaks else None,
        "reserved_bytes": max(p.get("reserved", 0) for p in rec.train_peaks) if meter.kind == "cuda_allocated" else None,
        "base_bytes": base, "setup_bytes": setup_bytes, "step_time_s": min(rec.step_times) if rec.step_times else None,
        "memory_kind": meter.kind, "steps_done": len(rec.train_peaks), "losses": rec.losses,
        **device_info(device)}
    if capture_grads:
        result["grads"] = rec.grads
    return result
