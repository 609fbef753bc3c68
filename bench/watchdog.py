"""A hung kernel should cost seconds of device time, not a step's whole limit."""
import os
import time

import torch

HUNG_EXIT = 3  # the exit code bench/steps.sh reports for a step that found a hang


def finish_or_exit(label: str, seconds: float = 30.0):
    """Wait for the work queued so far; if it is not done in ``seconds``, print ``label`` and
    end the process at once (the driver then tears the kernel down with the context)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"HUNG: {label}: not done after {seconds:.0f} s", flush=True)
            os._exit(HUNG_EXIT)
        time.sleep(0.005)
