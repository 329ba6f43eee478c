"""The LM head's working set per loss backend: what each one allocates in its forward and its backward.

`rows` is the number of hidden states the head scores: TRL's fused forward passes only the completion positions on
a Triton device (`hidden_states[mask]`, B × completion_len) and every position elsewhere (B × (T − 1), labels
clamped). A head is `trainable` in full fine-tuning (its weight needs a gradient) and frozen under LoRA. Each function
returns named byte counts; the planner adds them to what the rest of the step holds at that moment.

Sources: `trl/kernels/chunked_logprob.py` (TRL 1.16), `grpo_lab/loss/heads/naive.py`, `grpo_lab/loss/heads/chunked.py`,
`grpo_lab/loss/kernel/launch.py`, `liger_kernel/chunked_loss/fused_linear_ppo.py` (0.8.5).
"""

from __future__ import annotations

import math

from .layer import FP32
from .shapes import ModelShape

MiB = 2**20

# TRL 1.16: `_CHUNKED_LOGPROB_CHUNK_SIZE` (the vocabulary width its trainer passes) and `TOKEN_CHUNK_SIZE`
TRL_VOCAB_CHUNK = 32768
TRL_TOKEN_CHUNK = 4096
# grpo_lab's chunked torch path (CPU): TOKEN_TILE; its vocabulary tile is the chunk TRL passes
CHUNKED_TOKEN_TILE = 1024
# grpo_lab's Triton kernel: partial-statistics budget, its vocabulary block per dtype (bytes → BN), frozen P~ tile,
# trainable dZ tile (tokens × vocab)
KERNEL_PART_BYTES = 32 * MiB
KERNEL_FWD_BN = {2: 256, 4: 128}
KERNEL_FROZEN_BN = {2: 256, 4: 128}
KERNEL_FROZEN_TILE = (8192, 8448)
# under this many rows and rows × hidden a frozen 16-bit head recomputes (dX only) in dZ tiles of the frozen tile's
# budget (0 rows: the kernel's rule is off by default since the small frozen head stopped syncing with the host)
KERNEL_FROZEN_RECOMPUTE_ROWS = {2: 0}
KERNEL_FROZEN_RECOMPUTE_BELOW = {2: 9 * 2**19}
KERNEL_DZ_TILE = {2: (16384, 8192), 4: (4096, 8192)}
# fp32 dX / dW: cuBLAS SGEMM, or split-TF32 GEMMs on K-major copies of this many vocabulary columns (`split_tf32`)
KERNEL_FP32_MM = "triton"
KERNEL_FP32_MM_SLICE = 2048
# Liger 0.8.5: one sequence per chunk; its selective log-prob streams [≤ 2048 rows, 4096 vocab] fp32 tiles
LIGER_SEQ_CHUNK = 2048
LIGER_VOCAB_CHUNK = 4096

# fp32 tile-sized temporaries alive at once in the torch fallbacks (read from the code, counted by the CPU trace
# test): TRL `_forward_tile`: z, exp(z − m), e·z;  `_backward_tile`: z, log p, p, grad, the 1-byte target mask,
# its float copy, (1[target] − p) and g·(…);  grpo_lab chunked forward: z, z − m, e (frozen: the target-zeroed e
# replaces z − m);  its recompute backward: z, log p, p, dZ and g·p (then the [vocab tile, H] fp32 product for dW).
# The chunked loops keep the previous tile's z and e (backward: z, log p, p, dZ) bound while the next tile's logits
# and their scaled copy are formed, so with more than one tile the forward holds 4 tiles and the backward 6.
TRL_CPU_FWD_TILES = 3
TRL_CPU_BWD_TILES = 7.25
CHUNKED_FWD_TILES = (3, 4)  # one tile, several tiles
CHUNKED_BWD_TILES = (5, 6)


def _chunked_tiles(rows: int, vocab: int, counts: tuple[int, int]) -> tuple[int, int, int]:
    """(tiles alive, token tile, vocabulary tile) of grpo_lab's chunked torch path."""
    n, vt = min(rows, CHUNKED_TOKEN_TILE), min(vocab, TRL_VOCAB_CHUNK)
    several = math.ceil(rows / CHUNKED_TOKEN_TILE) * math.ceil(vocab / vt) > 1
    return counts[several], n, vt


UNTOUCHED = " (untouched)"  # suffix of a term that is allocated but never written: it is not in a CPU RSS


def _trl_tile_buffer(n: int, vocab: int, b: int) -> dict[str, float]:
    """TRL's [min(N, 4096), 32768] tile buffer. With a vocabulary under 32768 only its first `vocab` columns are
    ever written, so on CPU the rest of each row is never paged in (RSS); a CUDA allocation counts whole."""
    used = n * min(vocab, TRL_VOCAB_CHUNK) * b
    out = {"trl.tile_buffer": used}
    if n * TRL_VOCAB_CHUNK * b > used:
        out["trl.tile_buffer" + UNTOUCHED] = n * TRL_VOCAB_CHUNK * b - used
    return out


def head_rows(batch: int, prompt_len: int, completion_len: int, device: str) -> int:
    """Hidden states the LM head scores in one micro-batch (see the module docstring)."""
    return batch * completion_len if device == "cuda" else batch * (prompt_len + completion_len - 1)


def _frozen_recomputes(rows: int, hidden: int, b: int) -> bool:
    """Whether the kernel's frozen head takes its small-N recompute path (`FROZEN_RECOMPUTE_BELOW`)."""
    return rows < KERNEL_FROZEN_RECOMPUTE_ROWS.get(b, 0) and rows * hidden < KERNEL_FROZEN_RECOMPUTE_BELOW.get(b, 0)


def _widened(rows: int, tokens: int, vocab_tile: int, vocab: int) -> int:
    """The kernel's vocabulary tile: the same element budget spread over fewer rows (`_widened_vocab_tile`)."""
    return min(vocab, max(vocab_tile, tokens * vocab_tile // max(rows, 1)))


def head_forward(loss_backend: str, shape: ModelShape, rows: int, b: int, device: str, trainable: bool,
                 completion_len: int) -> dict[str, float]:
    """Bytes the head allocates in its forward, at its peak (beyond its input rows)."""
    v, h = shape.vocab, shape.hidden
    if loss_backend == "naive":
        # logits (compute dtype), the fp32 logits the softmax sees, log p, p = exp(log p), p · log p (entropy)
        return {"naive.logits_and_softmax": (b + 4 * FP32) * v * rows}
    if loss_backend == "trl":
        n = min(rows, TRL_TOKEN_CHUNK)
        out = {**_trl_tile_buffer(n, v, b), "trl.row_stats": 7 * FP32 * rows}
        if device == "cpu":
            out["trl.cpu_tile_temporaries"] = TRL_CPU_FWD_TILES * FP32 * n * min(v, TRL_VOCAB_CHUNK)
        return out
    if loss_backend == "grpo_lab":
        if device == "cpu":
            tiles, n, vt = _chunked_tiles(rows, v, CHUNKED_FWD_TILES)
            out = {"grpo_lab.cpu_tiles": tiles * FP32 * n * vt, "grpo_lab.row_stats": 7 * FP32 * rows}
            if not trainable:  # A, and the fp32 copy of the weight chunk it is accumulated with (16-bit weights)
                out["grpo_lab.frozen_A"] = FP32 * h * rows
                out["grpo_lab.weight_chunk_fp32"] = FP32 * vt * h if b < FP32 else 0
            return out
        # `_forward_stats`: partial statistics [6, vocab blocks, token tile] fp32, within the 32 MiB budget (frozen:
        # over the P~ tile's vocabulary chunk)
        bn = KERNEL_FWD_BN[b]
        if trainable or _frozen_recomputes(rows, h, b):
            blocks = min(math.ceil(v / bn), max(1, KERNEL_PART_BYTES // (rows * 6 * FP32)))
            return {"grpo_lab.partial_stats": 6 * FP32 * blocks * rows, "grpo_lab.row_stats": 8 * FP32 * rows}
        t_tile = min(rows, KERNEL_FROZEN_TILE[0])
        v_tile = _widened(t_tile, *KERNEL_FROZEN_TILE, v)
        return {"grpo_lab.partial_stats": 6 * FP32 * math.ceil(v_tile / KERNEL_FROZEN_BN[b]) * t_tile,
                "grpo_lab.row_stats": 8 * FP32 * rows, "grpo_lab.frozen_P_tile": t_tile * v_tile * b,
                "grpo_lab.frozen_A": FP32 * h * rows}
    if loss_backend == "liger":
        # The whole loss runs in Liger's forward, one sequence per chunk: its log-prob forward, then its backward
        # (`torch.autograd.grad`: four fp32 [rows, 4096] tiles, dX in fp32 and, for a 16-bit weight, the vocabulary
        # chunk of the weight in fp32). Each chunk's dX joins a list that is concatenated at the end.
        seq, vt = min(completion_len, LIGER_SEQ_CHUNK), min(v, LIGER_VOCAB_CHUNK)
        chunk = 4 * FP32 * seq * vt + FP32 * h * seq + (FP32 * vt * h if b < FP32 else 0)
        if trainable:  # the accumulator, each chunk's fp32 dW and its cast to the weight's dtype
            chunk += FP32 * v * h + (b * v * h if b < FP32 else 0)
        grad_input = b * h * rows  # Liger's rows: every completion position (`plan`, `plan_loss_only`)
        out = {"liger.grad_input": grad_input, "liger.chunk_or_concat": max(chunk, grad_input)}
        if trainable:
            out["liger.grad_weight"] = b * v * h
        return out
    raise ValueError(f"unknown loss_backend {loss_backend!r}")


def head_backward(loss_backend: str, shape: ModelShape, rows: int, b: int, device: str, trainable: bool,
                  entropy_grad: bool = False) -> dict[str, float]:
    """Bytes the head holds in its backward, at its peak (its saved tensors included, its input rows not)."""
    v, h = shape.vocab, shape.hidden
    if loss_backend == "naive":
        # saved log p and p; the gather's zero-filled gradient and log_softmax's input gradient (the entropy
        # branch's two more when it gets a gradient, as in the loss-alone probe)
        # (a trainable head's dW comes last, from the 16-bit logits gradient, once these are freed)
        return {"naive.saved_logp_p": 2 * FP32 * v * rows,
                "naive.grad_logits": (3 if entropy_grad else 2) * FP32 * v * rows}
    if loss_backend == "trl":
        n = min(rows, TRL_TOKEN_CHUNK)
        out = {**_trl_tile_buffer(n, v, b), "trl.grad_hidden_fp32": FP32 * h * rows}
        if b < FP32:
            out["trl.grad_hidden_cast"] = b * h * rows
        if trainable:
            out["trl.grad_weight_fp32"] = FP32 * v * h
            if b < FP32:
                out["trl.grad_weight_cast"] = b * v * h
        if device == "cpu":
            out["trl.cpu_tile_temporaries"] = TRL_CPU_BWD_TILES * FP32 * n * min(v, TRL_VOCAB_CHUNK)
        return out
    if loss_backend == "grpo_lab":
        if device == "cpu":
            if not trainable:  # elementwise dX from A (saved), written in fp32 then cast
                return {"grpo_lab.frozen_A": FP32 * h * rows, "grpo_lab.grad_hidden_fp32": FP32 * h * rows,
                        "grpo_lab.grad_hidden_cast": b * h * rows}
            tiles, n, vt = _chunked_tiles(rows, v, CHUNKED_BWD_TILES)
            return {"grpo_lab.grad_hidden_fp32": FP32 * h * rows, "grpo_lab.grad_weight_fp32": FP32 * v * h,
                    "grpo_lab.cpu_tiles": FP32 * max(tiles * n * vt, (tiles - 1) * n * vt + vt * h)}
        if not trainable and not _frozen_recomputes(rows, h, b):
            # `_frozen_dx_kernel` writes dX in one pass; the per-row coefficients are its only temporaries
            return {"grpo_lab.frozen_A": FP32 * h * rows, "grpo_lab.grad_hidden": b * h * rows,
                    "grpo_lab.frozen_coefficients": 6 * FP32 * rows}
        tokens, vocab_tile = KERNEL_DZ_TILE[b] if trainable else KERNEL_FROZEN_TILE
        t_tile = min(rows, tokens)
        v_tile = _widened(t_tile, tokens, vocab_tile, v)
        out = {"grpo_lab.grad_hidden_fp32": FP32 * h * rows, "grpo_lab.dz_tile": t_tile * v_tile * b}
        if trainable:
            out["grpo_lab.grad_weight"] = b * v * h
        if b < FP32:
            out["grpo_lab.grad_hidden_cast"] = b * h * rows
        if trainable and b < FP32 and rows > t_tile:
            out["grpo_lab.dw_chunk_fp32"] = FP32 * v_tile * h
        if b == FP32 and KERNEL_FP32_MM == "triton":
            # split-TF32 dX / dW: K-major copies of a weight slice (dX), a dZ slice and the token tile (dW)
            cols, pad = min(KERNEL_FP32_MM_SLICE, v_tile), lambda n: -(-n // 4) * 4
            out["grpo_lab.split_tf32_copies"] = FP32 * (h * pad(cols) + (
                (cols + h) * pad(t_tile) if trainable else 0))
        return out
    if loss_backend == "liger":
        return {"liger.saved_grad_input": b * h * rows, "liger.grad_input_scaled": b * h * rows}
    raise ValueError(f"unknown loss_backend {loss_backend!r}")


def head_saves_rows(loss_backend: str, trainable: bool) -> bool:
    """Whether the head's autograd node keeps its input rows until its backward (the fused functions save them;
    the naive matmul needs them only for a weight gradient; Liger keeps its own dX instead)."""
    return loss_backend != "liger" and (loss_backend != "naive" or trainable)
