"""plait: tensor, pipeline and ZeRO data parallelism for training large transformers."""
__version__ = "0.1.0"
