import os

import pytest

# Keep each test process to one intra-op thread: CI has 2 cores and multi-rank tests start several.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it: transformers 4.x's ``TrainingArguments(bf16=True)`` sets
    ``ACCELERATE_MIXED_PRECISION``, which later tests' subprocesses would inherit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
