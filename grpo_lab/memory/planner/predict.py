"""Predict the peak memory of one GRPO training step, and the largest batch that fits, without running it.

    from grpo_lab.memory.planner import PlannerConfig, plan, max_batch
    p = plan(PlannerConfig(model="Qwen3-8B", loss_backend="grpo_lab", lora_r=16, world_size=4, batch_size=64))
    p.peak_gib, p.peak_phase, p.breakdown()           # per device
    max_batch(PlannerConfig(model="Qwen3-8B", world_size=4), budget_gib=80).batch

The step is walked phase by phase; each phase's live memory is a sum of named terms derived from the code that runs
(`shapes`, `layer`, `head`, FSDP2's sharding in `plan`), and the peak is the largest phase (docs/memory.md, *How*).
The calibrated constants below are each documented where defined.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

from .config import PlannerConfig
from .head import FP32, UNTOUCHED, MiB, head_backward, head_forward, head_rows, head_saves_rows
from .layer import backward_levels, saved_tensors
from .shapes import ModelShape, shape_for

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}

# Allocated on CUDA besides tensors: the cuBLAS and cuBLASLt workspaces (32 MiB each on Hopper), which torch takes
# from its caching allocator. Fitted: the four notebook-02 models' intercepts all sit 0.06 GiB above the tensors.
CUDA_WORKSPACE_BYTES = 64 * MiB
# int64 ids, masks and labels TRL and the model keep per token (prompt/completion ids and masks, their concatenation,
# the labels, the attention mask, position ids), rounded up
INPUT_BYTES_PER_TOKEN = 48
# fp32 [B, completion] tensors of TRL's loss (log-probs, entropies, ratios, clipped terms, per-token loss ...)
LOSS_BYTES_PER_COMPLETION_TOKEN = 48
# CPU: what a probe's peak RSS holds beyond its tensors — a fixed part (trainer, dataset, tokenizer, interpreter
# heap, threads) and a share of the tensor bytes (heap and page slack, gloo's buffers). Fitted to the CPU runs
# (results/memory_planner/planner_cpu_fsdp.csv, and small-qwen3 runs at world sizes 1 and 2): 0.09–0.25 GiB.
CPU_RSS_OVERHEAD_BYTES = 0.09 * GiB
CPU_RSS_SLACK = 0.04
# Max batch: the share of the budget the caching allocator's fragmentation takes at the limit (the allocated peak
# must stay below (1 − headroom) × budget). Fitted to the committed H200 searches: the fused heads (their peak is a
# decoder layer's backward, many multi-GiB blocks) lost 7–17 %, naive (a few huge logits blocks) 1–5 %.
ALLOCATOR_HEADROOM = {"naive": 0.03, "fused": 0.12}
# With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragmentation nearly vanishes: 2 % put the held-out H200
# check's max batch within one search step (Qwen2.5-Math-1.5B, grpo_lab, r=64: predicted 418, 405 fits, 431 does
# not), where the default allocator's 12 % over-predicted it (363 did not fit: ≥ 14.5 % lost there, 17 % on 4B).
EXPANDABLE_SEGMENTS_HEADROOM = 0.02
# The fused heads' fragmentation under the default allocator is not one number (4B lost 17 %, 8B 8 %, the held-out
# 1.5B >= 14.5 %), so a point answer can be off by more than a search step. The band between the batches a 19 % and a
# 7 % headroom give says how far: chosen to hold notebook 02's 9 uncapped fused H200 searches (in-sample, 9/9); the
# held-out 1.5B limit (below 363) is consistent with its band, 344-396.
DEFAULT_ALLOCATOR_BAND = (0.19, 0.07)


@dataclass
class MemoryPlan:
    """The predicted live bytes of every phase of the step, each as named terms (bytes, per device)."""

    config: PlannerConfig
    shape: ModelShape
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def phase_bytes(self) -> dict[str, float]:
        """The live bytes of each phase as the device meters them (CUDA: allocated; CPU: resident — a term
        allocated but never written, marked `(untouched)`, is left out)."""
        rss = self.config.device == "cpu"
        return {name: sum(v for k, v in terms.items() if not (rss and k.endswith(UNTOUCHED)))
                for name, terms in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_bytes()
        return max(totals, key=totals.get)

    @property
    def peak_bytes(self) -> float:
        return max(self.phase_bytes().values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def tensor_peak_bytes(self) -> float:
        """The peak of the tensors alone: every allocated byte (untouched ones too), no CPU RSS overhead — what
        `grpo_lab.memory.live_bytes` counts."""
        return max(sum(v for k, v in t.items() if k != "cpu_rss_overhead") for t in self.phases.values())

    def breakdown(self, phase: str | None = None) -> dict[str, float]:
        """The terms (GiB) of `phase` (default: the peak phase), largest first."""
        terms = self.phases[phase or self.peak_phase]
        return {k: v / GiB for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v}

    def summary(self) -> str:
        c = self.config
        lines = [f"{c.model} {c.loss_backend} {c.dtype} B={c.batch_size} ({c.prompt_len}+{c.completion_len} tokens) "
                 f"LoRA r={c.lora_r} world size {c.world_size}{' FSDP2' if c.fsdp else ''}: "
                 f"peak {self.peak_gib:.2f} GiB per device in {self.peak_phase}"]
        lines += [f"  {k:<34} {v:8.3f} GiB" for k, v in self.breakdown().items()]
        return "\n".join(lines)


def _sharded(n: float, world: int, fsdp: bool) -> float:
    return math.ceil(n / world) if fsdp else n


def plan(config: PlannerConfig) -> MemoryPlan:
    """The phases of one training step of `config` and their live memory per device (see the module docstring)."""
    c = config
    sh = shape_for(c.model, c.model_config)
    b = DTYPE_BYTES[c.dtype]
    w, fsdp, full = c.world_size, bool(c.fsdp), c.lora_r == 0
    kernel = c.attention_kernel
    batch, seq = c.batch_size, c.prompt_len + c.completion_len
    n_tok = batch * seq
    rows = head_rows(batch, c.prompt_len, c.completion_len, c.device)
    if c.loss_backend == "liger":
        rows = batch * c.completion_len  # Liger reads the completion positions of the hidden states itself
    lora_layer = sh.lora_layer_params(c.lora_r, c.lora_targets)
    layer_params = sh.layer_params + lora_layer
    replicate_root = fsdp and c.loss_backend == "liger"  # `shard_fsdp2(replicate_root=True)`: root kept whole

    # --- what every phase holds: parameters, AdamW state, workspaces ---------------------------------------------
    root_local = sh.root_params if (replicate_root or not fsdp) else _sharded(sh.root_params, w, fsdp)
    layers_local = sh.layers * _sharded(sh.layer_params, w, fsdp)
    lora_local = sh.layers * _sharded(lora_layer, w, fsdp)
    trainable_local = lora_local if not full else root_local + layers_local
    static = {"params": b * (root_local + layers_local), "lora_params": b * lora_local}
    if c.optimizer_state:
        static["adamw_state"] = 2 * b * trainable_local
    if c.device == "cuda":
        static["cuda_workspace"] = CUDA_WORKSPACE_BYTES
    step = {"inputs": INPUT_BYTES_PER_TOKEN * n_tok, "rotary_cos_sin": 2 * b * sh.head_dim * n_tok}
    if fsdp and not replicate_root:
        step["fsdp_root_gathered"] = b * sh.root_params  # all-gathered at the root's forward, kept to its backward
    gathered_layer = {"fsdp_layer_gathered": b * layer_params} if fsdp else {}

    # --- activations ------------------------------------------------------------------------------------------
    saved = saved_tensors(sh, b, c.lora_r, c.lora_targets, kernel, seq, c.gradient_checkpointing)
    saved_layer = sum(s.bytes_per_token for s in saved)
    levels = backward_levels(saved, sh, b, kernel, seq)
    layer_peak_stage = max(levels, key=levels.get)
    layer_peak = levels[layer_peak_stage]
    # checkpointing: each layer's input is kept (non-reentrant checkpoint), the layer being differentiated is
    # recomputed; else every layer keeps its saved tensors
    ckpt = c.gradient_checkpointing
    kept, per_layer = ("checkpoints", b * sh.hidden) if ckpt else ("saved_activations", saved_layer)
    below_head = {kept: sh.layers * per_layer * n_tok}

    def layers_alive(k):  # the backward of layer k: layers below it (and k's own checkpoint) still kept
        return {kept: (k + 1 if ckpt else k) * per_layer * n_tok,
                f"layer_backward[{layer_peak_stage}]": layer_peak * n_tok}
    final_norm = {"final_norm_saved": (FP32 * sh.hidden + FP32) * n_tok + (b * sh.hidden * n_tok if full else 0)}

    # --- gradients of full fine-tuning (sharded after each FSDP2 group's reduce-scatter) -----------------------
    # The LM head's weight gradient exists from the head's backward on (tied: it is the embedding's .grad); the
    # root group reduce-scatters once, after the embedding's backward, so until then it is whole under FSDP2 too.
    layer_grads_local = b * _sharded(sh.layer_params, w, fsdp)
    head_grad = {"head_grad": b * sh.vocab * sh.hidden} if full else {}

    # --- the LM head ------------------------------------------------------------------------------------------
    loss = {"loss_terms": LOSS_BYTES_PER_COMPLETION_TOKEN * batch * c.completion_len}
    head_in = {} if c.loss_backend == "liger" else {"head_rows": b * sh.hidden * rows + 16 * rows}
    phases: dict[str, dict[str, float]] = {}
    phases["head_forward"] = {**static, **step, **below_head, **final_norm, **loss,
                              "last_hidden_state": b * sh.hidden * n_tok, **head_in,
                              **head_forward(c.loss_backend, sh, rows, b, c.device, full, c.completion_len)}
    head_keep = head_in if head_saves_rows(c.loss_backend, full) else {}
    phases["head_backward"] = {**static, **step, **below_head, **final_norm, **loss, **head_keep,
                               **head_backward(c.loss_backend, sh, rows, b, c.device, full)}

    # --- decoder layers' backward: the top one (most activations), the bottom one (most gradients) -------------
    top = {**static, **step, **gathered_layer, **layers_alive(sh.layers - 1)}
    if full:  # + the down projection's weight gradient, computed first in the layer's backward
        top.update(head_grad, layer_grads_current=b * sh.down_proj_params())
    phases["layer_backward_top"] = top
    if full and sh.layers > 1:
        phases["layer_backward_bottom"] = {
            **static, **step, **gathered_layer, **layers_alive(0), **head_grad,
            "layer_grads": (sh.layers - 1) * layer_grads_local, "layer_grads_current": b * sh.down_proj_params()}
        # the embedding's backward: a dense [V, H] gradient (tied: accumulated into the head's .grad)
        phases["embedding_backward"] = {
            **static, **step, **head_grad,
            "layer_grads": sh.layers * layer_grads_local, "embedding_grad": b * sh.vocab * sh.hidden,
            "embedding_output_grad": b * sh.hidden * n_tok}
    # --- FSDP2 all-gathers (world size > 1): the flat all-gather output and the per-parameter copies it is split
    # into coexist for a moment (at world size 1 the copy-out is the only copy); the root gathers first, before any
    # activation, a decoder layer again before its recomputation ----------------------------------------------------
    if fsdp and w > 1:
        if not replicate_root:
            phases["fsdp_root_all_gather"] = {**static, **step, "fsdp_root_gathered": 2 * b * sh.root_params}
        phases["fsdp_layer_all_gather"] = {
            **static, **step, **below_head, "layer_output_grad": b * sh.hidden * n_tok,
            "fsdp_layer_gathered": 2 * b * layer_params, **head_grad}
    # --- the optimizer step (fused AdamW: in place, no temporaries; a first step creates the two moments) -------
    grads_local = b * trainable_local
    opt = {**static, "inputs": step["inputs"], "grads": grads_local}
    if not c.optimizer_state:
        opt["adamw_state_new"] = 2 * b * trainable_local
    phases["optimizer_step"] = opt
    return _with_rss_overhead(MemoryPlan(config=c, shape=sh, phases=phases))


def _with_rss_overhead(p: MemoryPlan) -> MemoryPlan:
    """CPU: add each phase's RSS overhead (`CPU_RSS_OVERHEAD_BYTES` + `CPU_RSS_SLACK` × its resident tensors)."""
    if p.config.device == "cpu":
        for name, resident in p.phase_bytes().items():
            p.phases[name] = {**p.phases[name], "cpu_rss_overhead": CPU_RSS_OVERHEAD_BYTES + CPU_RSS_SLACK * resident}
    return p


def plan_loss_only(config: PlannerConfig, trainable: bool = True, entropy_grad: bool = True,
                   with_inputs: bool = True) -> MemoryPlan:
    """The loss stage alone: hidden states [B·C, H] (needing a gradient) and the head weight [V, H] through the
    backend's log-probs and entropy and a GRPO surrogate, forward and backward. The defaults are notebook 01's
    `loss` points (`grpo_lab.memory.loss_probe`: trainable head, the entropy gets a zero-weighted gradient, the
    inputs counted); `benchmarks/loss_bench.py` detaches the entropy, runs both head modes and reports the peak
    above the inputs (`with_inputs=False`)."""
    c = config
    sh = shape_for(c.model, c.model_config)
    b = DTYPE_BYTES[c.dtype]
    rows = c.batch_size * c.completion_len
    inputs = {}
    if with_inputs:
        inputs = {"hidden": b * sh.hidden * rows, "head_weight": b * sh.vocab * sh.hidden, "targets": 8 * rows}
        if c.device == "cuda":
            inputs["cuda_workspace"] = CUDA_WORKSPACE_BYTES
    hidden_grad = {"hidden_grad": b * sh.hidden * rows}
    weight_grad = {"weight_grad": b * sh.vocab * sh.hidden} if trainable else {}
    fwd = head_forward(c.loss_backend, sh, rows, b, c.device, trainable, c.completion_len)
    if c.loss_backend == "liger":  # the whole fwd + bwd runs in Liger's forward; its backward scales the kept dX / dW
        kept = {"liger.saved_grad_input": b * sh.hidden * rows}
        if trainable:
            kept["liger.saved_grad_weight"] = b * sh.vocab * sh.hidden
        phases = {"loss_forward": {**inputs, **fwd}, "loss_backward": {**inputs, **hidden_grad, **weight_grad, **kept}}
    else:
        # the fused heads' input gradient is the tensor their backward returns (counted in `bwd`); naive's comes
        # from the matmul's backward
        bwd = head_backward(c.loss_backend, sh, rows, b, c.device, trainable, entropy_grad=entropy_grad)
        phases = {"loss_forward": {**inputs, **fwd, "loss_terms": 16 * rows},
                  "loss_backward": {**inputs, **(hidden_grad if c.loss_backend == "naive" else {}), **bwd}}
    return _with_rss_overhead(MemoryPlan(config=c, shape=sh, phases=phases)) if with_inputs else \
        MemoryPlan(config=c, shape=sh, phases=phases)


@dataclass
class MaxBatch:
    """The largest per-device batch whose predicted peak fits `usable_bytes` (the budget less allocator headroom)."""

    batch: int
    peak_bytes: float  # predicted allocated peak at `batch`
    budget_bytes: float
    usable_bytes: float
    capped: bool = False  # `upper` fits: the answer is a lower bound


def usable_budget(config: PlannerConfig, budget_bytes: float, headroom: float | None = None) -> float:
    """The share of a device budget the predicted allocated peak may use (CUDA: less the allocator's headroom)."""
    if config.device == "cpu":
        return budget_bytes
    if headroom is None:
        headroom = (EXPANDABLE_SEGMENTS_HEADROOM if config.expandable_segments
                    else ALLOCATOR_HEADROOM["naive" if config.loss_backend == "naive" else "fused"])
    return budget_bytes * (1.0 - headroom)


def max_batch(config: PlannerConfig, budget_gib: float, upper: int = 1 << 16,
              headroom: float | None = None) -> MaxBatch:
    """The largest batch B ≤ `upper` with plan(config with batch B).peak ≤ usable budget (0 if not even B = 1);
    the peak grows with B, so a bisection finds it."""
    if not budget_gib or budget_gib <= 0:
        raise ValueError(f"budget must be a positive number of GiB, got {budget_gib!r}")
    budget = float(budget_gib) * GiB
    usable = usable_budget(config, budget, headroom)

    @functools.cache
    def peak(bsz):
        return plan(config.replace(batch_size=bsz)).peak_bytes

    fits = bisect.bisect_right(range(1, upper + 1), usable, key=peak)  # how many of 1..upper fit
    return MaxBatch(fits, peak(max(fits, 1)), budget, usable, capped=fits == upper)


def max_batch_band(config: PlannerConfig, budget_gib: float, upper: int = 1 << 16) -> tuple[int, int] | None:
    """(low, high): where the max batch of a fused head can fall under the default CUDA caching allocator, whose
    fragmentation at the limit varies by model (`DEFAULT_ALLOCATOR_BAND`); None where one answer holds (CPU, the
    naive head, or `expandable_segments`)."""
    if config.device == "cpu" or config.loss_backend == "naive" or config.expandable_segments:
        return None
    worst, best = DEFAULT_ALLOCATOR_BAND
    return (max_batch(config, budget_gib, upper, headroom=worst).batch,
            max_batch(config, budget_gib, upper, headroom=best).batch)
