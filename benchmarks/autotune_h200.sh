#!/usr/bin/env bash
# The autotune benchmark on the H200 tiny loop, one round per device call of <= 10 minutes: the trainer on the GPU,
# two CPU replicas (3 threads each) on the host's cores, every setting of benchmarks/autotune_bench.py once.
# Carry .whl (trl, datasets, dill, multiprocess, math-verify, latex2sympy2_extended, antlr4 runtime: what the image
# lacks) and run from the repo root on the GPU box:
#     bash benchmarks/autotune_h200.sh $OUT ROUND
# Writes $OUT/async/autotune_h200_rROUND{.csv,_summary.csv,.png} and the run's log; the rounds are merged here
# with `python benchmarks/autotune_bench.py --merge results/async/autotune_h200_r*.csv --name autotune_h200`.
set -uo pipefail
OUT="${1:?output folder}"
ROUND="${2:-1}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site \
  "$REPO"/.whl/*.whl || exit 1
# grpo_lab itself, installed (its data files are the package `grpo_lab.data_files`, which only an install maps)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /root/site "$REPO" || exit 1
export PYTHONPATH="/root/site"  # the replicas and the rollout worker's child import grpo_lab from here too
mkdir -p "$OUT/async"
python3 -c "import torch, trl, datasets, pyarrow; print(torch.cuda.get_device_name(), 'torch', torch.__version__, \
'trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" || exit 1
cd "$REPO" && timeout "${LIMIT_S:-560}" python3 benchmarks/autotune_bench.py --rounds 1 --steps "${STEPS:-30}" --replica-threads 3 \
  --name "${NAME:-autotune_h200}_r$ROUND" --out "$OUT/async" 2>&1 | grep -v -i warning | tee "$OUT/async/${NAME:-autotune_h200}_r$ROUND.log" \
  | grep -E '^\{|x the best|wrote|Error|error' | cut -c1-260
