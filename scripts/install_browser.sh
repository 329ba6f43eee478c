#!/usr/bin/env bash
# The browser test tier's dependencies (tests/browser):
#  - Debian's Chromium, its driver and fonts (apt-get; Playwright drives /usr/bin/chromium, it downloads no browser);
#  - Playwright from PyPI into ./.venv (extra `browser`, with the test extras);
#  - ./.venv-colab: Colab's widget stack (ipywidgets 7.7.1, widgetsnbextension 3.6.1, nbclassic) over ./.venv's
#    packages, for the classic-Notebook check of widget protocol 2.
# Then `GRPO_LAB_REQUIRE_BROWSER=1 bash scripts/test.sh tests/browser` runs the tier (CI runs it in the whole suite).
set -euo pipefail
source "$(dirname "$0")/_venv.sh" "test,notebooks,liger,browser"
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core fonts-liberation
fi
COLAB="${GRPO_LAB_COLAB_VENV:-$ROOT/.venv-colab}"
if [ ! -x "$COLAB/bin/python" ]; then
  "$PY" -m venv "$COLAB"
fi
# ./.venv's packages (torch, trl, grpo-lab itself ...) after .venv-colab's own: site.addsitedir also runs their .pth
# files, so the editable grpo-lab install is found too
BASE_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
COLAB_SITE="$("$COLAB/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$BASE_SITE')" > "$COLAB_SITE/grpo_lab_base_env.pth"
# widgetsnbextension 3.6.1 (ipywidgets 7.7.1's own): 3.6.10's Output model fails in the classic notebook
# ("_deserialize_state is not a function"), a frontend bug that would hide every Output widget
"$COLAB/bin/python" -m pip install -q "ipywidgets==7.7.1" "widgetsnbextension==3.6.1" "nbclassic>=1.1,<2"
# notebook_shim's server config must be in this prefix too: it makes the server read nbconfig/, where
# widgetsnbextension enables its frontend extension (without it: "Widgets are not available")
"$COLAB/bin/python" -m pip install -q --no-deps --ignore-installed notebook_shim
"$COLAB/bin/python" -c "import ipywidgets, grpo_lab; assert ipywidgets.__version__ == '7.7.1', ipywidgets.__version__"
chromium --version 2>/dev/null
