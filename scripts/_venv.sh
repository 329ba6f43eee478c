# Shared by scripts/test.sh and scripts/reproduce.sh: create ./.venv and install grpo-lab into it.
# torch is pinned first so the CPU wheel is used on CPU machines (an unpinned torch pulls a CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRPO_LAB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "torch==${GRPO_LAB_TORCH:-2.13.0}"
fi
"$VENV/bin/python" -m pip install -q -e "$ROOT[$1]"
export PATH="$VENV/bin:$PATH"
