"""A run's peak memory with the kernel's real defaults (issue 45): notebook 01's setting, measured without resets.

Notebook 01's probes reset the allocator's peak at every phase and pin the trainable head's flat path, so their
figures say nothing about what the library does left alone. Here each variant is one fresh process that trains
`--steps` real TRL GRPO steps (`grpo_lab.memory.grpo_step.make_trainer`: Qwen3-0.6B random init, 256 + 512 tokens,
synthetic rollouts, full fine-tuning, TRL's activation checkpointing) and reads the allocator's high-water mark after
every step, never resetting it: the run's peak as a user would see it. Variants of the memory policy
(`grpo_lab.loss.kernel.tuning.KernelTuning`):
  - `defaults`: as shipped (the buffer only under the run's peak);
  - `flat`: the policy off (`materialize_fraction` = 0), what the probes pin;
  - `free`: the peak rule off (`materialize_within_peak` = False), the default before issue 45.
Prints one line per (variant, B) with the peak after each step and the paths the head took; `--out` writes a CSV
with the machine, versions and date.

    python benchmarks/step_peak.py --batch-sizes 16,64 --out results/loss_kernel/issue45
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from loss_bench import POLICY_OF, write_csv  # noqa: E402  (the policy variants, written once there)

from grpo_lab.memory.spec import parse_int_list  # noqa: E402

# each variant's memory-policy fields: loss_bench's `grpo_lab+…` backends of the same meaning
VARIANTS = {"defaults": {}, "flat": POLICY_OF["grpo_lab+flat"], "free": POLICY_OF["grpo_lab+free"]}


def measure(variant: str, batch_size: int, steps: int, dtype: str) -> dict:
    """One run in this process: the allocator's peak after each step (never reset) and the head's paths."""
    import torch
    from transformers import TrainerCallback

    from grpo_lab.loss.kernel import path_counts, reset_path_counts
    from grpo_lab.loss.kernel.tuning import TUNING
    from grpo_lab.memory.grpo_step import make_trainer
    from grpo_lab.memory.spec import PointSpec

    for name, value in VARIANTS[variant].items():
        setattr(TUNING, name, value)
    peaks, times = [], []

    class Peaks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            times[-1] = time.perf_counter() - times[-1]
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)

    spec = PointSpec(model="Qwen3-0.6B", loss_backend="grpo_lab", dtype=dtype, batch_size=batch_size,
                     prompt_len=256, completion_len=512, steps=steps, device="cuda")
    torch.cuda.set_device(0)
    reset_path_counts()
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(spec, out, torch.device("cuda", 0), callbacks=[Peaks()])
        torch.cuda.reset_peak_memory_stats()  # once, before the first step: the run's peak from here on
        trainer.train()
    counts = path_counts()
    return {"variant": variant, "B": batch_size, "dtype": dtype, "steps": steps,
            "run_peak_gib": round(max(peaks), 3), "peak_after_step_gib": " ".join(f"{p:.3f}" for p in peaks),
            "step_s": " ".join(f"{t:.2f}" for t in times),
            "paths": " ".join(f"{k}:{v}" for k, v in vars(counts).items() if v)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="16,64", help="comma-separated positive ints (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)} (default: all)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--out", default=None, help="folder for step_peak.csv")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "variant:B", run in this process
    a = p.parse_args(argv)
    if a.one:
        variant, b = a.one.split(":")
        print("RESULT " + json.dumps(measure(variant, int(b), a.steps, a.dtype)), flush=True)
        return 0
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    try:
        batch_sizes = parse_int_list(a.batch_sizes)
        if a.steps < 1:
            raise ValueError(f"--steps must be a positive integer, got {a.steps}.")
    except ValueError as err:
        p.error(str(err))
    from grpo_lab.lab.records import run_record

    meta = run_record("cuda")
    rows = []
    for b in batch_sizes:
        for variant in a.variants.split(","):
            proc = subprocess.run([sys.executable, __file__, "--one", f"{variant}:{b}", "--steps", str(a.steps),
                                   "--dtype", a.dtype], capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{variant:9s} B={b:3d} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            row = {**json.loads(lines[-1][len("RESULT "):]), **meta}
            rows.append(row)
            print(f"{variant:9s} B={b:3d} {a.dtype} run peak {row['run_peak_gib']:7.3f} GiB  after each step "
                  f"[{row['peak_after_step_gib']}]  s/step [{row['step_s']}]  paths {row['paths']}", flush=True)
            if a.out:  # after every run, so that a run cut short keeps what it measured
                os.makedirs(a.out, exist_ok=True)
                write_csv(os.path.join(a.out, "step_peak.csv"), rows)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
