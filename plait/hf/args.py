"""``TrainingArguments`` for ``plait.hf.Trainer``: transformers' own, with the ds_config taken by plait.

``deepspeed=`` (a path or a dict, as for DeepSpeed) and ``plait=`` are the same field: the config goes to
plait's engine, and transformers' DeepSpeed integration (which needs the deepspeed package) is never
started. Every other argument is transformers'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import transformers

from plait.config import ConfigError


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` plus ``plait`` (alias ``deepspeed``): the ds_config, a JSON
    path or a dict.

    Raises:
        ConfigError: both ``plait`` and ``deepspeed`` are given, or the config file cannot be read.
    """

    plait: dict | str | None = field(
        default=None, metadata={"help": "ds_config for plait's engine (path or dict)"}
    )

    def __post_init__(self):
        if self.deepspeed is not None:
            if self.plait is not None:
                raise ConfigError(
                    "TrainingArguments got both deepspeed= and plait=; they are the same ds_config, "
                    "pass one"
                )
            self.plait, self.deepspeed = self.deepspeed, None
        super().__post_init__()

    @property
    def place_model_on_device(self) -> bool:
        """False: ``plait.hf.Trainer`` places the model itself (a model built on the meta device by
        ``plait.hf.from_pretrained`` is placed by the engine, which reads its weights)."""
        return False

    def ds_config(self) -> dict:
        """The ds_config as a dict (read from its file when given as a path).

        Raises:
            ConfigError: no config was given, or the file is not JSON.
        """
        if self.plait is None:
            raise ConfigError(
                "plait.hf.Trainer needs a ds_config: TrainingArguments(deepspeed=...) or plait=..."
            )
        if isinstance(self.plait, dict):
            return self.plait
        path = os.fspath(self.plait)
        with open(path, encoding="utf-8") as fh:
            try:
                return json.load(fh)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path} is not valid JSON: {err}") from None
