#!/usr/bin/env bash
# The main job on the embedded default: execute every notebook headless in quick mode (CPU) and write results/.
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "notebooks,liger"
cd "$ROOT"
python -m grpo_lab.cli reproduce --quick "$@"
