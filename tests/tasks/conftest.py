import pytest

from grpo_lab.tasks.data import shared_data_dir


@pytest.fixture(scope="session")
def shared_data():
    """The shared offline copies, read in place (fails with a clear message when missing; never skipped)."""
    return shared_data_dir()
