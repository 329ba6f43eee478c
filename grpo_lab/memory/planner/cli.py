"""`grpo-lab plan`: the predicted peak memory and max batch of a GRPO setting, before renting the GPUs.

    grpo-lab plan --model Qwen3-8B --gpus 4 --gib 80 --dtype bf16 --lora-r 16 --loss-backend grpo_lab \\
                  --prompt 256 --completion 512 [--batch 64] [--no-checkpointing] [--world-sizes 1-8]

Prints the largest per-GPU batch that fits, the peak at `--batch` (default: that max batch) with its terms, and with
`--world-sizes` the max batch over GPU counts: predictions, validated on one H200 (results/memory_planner/).
"""

from __future__ import annotations

import argparse
import sys

from grpo_lab.loss.backends import BACKEND_HELP, DEFAULT_LOSS_BACKEND

from .predict import GiB, PlannerConfig, max_batch, max_batch_band, plan
from ..results import cli_error
from ..spec import parse_int_list


def _world_sizes(text: str) -> list[int]:
    """"1-8" (a range) or "1,2,4,8"."""
    if "-" not in text:
        return parse_int_list(text, "world sizes")
    lo, hi = parse_int_list(text.split("-", 1), "--world-sizes")
    if lo > hi:
        raise ValueError(f"--world-sizes: give an increasing range of positive integers, got {text!r}")
    return list(range(lo, hi + 1))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="grpo-lab plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-8B", help="a config in data/configs (Qwen3-0.6B … Qwen3-14B, "
                                                       "Qwen2.5-Math-1.5B) or a tiny preset")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of one FSDP2 group (default 1)")
    ap.add_argument("--gib", type=float, default=80.0, help="memory per GPU in GiB (default 80)")
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp32")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank on all linear layers; 0 = full fine-tuning")
    ap.add_argument("--loss-backend", "--backend", dest="loss_backend", default=DEFAULT_LOSS_BACKEND,
                    help=f"{BACKEND_HELP} (--backend: the older name)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=512, help="completion tokens per sequence")
    ap.add_argument("--batch", type=int, default=None, help="sequences per GPU to show the peak of "
                                                            "(default: the max batch)")
    ap.add_argument("--no-checkpointing", action="store_true", help="activation checkpointing off (TRL: on)")
    ap.add_argument("--fsdp-single", action="store_true", help="FSDP2 even on one GPU (as notebook 02 measures)")
    ap.add_argument("--headroom", type=float, default=None,
                    help="share of each GPU lost to allocator fragmentation (default: the calibrated value)")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: 2 %% headroom instead of the "
                         "default allocator's 12 %% (fused heads), and a tighter max batch")
    ap.add_argument("--world-sizes", default=None, help="also tabulate the max batch over GPU counts, e.g. 1-8")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.gib <= 0:
            raise ValueError(f"--gib must be positive, got {a.gib}")
        if a.headroom is not None and not 0 <= a.headroom < 1:
            raise ValueError(f"--headroom must be in [0, 1), got {a.headroom}")
        if a.expandable_segments and a.headroom is not None:
            raise ValueError("give --headroom or --expandable-segments, not both")
        base = PlannerConfig(model=a.model, loss_backend=a.loss_backend, dtype=a.dtype, lora_r=a.lora_r,
                             world_size=a.gpus, fsdp=a.gpus > 1 or a.fsdp_single, prompt_len=a.prompt,
                             completion_len=a.completion, gradient_checkpointing=not a.no_checkpointing,
                             batch_size=a.batch or 1, expandable_segments=a.expandable_segments)
        sizes = _world_sizes(a.world_sizes) if a.world_sizes else None
    except ValueError as e:
        return cli_error(e)
    gpus = f"{a.gpus} GPU{'s' if a.gpus > 1 else ''} × {a.gib:g} GiB" + (" (FSDP2)" if base.fsdp else "")
    print(f"{a.model}, {a.loss_backend}, {base.dtype}, "
          f"{'LoRA r=' + str(a.lora_r) if a.lora_r else 'full fine-tuning'}, {a.prompt}+{a.completion} tokens, "
          f"{gpus}, activation checkpointing {'off' if a.no_checkpointing else 'on'}")
    best = max_batch(base, a.gib, headroom=a.headroom)
    note = "predicted" + ("" if a.gpus == 1 else f", {a.gpus} GPUs: not measured here")
    usable = best.usable_bytes / GiB
    if best.batch == 0:
        print(f"max batch per GPU: 0 ({note}) — even one sequence needs {best.peak_bytes / GiB:.1f} GiB of "
              f"{usable:.1f} usable")
    else:
        more = " or more (capped)" if best.capped else ""
        print(f"max batch per GPU: {best.batch}{more} ({note}; {best.batch * a.gpus} sequences per step over all "
              f"GPUs) — peak {best.peak_bytes / GiB:.1f} GiB of {usable:.1f} usable "
              f"({a.gib:g} GiB less the allocator's headroom)")
    band = max_batch_band(base, a.gib) if a.headroom is None and best.batch and not best.capped else None
    if band is not None:
        print(f"  the default CUDA allocator loses 7-17 % to fragmentation at the limit, so the true limit can lie "
              f"anywhere in {band[0]}-{band[1]} (every H200 search so far did); with "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (plan with --expandable-segments) all 16 H200 "
              "searches of notebook 02 and all 10 probe pairs were within one search step, and the limit is higher")
    shown = plan(base.replace(batch_size=a.batch or max(1, best.batch)))
    print(f"peak at batch {shown.config.batch_size}: {shown.peak_gib:.2f} GiB per GPU ({note}), "
          f"in phase {shown.peak_phase}:")
    for name, gib in shown.breakdown().items():
        print(f"  {name:<36} {gib:9.3f} GiB")
    if sizes:
        print("max batch per GPU over GPU counts (predicted):")
        print("  GPUs  " + "  ".join(f"{w:>6}" for w in sizes))
        row = [max_batch(base.replace(world_size=w, fsdp=w > 1 or base.fsdp), a.gib, headroom=a.headroom).batch
               for w in sizes]
        print("  batch " + "  ".join(f"{b:>6}" for b in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
