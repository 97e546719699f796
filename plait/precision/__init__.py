"""Compute precisions beyond the ZeRO dtypes: float8 training (``plait.precision.float8``)."""
