"""grpo-lab: memory-lean, asynchronous GRPO with Hugging Face TRL.

The pieces, one module each: the GRPO loss reference (`loss_config`, `loss`), the log-prob backends behind one
switch (`backends`, `trl_glue`), the Triton kernels (`grpo_lab.kernels`), model configs (`models`), the memory
harness, data and rewards, the async LoRA glue and the router.
"""

__version__ = "0.1.0"
