"""A Liger-style fused linear + GRPO loss module, for users who call the loss directly on the last hidden state.

`GRPOLabFusedLinearGRPOLoss(config)(hidden[B,T,H], weight[V,H], selected_token_ids[B,T], attention_mask[B,T],
advantages[B]) -> (loss, metrics)`, Liger 0.8.5's call shape: log-probs from a log-prob head (masked tokens get
target -100, which the kernel skips), the loss from `reference.grpo_loss` (no loss math lives here).
"""

from __future__ import annotations

from torch import nn

from .backends import DEFAULT_LOSS_BACKEND
from .config import GRPOLossConfig
from .heads import logprob_head
from .reference import grpo_loss


class GRPOLabFusedLinearGRPOLoss(nn.Module):
    """Fused LM head + GRPO-family loss.

    Args:
        config: the loss options (TRL's names and defaults; note Liger's own defaults differ, e.g. its beta 0.04).
        compute_entropy: also return per-token entropies (for the `entropy` metric); forced on when the config needs
            them (entropy bonus, top-entropy quantile). Its gradient is only formed when the loss uses it.
        backend: the log-prob backend name, `"grpo_lab"` by default (`"naive"`/`"trl"` for comparisons).
        logit_scale, softcap: the head's logit transform (Gemma-style softcap, Cohere-style scale).
    """

    def __init__(self, config: GRPOLossConfig | None = None, *, compute_entropy: bool = True,
                 backend: str = DEFAULT_LOSS_BACKEND, logit_scale: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.config = config if config is not None else GRPOLossConfig()
        needs = self.config.entropy_coef != 0.0 or self.config.top_entropy_quantile < 1.0
        self.compute_entropy = compute_entropy or needs
        self.backend = backend
        self._logprobs = logprob_head(backend)
        self.logit_scale = logit_scale
        self.softcap = softcap

    def per_token_logps(self, hidden, weight, selected_token_ids, attention_mask, bias=None):
        """(B, T) log-probs and entropies (None unless computed); masked positions are 0 and not computed."""
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be [B, T, H], got {tuple(hidden.shape)}.")
        b, t, h = hidden.shape
        if tuple(selected_token_ids.shape) != (b, t) or tuple(attention_mask.shape) != (b, t):
            raise ValueError(f"selected_token_ids and attention_mask must be [B, T] = {(b, t)}, got "
                             f"{tuple(selected_token_ids.shape)} and {tuple(attention_mask.shape)}.")
        targets = selected_token_ids.masked_fill(attention_mask == 0, -100).reshape(-1)
        outputs = ("log_probs", "entropy") if self.compute_entropy else ("log_probs",)
        lp, ent, *_ = self._logprobs(hidden.reshape(-1, h), weight, bias, targets, self.config.temperature, None,
                                     self.softcap, self.logit_scale, outputs)
        if self.backend != "grpo_lab":  # the other backends score every row; zero the masked ones like grpo_lab
            keep = (targets >= 0).to(lp.dtype)
            lp = lp * keep
            ent = None if ent is None else ent * keep
        return lp.view(b, t), (None if ent is None else ent.view(b, t))

    def forward(self, hidden, weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, vllm_is_ratio=None, num_items_in_batch=None,
                sampling_per_token_logps=None, entropy_coef=None, gradient_accumulation_steps: int = 1,
                steps_per_generation: int = 1, num_processes: int = 1):
        """Returns `(loss, metrics)`; `loss` is what `backward()` is called on, `metrics` TRL's names → floats (a
        `LazyMetrics`: a value is read off the device only when looked at; `metrics.tensors()` keeps them there).

        `num_items_in_batch` (dapo/cispo/vespo normaliser) defaults to this micro-batch's valid-token count."""
        logps, entropies = self.per_token_logps(hidden, weight, selected_token_ids, attention_mask, bias)
        mask = attention_mask.to(logps.dtype)
        if num_items_in_batch is None:
            num_items_in_batch = mask.sum()
        coef = self.config.entropy_coef if entropy_coef is None else entropy_coef  # TRL's adaptive one, if passed
        out = grpo_loss(
            logps, mask, advantages, self.config,
            old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps,
            entropies=entropies if entropies is None or coef else entropies.detach(),
            importance_sampling_ratio=vllm_is_ratio, sampling_per_token_logps=sampling_per_token_logps,
            num_items_in_batch=num_items_in_batch, gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=steps_per_generation, num_processes=num_processes, entropy_coef=entropy_coef,
            training=self.training)
        return out.loss, out.metrics

    def extra_repr(self) -> str:
        return f"loss_type={self.config.loss_type!r}, beta={self.config.beta}, backend={self.backend!r}"
