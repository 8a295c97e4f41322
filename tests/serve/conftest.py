import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every serve test runs on one intra-op thread (see tests/conftest.py)."""
