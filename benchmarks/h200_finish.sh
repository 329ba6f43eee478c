#!/usr/bin/env bash
# The H200 steps that finish (or refresh) the committed results, one device call of <= 10 minutes each. Run from the
# repo root on the GPU box after `source benchmarks/h200_prelude.sh` (which leaves the shell in /root/run with the
# repo in $REPO), e.g.
#     source benchmarks/h200_prelude.sh && bash $REPO/benchmarks/h200_finish.sh sweep $OUT
# Each step copies the committed CSVs into OUT first and resumes from them, so OUT ends up holding the complete
# files to commit back into results/ (and a step cut by its time limit can simply be run again).
# Status (2026-12-02, third device session): kernels, fsdp and liger-fsdp ran (their results are committed; rerun,
# fsdp and liger-fsdp find every search finished and probe nothing). Still to run: sweep, liger-curves.
set -uo pipefail
STEP="${1:?step: kernels | fsdp | sweep | liger-fsdp | liger-curves}"
OUT="${2:?output folder}"
REPO="${REPO:-$(cd "$(dirname "$0")/.." && pwd)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

case "$STEP" in
  kernels)  # the GPU tests (every kernel variant, ~4 min), then the loss grid (cut cleanly at its time budget)
    mkdir -p "$OUT/kernels"
    timeout 300 python3 -m pytest -q -m gpu "$REPO/tests/kernels" --rootdir "$REPO" -p no:cacheprovider \
      > "$OUT/kernels/pytest.log" 2>&1; tail -15 "$OUT/kernels/pytest.log"
    timeout 330 python3 "$REPO/benchmarks/loss_bench.py" --max-minutes 5 --out "$OUT/kernels" \
      > "$OUT/kernels/bench.log" 2>&1; grep -v Warning "$OUT/kernels/bench.log" | tail -45
    ;;
  fsdp)  # notebook 02: grpo_lab on Qwen3-4B, and the end of its Qwen3-8B search (4 probes from the committed ones)
    mkdir -p "$OUT/fsdp" && cp "$REPO"/results/fsdp_max_batch/fsdp_max_batch{,_probes}.csv "$OUT/fsdp/"
    python3 -m grpo_lab.memory.max_batch --full --default-allocator --models Qwen3-8B,Qwen3-4B --backends grpo_lab --resume \
      --keep-going --max-minutes 8 --out "$OUT/fsdp" 2>&1 | grep -v Warning | tail -40
    ;;
  sweep)  # notebook 01: the one preset point not measured (liger fp32 B=96)
    mkdir -p "$OUT/mem" && cp "$REPO"/results/memory_vs_batch/memory_vs_batch.csv "$OUT/mem/"
    python3 -m grpo_lab.memory.sweep --full --backends liger --resume --keep-going --max-minutes 8 \
      --out "$OUT/mem" 2>&1 | grep -v Warning | tail -30
    ;;
  liger-fsdp)  # notebook 02's liger bars (all four sizes; rerun to continue if cut)
    mkdir -p "$OUT/fsdp" && cp "$REPO"/results/fsdp_max_batch/fsdp_max_batch{,_probes}.csv "$OUT/fsdp/"
    python3 -m grpo_lab.memory.max_batch --full --default-allocator --backends liger --resume --keep-going --max-minutes 8 \
      --out "$OUT/fsdp" 2>&1 | grep -v Warning | tail -40
    ;;
  liger-curves)  # notebook 03: the liger curve of the GPU variant (its own tag; merge with h200.csv afterwards)
    mkdir -p "$OUT/rc"
    timeout 560 python3 -m grpo_lab.tasks.reward_curves --variant gpu --device cuda --backends liger \
      --out "$OUT/rc" --tag h200_liger 2>&1 | grep -v Warning | tail -20
    ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
ls -la "$OUT"/* 2>/dev/null
