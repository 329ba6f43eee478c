"""How to install one of grpo-lab's extras, said the same way by every message that names one.

No package index serves grpo-lab, so `pip install 'grpo-lab[ray]'` fails with "no matching distribution": an extra
is installed from a clone (`pip install -e ".[ray]"`) or from the repository's git URL.
"""

from __future__ import annotations

REPOSITORY = "https://github.com/grpo-lab/grpo-lab"  # where grpo-lab is installed from (README, docs)


def install_hint(*extras: str) -> str:
    """`pip install ...` for `extras` (e.g. "ray"), from a clone or from the repository: what a message says to do."""
    names = ",".join(extras)
    return f'pip install -e ".[{names}]" in a clone of grpo-lab, or pip install "grpo-lab[{names}] @ git+{REPOSITORY}"'
