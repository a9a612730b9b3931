"""papo_nb: a notebook workbook for PAPO-G on TRL 1.9.1's GRPOTrainer."""

import os

__version__ = "0.1.0"

if os.environ.get("ATEN_CPU_CAPABILITY"):
    # Another CPU's kernel path was asked for: refuse one this CPU cannot run (torch would die with SIGILL later) and
    # keep attention runnable under emulation, before any expensive work (papo_nb/testbed/kernel_paths.py).
    from papo_nb.testbed.kernel_paths import honour_requested_path

    honour_requested_path()
