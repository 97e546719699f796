import os

# Keep each test process to one intra-op thread: CI has 2 cores and multi-rank tests start several.
os.environ.setdefault("OMP_NUM_THREADS", "1")
