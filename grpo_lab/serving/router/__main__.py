"""`python -m grpo_lab.serving.router`: the router from a terminal (the same as `python -m grpo_lab.router`)."""

from .server import main

main()
