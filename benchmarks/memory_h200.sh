#!/usr/bin/env bash
# Notebook 01's full sweep on one GPU, in two commands of a few minutes each (run them separately if a single
# command is time-limited; with --resume a rerun measures only the points still missing). Writes
# results/memory_vs_batch/memory_vs_batch.{csv,png} and ..._loss_only.png.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${1:-results/memory_vs_batch}"
python -m grpo_lab.memory.sweep --full --backends naive,trl,grpo_lab --resume --keep-going --max-minutes 5.5 --out "$OUT"
python -m grpo_lab.memory.sweep --full --backends liger --resume --keep-going --max-minutes 5.5 --out "$OUT"
