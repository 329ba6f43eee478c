"""The `trl` head: TRL 1.16's own fused LM head (`trl.kernels.ChunkedLogProbFunction`), beside ours for comparison.

Only the argument checks and the `chunk_size=None` default are added, so that every head answers the same call
(`contract`) the same way."""

from __future__ import annotations

from trl.kernels import ChunkedLogProbFunction

from ..contract import check_logprob_inputs


def trl_logprobs(hidden, weight, bias, targets, temperature=1.0, chunk_size=4096, softcap=None, logit_scale=1.0,
                 outputs=("log_probs",)):
    check_logprob_inputs(hidden, weight, bias, targets, temperature, outputs)
    chunk_size = chunk_size or 4096  # callers pass None for "the backend's default"; TRL's function needs an int
    return ChunkedLogProbFunction.apply(hidden, weight, bias, targets.clamp(min=0), temperature, chunk_size, softcap,
                                        logit_scale, tuple(outputs))
