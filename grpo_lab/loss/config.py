"""The loss fields of TRL 1.16's `GRPOConfig`, as one documented dataclass.

Every backend and the reference loss read their options from here, so "what loss is computed" has one home. The
field names, defaults and meaning are TRL's; `from_trl_args` copies them out of a `GRPOConfig`, and `__post_init__`
rejects what TRL rejects (with the same meaning) plus values TRL would only fail on later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class GRPOLossConfig:
    r"""
    Options of the GRPO loss, with TRL 1.16's names and defaults.

    Args:
        loss_type (`str`, defaults to `"dapo"`):
            One of `"grpo"` (per-sequence mean, then batch mean), `"bnpo"` (mean over the micro-batch's tokens),
            `"dr_grpo"` (sum / (B · max_completion_length)), `"dapo"` (sum / tokens of the whole generation batch),
            `"cispo"` (clipped IS weight times log-prob, DAPO normaliser), `"sapo"` (soft gate, GRPO normaliser),
            `"luspo"` (per-sequence sum, batch mean) and `"vespo"` (gamma-weighted sequence IS, DAPO normaliser).
        importance_sampling_level (`str`, defaults to `"token"`):
            `"token"` keeps one ratio per token; `"sequence"` uses the masked mean log-ratio of the sequence (GSPO).
        epsilon (`float`, defaults to `0.2`):
            Lower clipping bound: ratios below `1 - epsilon` are clipped.
        epsilon_high (`float` or `None`, defaults to `None`):
            Upper clipping bound (`1 + epsilon_high`); `None` means `epsilon`. For `cispo` it is the ratio cap itself.
        delta (`float` or `None`, defaults to `None`):
            Two-sided clipping: the unclipped ratio is capped at `delta` (INTELLECT-2).
        beta (`float`, defaults to `0.0`):
            Weight of the k3 KL penalty to the reference policy. `0.0` needs no reference log-probs.
        use_bias_correction_kl (`bool`, defaults to `True`):
            Multiply the per-token KL by the (differentiable) importance ratio (DeepSeek-V3.2).
        temperature (`float`, defaults to `1.0`):
            Logits are divided by it before the log-softmax (used by the log-prob backends).
        top_entropy_quantile (`float`, defaults to `1.0`):
            Keep the policy loss only on tokens whose entropy is in this top quantile (`1.0` keeps all).
        off_policy_mask_threshold (`float` or `None`, defaults to `None`):
            Drop negative-advantage sequences whose mean KL(sampler ‖ policy) exceeds it (DeepSeek-V3.2 OPSM).
        vllm_importance_sampling_correction (`bool`, defaults to `True`):
            Multiply the per-token loss by the vLLM importance-sampling ratio when one is given.
        vllm_importance_sampling_mode (`str`, defaults to `"sequence_mask"`):
            How the ratio is formed from training and sampling log-probs: `token_truncate`, `token_mask`,
            `sequence_truncate` or `sequence_mask` (see `vllm_importance_sampling_ratio`).
        vllm_importance_sampling_clip_min (`float` or `None`, defaults to `None`):
            Lower bound C_min of the vLLM IS ratio.
        vllm_importance_sampling_clip_max (`float` or `None`, defaults to `3.0`):
            Upper bound C_max of the vLLM IS ratio.
        entropy_coef (`float`, defaults to `0.0`):
            Entropy bonus: the loss becomes `loss - entropy_coef · mean entropy` (mean over the tokens the policy loss
            acts on, scaled only for gradient accumulation).
        sapo_temperature_pos (`float`, defaults to `1.0`), sapo_temperature_neg (`float`, defaults to `1.05`):
            SAPO gate temperatures for positive / non-positive advantages.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg (`float`, defaults `2.0, 3.0, 3.0, 2.0`):
            VESPO gamma-weight shape for non-negative / negative advantages.
        max_completion_length (`int`, defaults to `256`):
            The `dr_grpo` normaliser.
    """

    loss_type: str = field(default="dapo", metadata={"help": f"One of {LOSS_TYPES}."})
    importance_sampling_level: str = field(default="token", metadata={"help": "'token' or 'sequence'."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping epsilon."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping epsilon; None = epsilon."})
    delta: float | None = field(default=None, metadata={"help": "Cap of the unclipped ratio (two-sided clip)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient."})
    use_bias_correction_kl: bool = field(default=True, metadata={"help": "Weight the KL by the IS ratio."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature the logits are divided by."})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Train on the top-q entropy tokens."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "OPSM KL threshold."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "Apply the vLLM IS ratio."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": f"One of {VLLM_IS_MODES}."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "C_min."})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "C_max."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO temperature, positive advantages."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO temperature, other advantages."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO k, non-negative advantages."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO lambda, non-negative advantages."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO k, negative advantages."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO lambda, negative advantages."})
    max_completion_length: int = field(default=512, metadata={"help": "dr_grpo normaliser (TRL's default 512)."})

    def __post_init__(self):
        for name, allowed in (("loss_type", LOSS_TYPES), ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
                              ("vllm_importance_sampling_mode", VLLM_IS_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Unknown {name} {getattr(self, name)!r}; expected one of {', '.join(allowed)}.")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                             f"vllm_importance_sampling_clip_max ({hi}).")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                and lo is None and hi is None):
            raise ValueError("At least one of vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max "
                             "must be set when vllm_importance_sampling_mode is a *_truncate mode.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:  # 0 keeps only the highest-entropy token (as TRL)
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}.")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("epsilon and epsilon_high must be non-negative.")
        if self.max_completion_length is not None and self.max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be positive, got {self.max_completion_length}.")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check_vllm_compatible(self) -> None:
        """TRL refuses VESPO with a sequence-level vLLM IS mode (VESPO folds token ratios into its own weight)."""
        if (self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode to be 'token_truncate' or "
                             f"'token_mask', got {self.vllm_importance_sampling_mode!r}.")

    @classmethod
    def from_trl_args(cls, args) -> "GRPOLossConfig":
        """The loss options of a TRL `GRPOConfig` (or anything with the same attribute names)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
