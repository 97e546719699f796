"""The one exception type of the checkpoint package."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, inconsistent, or does not fit the model or request.

    The message names the checkpoint directory or file, the tensor, and the numbers involved.
    """
