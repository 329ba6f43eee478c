"""`python -m grpo_lab.router ...`: the prefix-aware multi-replica proxy (see `grpo_lab.serving.router`)."""

from grpo_lab.serving.router import main
from grpo_lab.serving.router_config import RouterConfig
from grpo_lab.serving.router_thread import start_router

__all__ = ["RouterConfig", "main", "start_router"]

if __name__ == "__main__":
    main()
