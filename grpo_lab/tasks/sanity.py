"""The Sanity construction: keep the problems a model solves some but not all of the time.

`sail/Sanity-Test-R1D-1.5B` is the MATH problems DeepSeek-R1-Distill-Qwen-1.5B passed 20-80 % of 40 samples;
`sanity_filter` applies the same rule to any model and candidate set (sample k completions per candidate, keep
those with lo <= pass rate <= hi). Problems it always or never solves give GRPO zero advantage, so they are
wasted rollouts; the kept set is where the reward can move.
"""

from __future__ import annotations

from grpo_lab.tasks.sft import pass_rates


def sanity_filter(model, tokenizer, rows: list[dict], k: int = 8, lo: float = 0.2, hi: float = 0.8,
                  seed: int = 0) -> tuple[list[dict], dict]:
    """Rows (with a `pass_rate` field added) whose sampled pass rate over k completions lies in [lo, hi]."""
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"Need 0 <= lo <= hi <= 1, got lo={lo}, hi={hi}.")
    if k < 2:
        raise ValueError(f"The Sanity construction needs k >= 2 samples per problem, got k={k}.")
    rates = pass_rates(model, tokenizer, rows, k=k, seed=seed)
    kept = [dict(r, pass_rate=p) for r, p in zip(rows, rates, strict=True) if lo <= p <= hi]
    stats = {"candidates": len(rows), "kept": len(kept), "k": k, "lo": lo, "hi": hi,
             "mean_pass_rate_all": sum(rates) / max(len(rates), 1),
             "mean_pass_rate_kept": sum(r["pass_rate"] for r in kept) / max(len(kept), 1)}
    return kept, stats
