#!/usr/bin/env bash
# The async loop's H200 figures, in one device call of <= 10 minutes (issue 15): run from the repo root on the GPU box
# after `source benchmarks/h200_prelude.sh` (installs the carried wheels, leaves the shell in /root/run, REPO set):
#     source benchmarks/h200_prelude.sh && bash $REPO/benchmarks/async_h200.sh $OUT
# 1. GPU tests: FlexAttention tree attention against SDPA, and the kernel's frozen-head GPU tests not yet run;
# 2. the async trainer's step with sdpa vs flex tree attention at the recipe's packed size (Qwen2.5-Math-1.5B shape,
#    random init, token_budget 16384, LoRA r=1, bf16);
# 3. the whole loop for the tiny recipe with the trainer on the H200 and CPU replicas on the host's cores, 25 steps
#    each: 2 replicas with TRL's default in flight (-1: max_staleness x samples per step = 64), 2 with 16 in flight
#    (the doctor's first knob on that run: staleness-bound), and 4 replicas with the default.
# Writes $OUT/async/*.csv (+ verdicts, logs) to commit under results/async/.
# PARTS picks what runs (default all three: "tests bench loop"); `PARTS=loop` fits the loops alone in one call, with
# LOOP_TIMEOUT (default 170 s) per loop: the first step includes startup, the replicas' load and flex's compile (each
# loop took 58-64 s on 2026-12-03).
set -uo pipefail
OUT="${1:?output folder}"
REPO="${REPO:-$(cd "$(dirname "$0")/.." && pwd)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT/async"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/async/machine.txt" 2>&1
python3 -c "import torch, transformers, trl, peft; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)" >> "$OUT/async/machine.txt"

PARTS="${PARTS:-tests bench loop}"
LOOP_TIMEOUT="${LOOP_TIMEOUT:-170}"
if [[ " $PARTS " == *" tests "* ]]; then
timeout 200 python3 -m pytest -q -m gpu "$REPO/tests/async_loop/test_tree_attention.py" \
  "$REPO/tests/core/test_frozen_head.py" "$REPO/tests/kernels/test_fused_kernel_gpu.py" \
  -k "flex or frozen or materialized" --rootdir "$REPO" -p no:cacheprovider > "$OUT/async/pytest_gpu.log" 2>&1
tail -5 "$OUT/async/pytest_gpu.log"
fi
if [[ " $PARTS " == *" bench "* ]]; then

timeout 220 python3 "$REPO/benchmarks/tree_attention_bench.py" --out "$OUT/async" > "$OUT/async/tree_bench.log" 2>&1
grep -E "ms/row|wrote|Error" "$OUT/async/tree_bench.log"
fi
if [[ " $PARTS " == *" loop "* ]]; then

for run in "2 -1 loop_h200_2replicas" "2 16 loop_h200_2replicas_inflight16" "4 -1 loop_h200_4replicas"; do
  read -r n inflight name <<< "$run"
  timeout "$LOOP_TIMEOUT" python3 -m grpo_lab.async_loop.launch --max-steps 25 --replicas "$n" --replica-threads 3 \
    --max-inflight-tasks "$inflight" --output-dir "/root/$name" --save-steps 1000 --results-dir "$OUT/async" \
    --run-name "$name" > "$OUT/async/$name.log" 2>&1
  grep -E "^step 25|done|wrote|Error" "$OUT/async/$name.log"
  python3 -m grpo_lab.async_loop.doctor "/root/$name" --max-staleness 4 --replica-kind cpu 2>&1 | head -3
done
fi
ls -la "$OUT/async"
