"""The async trainer's step with each tree-attention implementation, at the recipe's packed size.

Builds packed rows the way TRL's `TokenBudgetBatcher` does (groups of G rollouts sharing a prompt, folded into a
`TreeRow` until `token_budget` unique tokens), with the recipe's shapes (prompts of the Sanity set's length
distribution, median 95 / p90 240 tokens; completions up to 3000 tokens), on a random-init model with an exact public
config (memory and time depend on shapes, not weights), LoRA r=1 on all linear layers, TRL's fused LM head, and
runs TRL's own `AsyncGRPOTrainer.compute_loss` forward and backward with `sdpa` and `flex` side by side. Prints and
writes per implementation: ms per row (median), forwarded tokens/s, peak memory, and the loss difference to sdpa.

    python benchmarks/tree_attention_bench.py --out results/async          # on a CUDA GPU
    python benchmarks/tree_attention_bench.py --model tiny-qwen3 --token-budget 1024 --impls sdpa   # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch


def recipe_rows(token_budget: int, rows: int, vocab: int, G: int = 8, max_completion: int = 3000, seed: int = 0):
    """`rows` packed rows of at most `token_budget` unique tokens, from groups shaped like the recipe's rollouts."""
    from trl.experimental.async_grpo.packing import TreeRow

    rng = np.random.default_rng(seed)
    out, group = [], 0
    row = TreeRow()
    while len(out) < rows:
        prompt_len = int(np.clip(rng.lognormal(np.log(95), 0.65), 23, 1072))
        prompt = list(rng.integers(10, vocab, prompt_len))
        for _ in range(G):
            n = int(np.clip(rng.lognormal(np.log(700), 0.7), 16, max_completion))
            ids = np.array(prompt + list(rng.integers(10, vocab, n)))
            sample = {"input_ids": ids, "completion_mask": np.array([0] * prompt_len + [1] * n),
                      "old_log_probs": rng.normal(-2.0, 0.5, len(ids)).astype(np.float32),
                      "advantage": float(rng.normal()), "group_id": group, "metrics": {}}
            if len(ids) > token_budget:
                continue
            if not row.fits(sample, token_budget):
                out.append(row)
                row = TreeRow()
                if len(out) == rows:
                    break
            row.add(sample)
        group += 1
    return out


def batch_of(row, device) -> dict:
    """What TRL's collator hands `compute_loss` for a one-process micro-batch of this row."""
    p = row.pack()
    n = p["input_ids"].numel()
    batch = {k: v[None].to(device) for k, v in p.items()}
    batch["attention_mask"] = torch.ones(1, n, dtype=torch.long, device=device)
    batch["global_n_tokens"] = torch.tensor([float(p["token_index"].numel())], device=device)
    batch["global_n_forward_tokens"] = torch.tensor([float(n)], device=device)
    batch["mean_seq_len"] = torch.tensor([n / len(row.samples)], device=device)
    return batch


def build(model_name: str, dtype, device: str, backend: str):
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from grpo_lab.async_loop.trainer import loss_only_trainer
    from grpo_lab.models import build_model
    from grpo_lab.loss import set_loss_backend

    model = build_model(model_name, dtype=dtype, device=device)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0))
    trainer = set_loss_backend(loss_only_trainer(device), backend)
    return model, trainer


def run(args) -> pd.DataFrame:
    from grpo_lab.async_loop import tree_attention
    from grpo_lab.lab.records import run_record

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model, trainer = build(args.model, dtype, device, args.loss_backend)
    rows = recipe_rows(args.token_budget, args.rows, model.config.vocab_size)
    packed = [batch_of(r, device) for r in rows]
    tokens = statistics.mean(b["input_ids"].numel() for b in packed)
    records, reference = [], {}
    for impl in args.impls.split(","):
        tree_attention.install(model, impl)
        times, losses = [], []
        for rep in range(args.warmup + args.repeats):
            for packed_row in packed:
                batch = {k: v.clone() for k, v in packed_row.items()}  # fresh tensors: the mask is rebuilt, as in training
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                loss = trainer.compute_loss(model, batch)
                loss.backward()
                if device == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                model.zero_grad(set_to_none=True)
                if rep >= args.warmup:
                    times.append(elapsed)
                    if rep == args.warmup:
                        losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        if not reference:
            reference = {"impl": impl, "losses": losses}
        ms = 1e3 * statistics.median(times)
        diff = max(abs(a - b) for a, b in zip(losses, reference["losses"]))
        records.append({"impl": impl, "ms_per_row": ms, "forwarded_tokens_per_row": tokens,
                        "forwarded_tok_s": tokens / (ms / 1e3), "peak_gib": peak,
                        "max_abs_loss_diff_vs_" + reference["impl"]: diff, "rows": len(rows), "repeats": args.repeats})
        print(f"{impl:5s}: {ms:9.2f} ms/row  {tokens / (ms / 1e3):10.0f} tok/s  peak {peak:6.2f} GiB  "
              f"|loss - {reference['impl']}| {diff:.2e}", flush=True)
    frame = pd.DataFrame(records)
    env = run_record("cuda" if device == "cuda" else "cpu")
    for k, v in {**env, "model": args.model, "dtype": args.dtype, "token_budget": args.token_budget,
                 "loss_backend": args.loss_backend, "lora_r": 1}.items():
        frame[k] = v
    return frame


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen2.5-Math-1.5B")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--impls", default="sdpa,flex")
    p.add_argument("--loss-backend", default="grpo_lab")
    p.add_argument("--out", default=None, help="folder for tree_attention_<device>.csv")
    a = p.parse_args(argv)
    frame = run(a)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        name = "tree_attention_h200.csv" if torch.cuda.is_available() else "tree_attention_cpu.csv"
        frame.to_csv(Path(a.out) / name, index=False)
        print("wrote", Path(a.out) / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
