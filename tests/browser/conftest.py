"""The browser tier: real notebooks in a real frontend in headless Chromium (Debian's), driven by Playwright.

Skips, with the reason, for a user who has no Chromium or no Playwright; CI sets GRPO_LAB_REQUIRE_BROWSER=1 (see
.ci/run and scripts/install_browser.sh), which turns that skip into a failure. Screenshots go to
`browser-screenshots/` at the repository root (git-ignored; `GRPO_LAB_BROWSER_ARTIFACTS` moves them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "GRPO_LAB_REQUIRE_BROWSER"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
VIEWPORT = {"width": 1400, "height": 1800}   # tall: most cells fit whole in a screenshot


def chromium_path() -> str | None:
    for candidate in (os.environ.get("GRPO_LAB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def missing_or_fail(reason: str):
    """Skip for a user without the browser tier's dependencies; fail where CI requires the tier."""
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set: the browser tier must run; bash scripts/install_browser.sh)")
    pytest.skip(f"{reason}: bash scripts/install_browser.sh installs it (Debian's chromium + Playwright)")


@pytest.fixture(scope="session")
def chromium() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing_or_fail("Playwright is not installed")
    path = chromium_path()
    if path is None:
        missing_or_fail("no Chromium found (/usr/bin/chromium, or set GRPO_LAB_CHROMIUM)")
    return path


@pytest.fixture(scope="session")
def artifacts() -> Path:
    folder = Path(os.environ.get("GRPO_LAB_BROWSER_ARTIFACTS") or ROOT / "browser-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="package")
def browser(chromium, tmp_path_factory):
    """One Chromium for this tier, with a fresh profile (--user-data-dir) and Playwright's own flags off.

    Package scope, not session: Playwright's sync API keeps an asyncio loop marked running on the main thread
    while it is open, and every later test that calls `asyncio.run` (router, real vLLM) would fail."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=CHROMIUM_FLAGS, viewport=VIEWPORT,
            ignore_default_args=["--enable-automation"])
        try:
            yield context
        finally:
            context.close()


def notebook_tree(dest: Path) -> Path:
    """A copy of notebooks/ for the server to serve: JupyterLab saves what the test edits and runs, and the
    committed notebooks must stay output-free."""
    shutil.copytree(ROOT / "notebooks", dest / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return dest


@contextlib.contextmanager
def serving(start, base: Path):
    """`start(root, workdir, env)` over a copy of notebooks/, the notebooks' runs writing under base/outputs;
    stopped by its PID afterwards."""
    root = notebook_tree(base / "root")
    server = start(root, base, dict(os.environ, GRPO_LAB_OUTPUT_DIR=str(base / "outputs")))
    try:
        yield server
    finally:
        server.stop()
