"""`python -m grpo_lab.router ...`: the prefix-aware multi-replica proxy (see `grpo_lab.serving.router.server`)."""

from grpo_lab.serving.router.server import main

if __name__ == "__main__":
    main()
