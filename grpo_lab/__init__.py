"""grpo-lab: memory-lean, asynchronous GRPO with Hugging Face TRL.

One sub-package per idea (docs/architecture.md draws the layers): `loss` (the GRPO loss, the log-prob heads behind
one backend switch, the Triton kernel), `models`, `lab`, `memory`, `tasks`, `serving` (the router and its replicas)
and `async_loop`. The loss stack's public names are re-exported here, imported on first use:
`grpo_lab.GRPOLabConfig`, `GRPOLabTrainer`, `set_loss_backend`, `GRPOLossConfig`, `grpo_loss`,
`GRPOLabFusedLinearGRPOLoss`, `fused_linear_logprobs`.
"""

__version__ = "0.1.0"


def _no_hub_telemetry():
    """Offline first: TRL's trainers report usage to the Hub (`huggingface_hub.send_telemetry`) on every start,
    which is a network call from every notebook cell and every fresh-process probe. Off unless the user set
    HF_HUB_DISABLE_TELEMETRY themselves; children of this process inherit the setting."""
    import os
    import sys

    if "HF_HUB_DISABLE_TELEMETRY" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:  # imported before grpo_lab: it read the variable already
        hub.HF_HUB_DISABLE_TELEMETRY = True


_no_hub_telemetry()


_LOSS_EXPORTS = ("GRPOLabConfig", "GRPOLabTrainer", "set_loss_backend", "GRPOLossConfig", "grpo_loss",
                 "GRPOLabFusedLinearGRPOLoss", "fused_linear_logprobs")


def __getattr__(name: str):
    if name in _LOSS_EXPORTS:  # imported on first use: `import grpo_lab` stays free of torch, TRL and Triton
        from . import loss

        return getattr(loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
