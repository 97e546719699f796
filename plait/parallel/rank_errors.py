"""One error report for a torchrun job whose ranks fail alike.

plait's checks (a config key, a batch, a checkpoint) run alike on every rank, and every rank raises the
same error; torchrun then prints one traceback per rank. ``report_errors_once`` makes each rank but global
rank 0 wait ``GRACE_S`` before printing an uncaught exception: rank 0 prints it and exits, torchrun stops
the waiting ranks (its summary names rank 0 as the root cause), and the error shows once. A rank whose
error rank 0 does not share is still running after the wait and prints its own: nothing is lost, it only
comes ``GRACE_S`` later. ``PLAIT_ALL_RANK_ERRORS=1`` prints every rank's error at once.
"""

from __future__ import annotations

import os
import sys
import time

#: seconds a rank other than 0 holds its uncaught exception back (rank 0's report and exit take < 1 s)
GRACE_S = 5.0
#: set to "1" to print every rank's uncaught exception at once
ALL_RANKS_ENV = "PLAIT_ALL_RANK_ERRORS"


def report_errors_once(env: dict | None = None) -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), on every rank but global rank 0, wrap
    ``sys.excepthook`` so that an uncaught exception (KeyboardInterrupt aside) is printed only after
    ``GRACE_S`` seconds, by then torchrun has stopped this rank if rank 0 failed first. Other launchers do
    not stop the peers of a failed rank, so their ranks print at once, as without it. Idempotent.

    Args:
        env: the launcher's variables (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if (
        not env.get("TORCHELASTIC_RUN_ID")
        or int(env.get("RANK", "0")) == 0
        or env.get(ALL_RANKS_ENV) == "1"
        or getattr(sys.excepthook, "plait_waits", False)
    ):
        return
    previous = sys.excepthook

    def waiting_hook(kind, value, tb) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            time.sleep(GRACE_S)
        previous(kind, value, tb)

    waiting_hook.plait_waits = True
    sys.excepthook = waiting_hook
