#!/usr/bin/env bash
# The test command: make a virtual environment, install grpo-lab with its test extras, run pytest (CPU).
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "test,notebooks,liger"
cd "$ROOT"
python -m pytest "$@"
