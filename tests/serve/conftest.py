import pytest

from tests.serve.harness import draft_vocab, load_backend


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every serve test runs on one intra-op thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def local(tiny_llama_dir):
    """The tiny target in this process, with the draft vocab every client test sets: the reference."""
    backend = load_backend(tiny_llama_dir)
    backend.set_vocab_mapping(draft_vocab())
    yield backend
    backend.close()
