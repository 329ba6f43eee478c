#!/usr/bin/env bash
# The memory planner's held-out check on one H200: about 3 minutes of probes (capped at 2.8 by --max-minutes).
# Writes OUT/planner_heldout_h200.csv: the harness's row for every point plus the planner's prediction and error.
# Points (grpo_lab.memory.planner.check.heldout_h200_points): Qwen2.5-Math-1.5B (an architecture no constant was
# fitted to) with the grpo_lab kernel's frozen head, LoRA r=64, 512 + 1024 tokens, FSDP2 at world size 1: B = 8;
# 3 % below and above the planner's max batch with the default allocator (the first should fit, the second not);
# Qwen3-4B full fine-tuning (trl, bf16, 256 + 512, B = 16); the max-batch pair again with expandable_segments.
# Run from the repo root on the GPU box, with a wheel of this branch among the carried wheels:
#     source benchmarks/h200_prelude.sh && bash $REPO/benchmarks/planner_h200.sh $OUT
set -euo pipefail
OUT="${1:?usage: benchmarks/planner_h200.sh OUTPUT_FOLDER}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -m grpo_lab.memory.planner.check --preset heldout_h200 --max-minutes 2.8 --overwrite --out "$OUT" 2>&1 \
  | grep -v Warning
