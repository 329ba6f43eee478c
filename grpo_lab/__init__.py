"""grpo-lab: memory-lean, asynchronous GRPO with Hugging Face TRL.

One sub-package per idea (docs/architecture.md draws the layers): `loss` (the GRPO loss, the log-prob heads behind
one backend switch, the Triton kernel), `models`, `lab`, `memory`, `tasks`, `serving` (the router and its replicas)
and `async_loop`. The loss stack's public names are re-exported here, imported on first use:
`grpo_lab.GRPOLabConfig`, `GRPOLabTrainer`, `set_loss_backend`, `GRPOLossConfig`, `grpo_loss`,
`GRPOLabFusedLinearGRPOLoss`, `fused_linear_logprobs`.
"""

from .lab import environment as _environment

__version__ = "0.1.0"

_environment.no_hub_telemetry()  # offline first: no Hub telemetry from TRL's trainers unless the user asks for it


_LOSS_EXPORTS = ("GRPOLabConfig", "GRPOLabTrainer", "set_loss_backend", "GRPOLossConfig", "grpo_loss",
                 "GRPOLabFusedLinearGRPOLoss", "fused_linear_logprobs")


def __getattr__(name: str):
    if name in _LOSS_EXPORTS:  # imported on first use: `import grpo_lab` stays free of torch, TRL and Triton
        from . import loss

        return getattr(loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
