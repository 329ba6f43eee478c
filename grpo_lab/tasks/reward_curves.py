"""The embedded default of notebook 03: a tiny model trained from scratch, the Sanity construction, GRPO with LoRA.

Offline on a CPU in minutes, fixed seeds: 1. SFT warm start (`sft`, shipped in `data/mini/`), 2. the Sanity
construction (`sanity`), 3. GRPO with LoRA rank 1 once per `loss_backend` (docs/reward_curves.md).
`run_reward_curves` writes a long-format CSV (`backend, step, metric, value` + machine/versions columns), a PNG
and a JSON summary; `python -m grpo_lab.tasks.reward_curves --variant gpu --out DIR` is the bigger GPU variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from transformers.trainer_callback import PrinterCallback

from grpo_lab.lab.files import write_atomically
from grpo_lab.lab.live_board import LiveBoard, Series, fig_to_png
from grpo_lab.lab.records import run_record
from grpo_lab.loss.backends import BACKEND_COLORS, LOSS_BACKENDS, resolve_backend
from grpo_lab.models.hf_compat import checkpointing_args, upstream_deprecations_silenced
from grpo_lab.tasks.board import BoardCallback
from grpo_lab.tasks.recipe import check_lora_grpo
from grpo_lab.tasks.rewards import math_reward
from grpo_lab.tasks.sanity import sanity_filter
from grpo_lab.tasks.sft import load_warm_start, pass_rates, sft_warm_start, shipped_warm_start
from grpo_lab.tasks.tiny import TinyModelConfig, addition_problems, build_char_tokenizer, build_tiny_model

METRICS = {  # CSV metric name -> TRL log key
    "reward": "reward", "reward_std": "reward_std", "loss": "loss", "kl": "kl", "entropy": "entropy",
    "clip_ratio": "clip_ratio/region_mean", "frac_reward_zero_std": "frac_reward_zero_std",
    "completion_length": "completions/mean_length", "grad_norm": "grad_norm",
}


@dataclass
class EmbeddedConfig:
    """The embedded default (offline, CPU). Every field is a knob of notebook 03."""
    seed: int = 0
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    device: str = "cpu"
    # 1. SFT warm start
    warm_start: str | None = "shipped"   # "shipped" (data/mini), a path, or None = train from scratch now
    sft_target_pass_rate: float = 0.4
    sft_max_steps: int = 3000
    sft_lr: float = 3e-3
    sft_batch_size: int = 128
    # 2. Sanity construction
    n_candidates: int = 3000
    sanity_k: int = 8
    sanity_lo: float = 0.2
    sanity_hi: float = 0.8
    n_heldout: int = 300
    # 3. GRPO (LoRA rank 1 as the recipe)
    steps: int = 300
    prompts_per_step: int = 32
    num_generations: int = 8
    learning_rate: float = 3e-3
    lora_r: int = 1
    lora_alpha: int = 2
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 8
    max_context: int = 32
    # loss_backend values, each run once from the same seed; the first is the parity reference; liger is skipped
    # when liger-kernel is not installed
    backends: tuple[str, ...] = LOSS_BACKENDS
    eval_k: int = 8
    cpu_threads: int | None = None   # torch CPU threads for the run (1 avoids OpenMP oversubscription on a shared box)

    def validate(self, prompt_lengths: list[int] | None = None):
        check_lora_grpo(self.lora_r, self.num_generations, self.learning_rate)
        if self.prompts_per_step < 1 or self.steps < 1:
            raise ValueError("prompts_per_step and steps must be >= 1.")
        if not self.backends:
            raise ValueError(f"No loss backend to run; choose from {', '.join(LOSS_BACKENDS)} ('liger' is dropped "
                             "when liger-kernel is not installed).")
        for name in self.backends:
            resolve_backend(name)
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"Each backend once (got {list(self.backends)}): the curves are keyed by backend name.")
        if self.eval_k < 1:
            raise ValueError(f"eval_k must be >= 1 (got {self.eval_k}): samples per held-out problem.")
        if self.max_completion_length >= self.max_context:
            raise ValueError(f"max_completion_length {self.max_completion_length} leaves no room for a prompt in "
                             f"a context of {self.max_context}.")
        if prompt_lengths:
            check_prompt_lengths(prompt_lengths, self.max_context, self.max_completion_length)


def check_prompt_lengths(lengths: list[int], max_context: int, max_completion_length: int):
    longest = max(lengths)
    if longest + max_completion_length > max_context:
        raise ValueError(f"A prompt of {longest} tokens plus max_completion_length={max_completion_length} exceeds "
                         f"the context of {max_context} tokens; raise max_context, shorten completions or drop "
                         "long prompts.")


VARIANTS = {  # --variant: changes to the embedded default (the CPU run)
    "embedded": {},
    # the bigger variant for one H200 (~5 min): the warm start retrained from scratch on the GPU, 4/3 x the
    # candidates, 2x the prompts per step (64 x 8 = 512 completions), all four backends, fp32, TF32 off.
    # The model keeps the CPU architecture: a 2x wider one (--hidden 256) was still on the SFT plateau (sampled pass
    # rate < 0.1) after 1,200 steps in a CPU check, where the default width leaves it at ~525 steps.
    "gpu": dict(warm_start=None, sft_max_steps=4000, n_candidates=4000, n_heldout=500, steps=300, prompts_per_step=64,
                backends=LOSS_BACKENDS, device="cuda"),
    "tiny": dict(steps=3, prompts_per_step=4, num_generations=4, n_candidates=400, n_heldout=20, eval_k=4),
}


@dataclass
class Prepared:
    tokenizer: object
    base_state: dict
    train_rows: list[dict]
    heldout_rows: list[dict]
    info: dict


def prepare(cfg: EmbeddedConfig, log=print) -> Prepared:
    """Steps 1-2: the warm-started tiny model and the Sanity-filtered train/held-out problems."""
    cfg.validate()
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, cfg.model, seed=cfg.seed).to(cfg.device)
    train_pool, held_pool = addition_problems(seed=cfg.seed)
    info: dict = {}
    t0 = time.perf_counter()
    src = cfg.warm_start
    if src == "shipped":
        src = shipped_warm_start()
        if not src.exists() or cfg.model != TinyModelConfig() or cfg.seed != 0:
            src = None
    if src is not None:
        load_warm_start(model, src)
        info["sft"] = {"source": str(Path(src).name)}
    else:
        sft = sft_warm_start(model, tok, train_pool, target_pass_rate=cfg.sft_target_pass_rate,
                             max_steps=cfg.sft_max_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size,
                             seed=cfg.seed, log=log)
        info["sft"] = {k: v for k, v in sft.items() if k != "history"} | {"source": "trained"}
        if not sft["reached"]:
            log(f"warning: SFT stopped at pass rate {sft['pass_rate']:.3f} < target {cfg.sft_target_pass_rate}")
    info["sft"]["seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cands = train_pool[:cfg.n_candidates]
    kept, stats = sanity_filter(model, tok, cands, k=cfg.sanity_k, lo=cfg.sanity_lo, hi=cfg.sanity_hi,
                                seed=cfg.seed + 1)
    held, _ = sanity_filter(model, tok, held_pool[:cfg.n_heldout * 3], k=cfg.sanity_k, lo=cfg.sanity_lo,
                                 hi=cfg.sanity_hi, seed=cfg.seed + 2)
    held = held[:cfg.n_heldout]
    info["sanity"] = stats | {"seconds": time.perf_counter() - t0, "heldout_kept": len(held)}
    if len(kept) < cfg.prompts_per_step:
        raise ValueError(f"The Sanity construction kept only {len(kept)} problems (< prompts_per_step="
                         f"{cfg.prompts_per_step}) at a mean pass rate of {stats['mean_pass_rate_all']:.3f}; raise "
                         "n_candidates, widen [sanity_lo, sanity_hi], or (warm start trained here) raise "
                         "sft_max_steps so the SFT gets past its plateau.")
    cfg.validate([len(tok(r["problem"])["input_ids"]) for r in kept + held])
    log(f"warm start: {info['sft']}; Sanity construction kept {len(kept)}/{len(cands)} "
        f"(mean pass rate {stats['mean_pass_rate_kept']:.3f}), held-out {len(held)}")
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return Prepared(tok, state, kept, held, info)


def available_backends(backends) -> tuple[str, ...]:
    """Drop 'liger' when liger-kernel is not installed (and say so)."""
    if "liger" in backends and importlib.util.find_spec("liger_kernel") is None:
        print("liger-kernel not installed: skipping the 'liger' backend")
        return tuple(b for b in backends if b != "liger")
    return tuple(backends)


def _base_model(cfg: EmbeddedConfig, prep: Prepared):
    """The warm-started model every backend's run starts from."""
    model = build_tiny_model(prep.tokenizer, cfg.model, seed=cfg.seed)
    model.load_state_dict(prep.base_state)
    return model.to(cfg.device)


def build_embedded_trainer(cfg: EmbeddedConfig, prep: Prepared, loss_backend: str, output_dir: str, callbacks=()):
    """Step 3: a TRL GRPO trainer (LoRA rank cfg.lora_r on all linear layers) on the kept problems."""
    import datasets
    from peft import LoraConfig

    from grpo_lab.loss import GRPOLabConfig as Config, GRPOLabTrainer as Trainer  # TRL: only when a run trains

    model = _base_model(cfg, prep)
    ds = datasets.Dataset.from_list([{"prompt": r["problem"], "answer": r["answer"]} for r in prep.train_rows])
    args = Config(
        output_dir=output_dir, max_steps=cfg.steps, learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        num_generations=cfg.num_generations, steps_per_generation=1, gradient_accumulation_steps=1,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, beta=cfg.beta,
        logging_steps=1, save_strategy="no", report_to="none", seed=cfg.seed, data_seed=cfg.seed,
        use_cpu=cfg.device == "cpu", bf16=False, dataloader_num_workers=0,
        disable_tqdm=True, loss_backend=loss_backend, **checkpointing_args(False),
    )
    peft = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear", lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    trainer = Trainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=ds,
                      processing_class=prep.tokenizer, peft_config=peft, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # the board / recorder report progress instead of printed dicts
    return trainer


def run_grpo(cfg: EmbeddedConfig, prep: Prepared, loss_backend: str, heldout_start: float,
             board: LiveBoard | None = None, log=print) -> dict:
    """One GRPO run; returns per-step records and the held-out pass rate before/after."""
    rec = BoardCallback(board, keys={**METRICS, "step_time": "step_time"})
    # PEFT (wrapping the model) and TRL (around generation) read the deprecated `is_gradient_checkpointing`
    with tempfile.TemporaryDirectory(prefix="grpo_lab_rc_") as tmp, upstream_deprecations_silenced():
        trainer = build_embedded_trainer(cfg, prep, loss_backend, tmp, callbacks=[rec])
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        model = trainer.model
        held_end = _mean(pass_rates(model, prep.tokenizer, prep.heldout_rows, k=cfg.eval_k, seed=cfg.seed + 7))
    rewards = [r["reward"] for r in rec.rows if r["reward"] is not None]
    w = max(1, min(20, len(rewards) // 5))
    out = {"backend": loss_backend, "rows": rec.rows, "seconds": seconds, "heldout_start": heldout_start,
           "heldout_end": held_end, "reward_start": _mean(rewards[:w]), "reward_end": _mean(rewards[-w:]),
           "window": w}
    log(f"[{loss_backend}] {len(rec.rows)} steps in {seconds:.0f}s: reward {out['reward_start']:.3f} -> "
        f"{out['reward_end']:.3f} (first/last {w} steps); held-out {heldout_start:.3f} -> {held_end:.3f}")
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def parity(runs: list[dict], metrics=("reward", "loss")) -> dict:
    """Largest per-step |difference| of each metric between every backend and the first one, and the first step
    at which any backend's reward differs (where the sampled rollouts stop being the same), None if never."""
    ref = {r["step"]: r for r in runs[0]["rows"]}

    def max_delta(m, before=None):  # over the steps both runs logged `m` at (before step `before`)
        return max([0.0, *(abs(a - b) for run in runs[1:] for r in run["rows"]
                           if (before is None or r["step"] < before) and (a := r.get(m)) is not None
                           and (b := ref.get(r["step"], {}).get(m)) is not None)])

    out = {f"max_abs_delta_{m}": max_delta(m) for m in metrics}
    # rollouts differ once any statistic of them does: a flipped token can swap one wrong answer for another
    # (same reward) but rarely leaves the reward spread and the completion length unchanged too
    rollout_stats = ("reward", "reward_std", "completion_length")
    diverged = [r["step"] for run in runs[1:] for r in run["rows"]
                if r.get("reward") is not None and any(r.get(k) != ref.get(r["step"], {}).get(k) for k in rollout_stats)]
    out["first_divergent_step"] = min(diverged) if diverged else None
    out["max_abs_delta_loss_before_divergence"] = max_delta("loss", out["first_divergent_step"])
    return out


BOARD_SERIES = [Series("reward", "reward (rolling mean 10)", rolling=10), Series("loss", "loss"),
                Series("entropy", "entropy"), Series("kl", "KL (beta=0: not computed)"),
                Series("clip_ratio", "clipped ratio fraction (ratio = 1 on-policy)"),
                Series("step_time", "step time [s]")]


def run_reward_curves(cfg: EmbeddedConfig, out_dir: str | os.PathLike | None = None, board: bool | str = "auto",
                      tag: str = "embedded", log=print) -> dict:
    """Steps 1-3 for every backend; writes `<out_dir>/<tag>.csv`, `.png`, `.json` when out_dir is given."""
    if cfg.cpu_threads:
        old = torch.get_num_threads()
        torch.set_num_threads(cfg.cpu_threads)
        try:
            return run_reward_curves(replace(cfg, cpu_threads=None), out_dir, board, tag, log)
        finally:
            torch.set_num_threads(old)
    t_all = time.perf_counter()
    backends = available_backends(cfg.backends)
    cfg = replace(cfg, backends=backends)
    prep = prepare(cfg, log=log)
    held_start = _mean(pass_rates(_base_model(cfg, prep), prep.tokenizer, prep.heldout_rows, k=cfg.eval_k, seed=cfg.seed + 7))
    mode = "auto" if board is True or board == "auto" else board
    lb = LiveBoard(f"GRPO {tag}", total=cfg.steps * len(backends), series=BOARD_SERIES, redraw_every_s=2.0,
                   unit="step", mode=mode).show() if board else None
    runs = []
    summary: dict = {}
    for b in backends:
        if lb is not None:
            lb.set_group(b)
        runs.append(run_grpo(cfg, prep, b, board=lb, heldout_start=held_start, log=log))
        # written after every backend, so a run cut short (a time-limited GPU call) keeps what it finished
        summary = _summarise(cfg, prep, runs, held_start, tag, t_all, out_dir, log=log)
    if lb is not None:
        lb.close()
    return summary


def _summarise(cfg: EmbeddedConfig, prep: Prepared, runs: list[dict], held_start: float, tag: str, t_all: float,
               out_dir, log=print) -> dict:
    """The long-format curves, the JSON summary and the figure of the runs so far; written when out_dir is given."""
    import pandas as pd

    env = run_record("cuda" if str(cfg.device).startswith("cuda") else "cpu")
    rows = []
    for run in runs:  # each run's logged values by step, then its held-out pass rate before and after
        points = [(r["step"], m, r[m]) for r in run["rows"] for m in [*METRICS, "step_time"]
                  if r.get(m) is not None]
        points += [(0, "heldout_pass_rate", held_start), (cfg.steps, "heldout_pass_rate", run["heldout_end"])]
        rows += [{"backend": run["backend"], "step": s, "metric": m, "value": v} for s, m, v in points]
    df = pd.DataFrame(rows)
    df["device"] = env["gpu_name"]                     # full machine/versions/date: the JSON sidecar
    df["versions"] = f"torch {env['torch']} transformers {env['transformers']} trl {env['trl']}"
    summary = {
        "tag": tag, "env": env, "config": json.loads(json.dumps(asdict(cfg), default=str)),  # tuples as lists
        "prepare": prep.info,
        "backends": {r["backend"]: {k: r[k] for k in ("reward_start", "reward_end", "heldout_start", "heldout_end",
                                                      "seconds", "window")} for r in runs},
        "parity": parity(runs) if len(runs) > 1 else {}, "total_seconds": time.perf_counter() - t_all,
        "complete": len(runs) == len(cfg.backends),
    }
    title = f"GRPO reward curves ({tag}, LoRA r={cfg.lora_r}, lr {cfg.learning_rate:g})"
    try:
        png = plot_curves(df, title=title)
    except ImportError:  # e.g. a GPU box without matplotlib: replot later with --replot
        png = None
        log("matplotlib not installed: no PNG written; render it later with "
            "`python -m grpo_lab.tasks.reward_curves --replot <csv>`")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # each file replaced whole (written aside, then renamed): a run killed mid-write leaves the last good one
        write_atomically(out / f"{tag}.csv", df.to_csv(index=False, float_format="%.7g").encode())
        if png is not None:
            write_atomically(out / f"{tag}.png", png)
        else:  # no matplotlib: drop a figure of an earlier run rather than leave it beside these curves
            (out / f"{tag}.png").unlink(missing_ok=True)
        write_atomically(out / f"{tag}.json", json.dumps(summary, indent=2, default=str).encode())
        summary["files"] = [str(out / f"{tag}.{e}") for e in ("csv", "png", "json") if png is not None or e != "png"]
    summary["df"], summary["png"] = df, png
    return summary


def read_summary(csv_or_json: str | os.PathLike) -> dict:
    """The JSON sidecar of a curves CSV, or {} when it is missing or unreadable (said on stderr)."""
    js = Path(csv_or_json).with_suffix(".json")
    if not js.exists():
        return {}
    try:
        return json.loads(js.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        print(f"warning: ignoring unreadable {js} ({e})", file=sys.stderr)
        return {}


def plot_curves(df, title: str = "", rolling: int = 10, dpi: int = 90) -> bytes:
    """Reward (raw + rolling mean), loss and entropy per backend, overlaid: the parity figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for b, g in df.groupby("backend", sort=False):
        for ax, m in zip(axes, ("reward", "loss", "entropy"), strict=True):
            s = g[g.metric == m].sort_values("step")
            if s.empty:
                continue
            line, = ax.plot(s.step, s.value, lw=0.7, alpha=0.5 if m == "reward" else 0.9, label=b,
                            color=BACKEND_COLORS.get(b))
            if m == "reward":
                ax.plot(s.step, s.value.rolling(rolling, min_periods=1).mean(), lw=2, color=line.get_color())
    for ax, m in zip(axes, ("reward (thin: per step, thick: rolling mean)", "loss", "entropy"), strict=True):
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = fig_to_png(fig, dpi=dpi)
    plt.close(fig)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description="Reward curves of the embedded default (CPU) or its GPU variant.")
    p.add_argument("--variant", choices=list(VARIANTS), default="embedded",
                   help="embedded: the CPU default; gpu: the bigger H200 variant; tiny: a seconds-long smoke run")
    p.add_argument("--out", help="output folder for <tag>.csv/.png/.json")
    p.add_argument("--replot", default=None, help="only render <csv>'s PNG next to it (no training)")
    p.add_argument("--device", default=None)
    p.add_argument("--steps", type=int, default=None)
    # the flags named after an EmbeddedConfig field (`dest`) override it when given
    p.add_argument("--backends", type=lambda s: tuple(b.strip() for b in s.split(",") if b.strip()),
                   help=f"comma list of {','.join(LOSS_BACKENDS)} (the first is the parity reference)")
    p.add_argument("--lr", dest="learning_rate", type=float, default=None)
    p.add_argument("--rank", dest="lora_r", type=int, default=None)
    p.add_argument("--G", dest="num_generations", type=int, default=None)
    p.add_argument("--prompts-per-step", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="model width (the CPU default: 128)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--sft-max-steps", type=int, default=None)
    p.add_argument("--threads", dest="cpu_threads", type=int, default=None,
                   help="torch CPU threads (1 is far faster on a shared 2-core box: no OpenMP oversubscription)")
    p.add_argument("--tag", default=None)
    a = p.parse_args(argv)
    if a.replot:
        import pandas as pd

        csv = Path(a.replot)
        if not csv.is_file():
            p.error(f"no CSV {csv}")
        c = read_summary(csv).get("config", {})
        title = f"GRPO reward curves ({csv.stem}, LoRA r={c.get('lora_r', '?')}, lr {c.get('learning_rate', '?')})"
        csv.with_suffix(".png").write_bytes(plot_curves(pd.read_csv(csv), title=title))
        print("wrote", csv.with_suffix(".png"))
        return
    if not a.out:
        p.error("--out is required")
    cfg = replace(EmbeddedConfig(), **VARIANTS[a.variant])
    names = {f.name for f in fields(EmbeddedConfig)}
    cfg = replace(cfg, **{k: v for k, v in vars(a).items() if k in names and v is not None})
    if a.hidden or a.layers:
        h = a.hidden or cfg.model.hidden_size
        cfg = replace(cfg, model=replace(cfg.model, hidden_size=h, intermediate_size=2 * h,
                                         num_hidden_layers=a.layers or cfg.model.num_hidden_layers))
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but no CUDA device is visible")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:  # prepare() validates the config before any work
        s = run_reward_curves(cfg, a.out, board=False, tag=a.tag or a.variant)
    except ValueError as e:  # a bad setting is a one-line message, not a traceback
        p.error(str(e))
    print(json.dumps({k: s[k] for k in ("backends", "parity", "total_seconds", "files")}, indent=2, default=str))


if __name__ == "__main__":
    main()
