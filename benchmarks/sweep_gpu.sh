#!/usr/bin/env bash
# benchmarks/sweep_bench.py on the GPU machine, one grid per device call of <= 10 minutes: the K runs' trainers on
# the GPU, CPU replicas pinned a core each on the host (16 cores), the runs, rollout workers and routers on the rest.
# Carry .whl (trl, datasets, dill, multiprocess, math-verify, latex2sympy2_extended, antlr4 runtime: what the image
# lacks) and run from the repo root on the GPU box:
#     GRID=mixed SEEDS=2 bash benchmarks/sweep_gpu.sh $OUT
# FIRST_SEED=3 NAME=... runs later seeds in another call; `sweep_bench.py --merge A.csv B.csv` summarizes them together.
# Writes $OUT/sweep/sweep_bench_<grid>{.csv,_summary.csv} and the run's log.
set -uo pipefail
OUT="${1:?output folder}"
GRID="${GRID:-mixed}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site \
  "$REPO"/.whl/*.whl || exit 1
# grpo_lab itself, installed (its data files are the package `grpo_lab.data_files`, which only an install maps)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /root/site "$REPO" || exit 1
export PYTHONPATH="/root/site"  # the replicas, runs and rollout workers import grpo_lab from here too
mkdir -p "$OUT/sweep"
python3 -c "import torch, trl, pandas, yaml, aiohttp, psutil; print(torch.cuda.get_device_name(), 'torch', \
torch.__version__, 'trl', trl.__version__, 'cores', len(__import__('os').sched_getaffinity(0)))" || exit 1
# from a folder of its own: `python -m grpo_lab.cli` in the runs must import the installed grpo_lab, not the checkout
mkdir -p /root/run && cd /root/run && timeout "${LIMIT_S:-560}" python3 "$REPO/benchmarks/sweep_bench.py" --runs "${RUNS:-4}" \
  --replicas "${REPLICAS:-8}" --steps "${STEPS:-30}" --grid "$GRID" --seeds "${SEEDS:-2}" --first-seed "${FIRST_SEED:-1}" --pin \
  --out "$OUT/sweep" --work /root/sweep_work/$(date +%s) --name "${NAME:-sweep_bench_$GRID}" 2>&1 | grep -v -i warning \
  | tee "$OUT/sweep/${NAME:-sweep_bench_$GRID}.log" | tail -40
