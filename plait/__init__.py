"""plait: tensor, pipeline and ZeRO data parallelism for training large transformers."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """``plait.engine.initialize``: wrap a model for training (see its docstring)."""
    from plait.engine import initialize as _initialize

    return _initialize(*args, **kwargs)
