"""A user without Chromium gets a skip that says why and how to install it; where GRPO_LAB_REQUIRE_BROWSER is set
(CI), the same situation is a failure."""

import pytest

from .conftest import REQUIRE_ENV, chromium_path, missing_or_fail


def test_missing_browser_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no Chromium.*install_browser.sh"):
        missing_or_fail("no Chromium found")


@pytest.mark.parametrize("value", ["1", "yes"])
def test_missing_browser_fails_where_required(monkeypatch, value):
    monkeypatch.setenv(REQUIRE_ENV, value)
    with pytest.raises(pytest.fail.Exception, match="must run"):
        missing_or_fail("no Chromium found")


def test_chromium_override_must_be_an_executable(monkeypatch, tmp_path):
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("GRPO_LAB_CHROMIUM", str(fake))
    assert chromium_path() != str(fake)          # not executable: not taken
    fake.chmod(0o755)
    assert chromium_path() == str(fake)
