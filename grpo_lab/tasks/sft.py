"""SFT warm start of the tiny model, batched sampling, and pass-rate evaluation (plain torch, fixed seeds).

The warm start stops as soon as the sampled pass rate (temperature 1) reaches `target_pass_rate`, so GRPO starts
from a model that is right some of the time, like the recipe's base model on its Sanity problems.
"""

from __future__ import annotations

import random
import time
from importlib import resources
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from grpo_lab.models.hf_compat import cache_keyword
from grpo_lab.tasks.rewards import grade, last_boxed
from grpo_lab.tasks.tiny import completion_for

WARM_START_FILE = "tiny_addition_sft.safetensors"


@torch.no_grad()
def sample(model, tokenizer, problems: list[str], k: int = 1, max_new_tokens: int = 8, seed: int = 0,
           batch_size: int = 4096) -> list[list[str]]:
    """k completions per problem at temperature 1 (problems of one token length): texts, [len][k]."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = tokenizer.eos_token_id
    ids = torch.tensor(tokenizer(problems)["input_ids"], device=device).repeat_interleave(k, dim=0)
    keyword = cache_keyword(model)
    out: list[str] = []
    for start in range(0, ids.shape[0], batch_size):
        seq = ids[start:start + batch_size]
        p_len = seq.shape[1]
        done = torch.zeros(seq.shape[0], dtype=torch.bool, device=device)
        step_in, cache_kw = seq, {}
        for _ in range(max_new_tokens):
            res = model(input_ids=step_in, use_cache=True, **cache_kw)
            cache_kw = {keyword: res[keyword]}  # the output names the cache as the forward takes it
            probs = torch.softmax(res.logits[:, -1, :].float(), -1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            seq = torch.cat([seq, nxt[:, None]], 1)
            step_in = nxt[:, None]
            done |= nxt == eos
            if bool(done.all()):
                break
        out.extend(tokenizer.batch_decode(seq[:, p_len:], skip_special_tokens=True))
    model.train(was_training)
    return [out[i * k:(i + 1) * k] for i in range(len(problems))]


def pass_rates(model, tokenizer, rows: list[dict], k: int = 8, seed: int = 0):
    """Per-problem fraction of k sampled completions graded correct."""
    comps = sample(model, tokenizer, [r["problem"] for r in rows], k=k, seed=seed)
    return [sum(grade(last_boxed(c), r["answer"]) for c in cs) / k for cs, r in zip(comps, rows, strict=True)]


def sft_warm_start(model, tokenizer, rows: list[dict], *, target_pass_rate: float = 0.4, max_steps: int = 3000,
                   batch_size: int = 128, lr: float = 3e-3, eval_every: int = 25, eval_problems: int = 256,
                   seed: int = 0, log=None) -> dict:
    """Teacher-forced SFT on `problem -> \\boxed{answer}<eos>` until the sampled pass rate reaches the target."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    texts = [r["problem"] + completion_for(r["answer"]) for r in rows]
    p_len = len(tokenizer(rows[0]["problem"])["input_ids"])
    enc = [tokenizer(t)["input_ids"] + [eos] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    eval_rows = rows[:eval_problems]
    history, t0, step, rate = [], time.perf_counter(), 0, 0.0
    device = next(model.parameters()).device
    model.train()
    for step in range(1, max_steps + 1):
        batch = [enc[rng.randrange(len(enc))] for _ in range(batch_size)]
        ids = pad_sequence([torch.tensor(b) for b in batch], batch_first=True, padding_value=tokenizer.pad_token_id)
        labels = ids.clone()
        labels[:, :p_len] = -100
        labels[ids == tokenizer.pad_token_id] = -100
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 50)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0:
            rate = sum(pass_rates(model, tokenizer, eval_rows, k=1, seed=seed + step)) / len(eval_rows)
            history.append({"step": step, "loss": float(loss.detach()), "pass_rate": rate})
            if log:
                log(f"SFT step {step}: loss {float(loss.detach()):.3f}, pass rate {rate:.3f}")
            if rate >= target_pass_rate:
                break
    model.eval()
    return {"steps": step, "pass_rate": rate, "seconds": time.perf_counter() - t0, "history": history,
            "reached": rate >= target_pass_rate}


def save_warm_start(model, out, **metadata) -> None:
    """The SFT weights as safetensors, `metadata` as strings; the tied lm_head is left out (stored once, as the
    embeddings: `load_warm_start` loads it so)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out), metadata={k: str(v) for k, v in metadata.items()})


def load_warm_start(model, path) -> None:
    """Load a warm start saved without the tied lm_head (safetensors does not store shared tensors twice)."""
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"Warm start {path} does not match the model: missing {missing}, unexpected {unexpected}")


def shipped_warm_start(name: str = WARM_START_FILE) -> Path:
    """The warm start `name` shipped in `data/mini/` (by default the tiny task's: `main` regenerates it)."""
    return Path(str(resources.files("grpo_lab.data_files").joinpath("mini", name)))


def main(argv=None):
    """Regenerate the shipped warm start: `python -m grpo_lab.tasks.sft --out data/mini/tiny_addition_sft.safetensors`"""
    import argparse

    from grpo_lab.tasks.tiny import addition_problems, build_char_tokenizer, build_tiny_model

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.4)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args(argv)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=a.seed)
    train_pool, _ = addition_problems(seed=a.seed)
    info = sft_warm_start(model, tok, train_pool, target_pass_rate=a.target, lr=a.lr, seed=a.seed,
                          log=lambda s: print(s, flush=True))
    save_warm_start(model, a.out, seed=a.seed, steps=info["steps"], pass_rate=f"{info['pass_rate']:.4f}", lr=a.lr)
    print({k: v for k, v in info.items() if k != "history"})


if __name__ == "__main__":
    main()
