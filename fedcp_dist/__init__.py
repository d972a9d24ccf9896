"""fedcp_dist: FedCP and its baselines, one process per GPU, aggregated with torch.distributed."""
import os as _os
import sys as _sys

try:
    _os.getcwd()
except FileNotFoundError:
    # a shell left in a folder that was removed: loading torch then dies in its math library
    # ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), which names nothing of the cause
    _sys.stderr.write("error: the current directory no longer exists (it was removed while the shell was in it): "
                      "cd to a folder that exists and run the command again\n")
    raise SystemExit(2)
