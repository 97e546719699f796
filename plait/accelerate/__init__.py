"""accelerate scripts that use DeepSpeed, on plait's engine: change the import line only::

    from plait.accelerate import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler
    # was: from accelerate import Accelerator, DeepSpeedPlugin; from accelerate.utils import DummyOptim, ...

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="ds_config.json"))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)

Launch with ``torchrun`` or ``python -m plait.accelerate.launch``. ``DeepSpeedPlugin``, ``DummyOptim`` and
``DummyScheduler`` are accelerate's own classes (from ``accelerate.utils.deepspeed``). Needs accelerate (the
``hf`` extra). The methods and the training loop: ``docs/accelerate.md``.
"""

from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

from plait.accelerate.accelerator import Accelerator

__all__ = ["Accelerator", "DeepSpeedPlugin", "DummyOptim", "DummyScheduler"]
