#!/usr/bin/env bash
# Notebook 02's max-batch search on one GPU (world size 1, FSDP2 + LoRA r=16, bf16, 256+512 tokens), in three
# commands of a few minutes each, under expandable_segments (the --full default). Writes
# results/fsdp_max_batch/fsdp_max_batch_expandable{,_probes}.csv and .png; with ALLOC=--default-allocator, PyTorch's
# default caching allocator and fsdp_max_batch{,_probes}.csv.
# --resume: a rerun goes on from the probes already in the CSVs (a search cut by --max-minutes continues where it
# stopped; a finished one costs no probe).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${1:-results/fsdp_max_batch}"
ALLOC="${ALLOC:-}"
python -m grpo_lab.memory.max_batch --full --models Qwen3-0.6B,Qwen3-1.7B --backends naive,trl,grpo_lab --keep-going --resume --max-minutes 5.5 $ALLOC --out "$OUT"
python -m grpo_lab.memory.max_batch --full --models Qwen3-4B,Qwen3-8B --backends naive,trl,grpo_lab --resume --keep-going --max-minutes 5.5 $ALLOC --out "$OUT"
python -m grpo_lab.memory.max_batch --full --backends liger --resume --keep-going --max-minutes 5.5 $ALLOC --out "$OUT"
