#!/usr/bin/env bash
# Open the notebooks in JupyterLab on the project's environment (./.venv, made or updated first), on 127.0.0.1.
# Arguments go to `grpo-lab lab` (e.g. --port 8899 --no-browser).
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "notebooks,liger"
cd "$ROOT"
exec python -m grpo_lab.cli lab "$@"
