"""grpo-lab: memory-lean, asynchronous GRPO with Hugging Face TRL.

The pieces, one module each: the GRPO loss reference (`loss_config`, `loss`), the log-prob backends behind one
switch (`backends`, `trl_glue`), the Triton kernels (`grpo_lab.kernels`), model configs (`models`), the memory
harness, data and rewards, the async LoRA glue and the router.
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
