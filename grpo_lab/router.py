"""`python -m grpo_lab.router ...`: the prefix-aware multi-replica proxy (see `grpo_lab.serving.router.server`)."""

from grpo_lab.serving.router.server import main
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

__all__ = ["RouterConfig", "main", "start_router"]

if __name__ == "__main__":
    main()
