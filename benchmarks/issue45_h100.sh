# Issue 45 on one H100/H200, run from the repo root by the device tool: `bash benchmarks/issue45_h100.sh PHASE`.
# Installs the carried wheels (.whl/: trl, datasets and its needs, liger-kernel) and runs this checkout's grpo_lab.
#   check  the memory policy's GPU tests; notebook 01's run peak (benchmarks/step_peak.py: real TRL steps, Qwen3-0.6B,
#          256+512 tokens, bf16, B = 16 and 64) with the defaults, the flat path pinned and the peak rule off; a
#          kernel profile; fp32 dX/dW through Triton's split-TF32 matmul against cuBLAS SGEMM
#   grid   the loss-head grid with repeats (naive / TRL / grpo_lab / grpo_lab+free) and the cuBLAS floor of each cell
#   tests  the whole GPU test suite of the kernel
#   ab     the leaner epilogue against an older checkout ($OLD, a copy of its grpo_lab/ carried beside this one,
#          optional): the head alone (the tile sweep's timing), old and new, flat and materialised, dZ through
#          descriptors; then the bar cells of the grid with their cuBLAS floor
#   quick  the kernel's GPU tests (not the TRL-trainer or memory-policy ones), the bar's cells, the head alone
#   last   under five minutes: the kernel's GPU tests, then the bar's cells against TRL and the floor
#   confirm  every GPU test, then the head alone with the defaults set from `sweep` against the old ones and the
#          materialised backward with / without its elementwise pass (benchmarks/tune_dz_free.json), the bar's
#          cells, and a kernel profile of the frozen and materialised heads
#   grid2  the grid in two calls (PART 1 or 2): the GPU tests, an A/B of the head alone and the bar's cells first
#   timeline  where the GPU waits in a loss step: its idle gaps and what the host did meanwhile, frozen and
#          trainable heads against TRL (benchmarks/step_timeline.py), the card's clocks sampled beside
#   once   under 10 minutes: every GPU test, the frozen head's timeline, the bar's cells, the frozen P~ buffer widened
#   split  every GPU test; the fp32 trainable head's split-TF32 dX / dW (the default) against naive and the old
#          cuBLAS backward; the frozen head's direct chunk launches (opt-in) against Triton's JIT dispatch
#   sweep  the Triton main loop against cuBLAS with and without the epilogue (benchmarks/mainloop_probe.py), then
#          the head alone over benchmarks/tune_lean_epilogue.json (frozen tiles now that the epilogue is lean,
#          two programs per SM, dZ through descriptors, the materialised forward's tile)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/card.txt"
OUT_DIR="$OUT"
BAR_CELLS=frozen:bf16:1024:32768,trainable:bf16:1024:32768,frozen:bf16:4096:8192,trainable:bf16:4096:8192
step_peak() {  # TIMEOUT STEPS: notebook 01's run peak; its trainer reads the package's data files, which exist only in
  # an installed copy (grpo_lab.data_files is data/ mapped at install), so the checkout is installed beside the wheels
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/gl . >/dev/null 2>&1
  PYTHONPATH=/tmp/site:/tmp/gl timeout "$1" python3 benchmarks/step_peak.py --batch-sizes 16,64 --steps "$2" \
    --out "$OUT_DIR" 2>&1 | grep -v Warn
}
both() {  # SHAPE...: the frozen and trainable cells of each dtype:H:tokens shape, as --points
  for x in "$@"; do printf 'frozen:%s,trainable:%s,' "$x" "$x"; done
}
gpu_tests() {  # TIMEOUT: every GPU test of the kernel and the loss, over 4 pytest-xdist workers when it is carried
  python3 -c "import xdist" 2>/dev/null && WORKERS="-n 4" || WORKERS=""
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider $WORKERS tests/kernels tests/core 2>&1 \
    | tee "$OUT_DIR/pytest_gpu.log" | tail -15
}
tune_with() {  # FILE TIMEOUT: the head alone (bf16, H 1024 / 4096, 32k tokens) over the experiments of FILE
  timeout "$2" python3 benchmarks/loss_bench.py --tune --out "$OUT_DIR/tune" --hidden 1024,4096 --tokens 32768 \
    --dtypes bf16 --experiments "$1" 2>&1 | grep '^tune'
}
kernel_tests() {  # TIMEOUT: the GPU tests of the kernel paths (not the TRL-trainer or memory-policy ones)
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_kernel_gpu.py -k "float64 or \
variants or bias_softcap or top1 or grad_only or masked or rows_recomputed or fp32_as_accurate or against_trl" 2>&1 \
    | tee "$OUT_DIR/pytest_kernels.log" | tail -6
}
bar_cells() {  # TIMEOUT BACKENDS BUDGET POINTS: grid cells with two repeats and their cuBLAS floor
  timeout "$1" python3 benchmarks/loss_bench.py --out "$OUT_DIR" --no-accuracy --no-issue-rows --repeats 2 \
    --backends "$2" --budget-s "$3" --points "$4" 2>&1 | tee "$OUT_DIR/bench.log" | grep ' ms ' | tail -40
}
head_alone() {  # OLD_TIMEOUT NEW_TIMEOUT TOKENS: the tile sweep's timing of the head alone, bf16, H 1024 / 4096;
  # the older checkout's (a copy of its grpo_lab/ in $OLD) only when OLD is set
  [ -n "${OLD:-}" ] && PYTHONPATH=/tmp/site:$PWD/$OLD timeout "$1" python3 benchmarks/loss_bench.py --tune \
    --out "$OUT_DIR/old" --hidden 1024,4096 --tokens "$3" --dtypes bf16 \
    --experiments '{"bf16": [{}, {"materialize_gib": 48}]}' 2>&1 | grep '^tune' | sed 's/^/old /'
  timeout "$2" python3 benchmarks/loss_bench.py --tune --out "$OUT_DIR/new" --hidden 1024,4096 --tokens "$3" \
    --dtypes bf16 --experiments '{"bf16": [{}, {"materialize_gib": 48}, {"dz_tma": true}]}' 2>&1 | grep '^tune' \
    | sed 's/^/new /'
}
sample_clocks() {  # the card's clocks, power, temperature and throttle reasons every 250 ms into clocks.csv; SMI: its PID
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv \
    -lms 250 > "$OUT_DIR/clocks.csv" 2>&1 &
  SMI=$!
}
wide_buffer() {  # TIMEOUT REPS POINTS: the frozen P~ buffer against the default (8192 x 8448: 64 row tiles x 33 blocks
  # of 256 are 2112 tiles, whole waves of 132 SMs), interleaved rounds: the old 8192 x 8192 (the last of 16 waves half
  # empty), 8192 x 16384 and 8192 x 16896 (66 blocks, whole waves again), and the default without the backward's wait
  # for the rows check (`_no_rescue`, a diagnostic: what that host sync costs a step)
  timeout "$1" python3 benchmarks/small_head_probe.py --out "$OUT_DIR" --rounds 3 --reps "$2" --points "$3" \
    --variants '{"default": {}, "vocab8k": {"frozen_tile": {"16": [8192, 8192]}}, "vocab16k": {"frozen_tile": {"16":
    [8192, 16384]}}, "wave66": {"frozen_tile": {"16": [8192, 16896]}}, "no_rescue": {"_no_rescue": true}}' 2>&1 | grep '^H='
}
case "$1" in
check)
  timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_kernel_gpu.py \
    -k "policy or peak or short_of_memory" 2>&1 | tee "$OUT_DIR/pytest_policy.log" | tail -5
  step_peak 240 4
  timeout 100 python3 benchmarks/loss_bench.py --out "$OUT_DIR/profile" --no-issue-rows --no-accuracy \
    --profile frozen:bf16:1024:32768,trainable:bf16:1024:32768,frozen:bf16:4096:8192 \
    --points frozen:bf16:1024:2048 --backends grpo_lab --budget-s 0.2 2>&1 | grep -v '^ *$' | tail -60
  P=trainable:fp32:1024:8192,trainable:fp32:4096:2048,trainable:fp32:4096:8192
  timeout 90 python3 benchmarks/loss_bench.py --out "$OUT_DIR/fp32_cublas" --no-issue-rows --no-accuracy --points $P \
    --backends naive,grpo_lab --budget-s 1 --floor-reps 1 2>&1 | grep ' ms ' | tail -8
  GRPO_LAB_FP32_MM=triton timeout 60 python3 benchmarks/loss_bench.py --out "$OUT_DIR/fp32_triton" --no-issue-rows \
    --no-accuracy --points $P --backends grpo_lab --budget-s 1 --floor-reps 1 2>&1 | grep ' ms ' | tail -4
  ;;
grid)
  # the floor cells of the bar first (H 1024 / 4096 from 8k tokens), then the small launch-bound end, then fp32
  POINTS=${2:-$(both bf16:1024:8192 bf16:4096:8192 bf16:1024:32768 bf16:4096:32768 bf16:1024:2048 bf16:1024:4096 \
    bf16:1536:2048 bf16:1536:4096 bf16:1536:8192 bf16:2048:2048 bf16:2048:4096 bf16:4096:2048 bf16:5120:2048 \
    bf16:5120:8192 fp32:1024:2048 fp32:1024:8192 fp32:4096:2048 fp32:4096:8192)}
  timeout 560 python3 benchmarks/loss_bench.py --out "$OUT_DIR" --no-accuracy --repeats 2 --max-minutes 8.5 \
    --backends naive,trl,grpo_lab,grpo_lab+free --points "$POINTS" --budget-s "${3:-0.6}" 2>&1 | tee "$OUT_DIR/bench.log" \
    | grep ' ms ' | tail -40
  ;;
all)  # one call of under 10 minutes when machines are scarce: the policy's tests, the run peaks, a profile, a grid
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_kernel_gpu.py \
    -k "policy or peak or short_of_memory" 2>&1 | tee "$OUT_DIR/pytest_policy.log" | tail -4
  step_peak 125 3
  timeout 40 python3 benchmarks/loss_bench.py --out "$OUT_DIR/profile" --no-issue-rows --no-accuracy \
    --profile frozen:bf16:1024:32768,frozen:bf16:4096:8192 --points frozen:bf16:1024:2048 --backends grpo_lab \
    --budget-s 0.2 2>&1 | grep -v '^ *$' | grep -v 'ms  floor' | tail -40
  timeout 170 python3 benchmarks/loss_bench.py --out "$OUT_DIR" --no-accuracy --repeats 2 --max-minutes 2.6 \
    --backends naive,trl,grpo_lab,grpo_lab+free --budget-s 0.4 --points "$(both bf16:1024:8192 bf16:4096:8192 \
    bf16:1024:32768 bf16:1024:2048 bf16:1536:2048 bf16:2048:2048 bf16:1536:8192 bf16:4096:2048 fp32:1024:2048 \
    fp32:4096:2048)" 2>&1 | tee "$OUT_DIR/bench.log" | grep ' ms ' | tail -60
  ;;
ab)
  head_alone 100 150 8192,32768
  bar_cells 170 naive,trl,grpo_lab,grpo_lab+free 0.4 "${2:-$BAR_CELLS,frozen:bf16:1024:8192,trainable:bf16:1024:8192,\
frozen:bf16:1024:2048,trainable:bf16:1024:2048}"
  ;;
quick)  # one call when device time is short: the GPU tests of the kernel paths, the bar's cells, the head alone
  kernel_tests 150
  bar_cells 140 naive,trl,grpo_lab,grpo_lab+free 0.25 "$BAR_CELLS"
  head_alone 60 60 32768
  ;;
last)  # under five minutes: the GPU tests of the kernel paths, then the bar's cells against TRL (min(naive, TRL)
  # there on one H100, results/loss_kernel/h100_issue45_policy) and the floor
  kernel_tests 130
  bar_cells 130 trl,grpo_lab,grpo_lab+free 0.25 "$BAR_CELLS"
  ;;
tests)  # TIMEOUT (470)
  gpu_tests "${2:-470}"
  ;;
confirm)
  gpu_tests 240
  tune_with benchmarks/tune_dz_free.json 150
  bar_cells 150 naive,trl,grpo_lab,grpo_lab+free 0.25 "$BAR_CELLS"
  GRPO_LAB_MATERIALIZE_GIB=48 timeout 80 python3 benchmarks/loss_bench.py --out "$OUT_DIR/profile" --no-issue-rows \
    --no-accuracy --profile frozen:bf16:1024:32768,frozen:bf16:4096:8192,trainable:bf16:1024:32768 --points frozen:bf16:1024:2048 \
    --backends grpo_lab --budget-s 0.2 2>&1 | grep -v '^ *$' | grep -v 'ms  floor' | tail -45
  ;;
grid2)  # PART (1 or 2) of the grid of `grid` with the defaults of this checkout, in two calls of under 10 minutes
  # (1: every GPU test, the head alone A/B of tune_dz_free.json, then the bar's cells and the small launch-bound end;
  # 2: the bar's cells again, the rest of the bf16 shapes and the fp32 ones)
  if [ "$2" = 1 ]; then
    gpu_tests 240
    tune_with benchmarks/tune_dz_free.json 100
    POINTS=$(both bf16:1024:8192 bf16:4096:8192 bf16:1024:32768 bf16:1024:2048 bf16:1024:4096 bf16:1536:2048 \
      bf16:2048:2048 bf16:4096:2048)
    MINUTES=4.6
  else
    POINTS=$(both bf16:1024:32768 bf16:4096:8192 bf16:1536:8192 bf16:2048:4096 bf16:5120:2048 bf16:5120:8192 \
      fp32:1024:2048 fp32:4096:2048 fp32:1024:8192 fp32:4096:8192)
    MINUTES=8.3
  fi
  timeout 560 python3 benchmarks/loss_bench.py --out "$OUT_DIR" --no-accuracy --repeats 2 --max-minutes $MINUTES \
    --backends naive,trl,grpo_lab,grpo_lab+free --points "$POINTS" --budget-s 0.4 2>&1 | tee "$OUT_DIR/bench.log" \
    | grep ' ms ' | tail -70
  ;;
timeline)  # where the GPU waits in a loss step (benchmarks/step_timeline.py), with the card's clocks sampled beside
  sample_clocks
  timeout "${2:-200}" python3 benchmarks/step_timeline.py --out "$OUT_DIR" --backends grpo_lab,trl --points \
    "${3:-frozen:bf16:1024:8192,frozen:bf16:4096:8192,frozen:bf16:1024:32768,frozen:bf16:1024:2048}" 2>&1 | grep -v USDT
  timeout "${4:-120}" python3 benchmarks/step_timeline.py --out "$OUT_DIR" --backends grpo_lab+free,trl --points \
    "${5:-trainable:bf16:1024:8192,trainable:bf16:1024:32768}" 2>&1 | grep -v USDT
  [ -n "${PROBE:-}" ] && wide_buffer 200 8 1024:8192,4096:8192,1024:32768
  kill $SMI
  ;;
once)  # one call of under 10 minutes for a session with little device time: every GPU test, where the GPU waits in
  # the frozen head's step (step_timeline, clocks beside), the bar's cells, and the frozen P~ buffer's widths (wide_buffer)
  gpu_tests "${2:-200}"
  sample_clocks
  timeout 110 python3 benchmarks/step_timeline.py --out "$OUT_DIR" --backends grpo_lab,trl --reps 6 --points \
    frozen:bf16:1024:8192,frozen:bf16:4096:8192,frozen:bf16:1024:32768 2>&1 | grep -v USDT
  bar_cells "${3:-120}" trl,grpo_lab,grpo_lab+free 0.25 "$BAR_CELLS,frozen:bf16:1024:8192,trainable:bf16:1024:8192"
  [ -z "${NO_PROBE:-}" ] && wide_buffer 100 6 1024:8192,4096:8192,1024:32768
  kill $SMI
  ;;
split)  # every GPU test (the opt-in path below included); the fp32 trainable head with dX / dW as split-TF32 GEMMs
  # on K-major copies (the default since run 1 of results/loss_kernel/h100_issue45_split) against naive and against
  # the old default's cuBLAS SGEMM backward on 8192-token dZ tiles, two repeats; the frozen head's chunk launches
  # straight to the compiled kernel (direct_launch) against Triton's JIT dispatch (the default), interleaved rounds
  gpu_tests "${2:-190}"
  P=trainable:fp32:1024:8192,trainable:fp32:4096:2048,trainable:fp32:4096:8192
  timeout 150 python3 benchmarks/loss_bench.py --out "$OUT_DIR/fp32_split" --no-issue-rows --no-accuracy \
    --repeats 2 --points $P --backends naive,grpo_lab --budget-s 1 --floor-reps 2 2>&1 | grep ' ms ' | tail -12
  GRPO_LAB_FP32_MM=cublas GRPO_LAB_BWD_TOKENS=8192 timeout 80 python3 benchmarks/loss_bench.py --out \
    "$OUT_DIR/fp32_cublas" --no-issue-rows --no-accuracy --floor-reps 1 --points $P --backends grpo_lab \
    --budget-s 1 2>&1 | grep ' ms ' | tail -6
  timeout "${3:-100}" python3 benchmarks/small_head_probe.py --out "$OUT_DIR" --rounds 3 --reps 6 --points \
    1024:2048,1024:8192,4096:8192 --variants '{"default": {}, "direct": {"direct_launch": true}}' 2>&1 | grep '^H='
  ;;
sweep)
  timeout 100 python3 benchmarks/mainloop_probe.py --hidden 1024,4096 --tokens 32768 2>&1 | tee "$OUT_DIR/probe.log" \
    | grep '^probe'
  tune_with benchmarks/tune_lean_epilogue.json "${2:-160}"
  ;;
esac
