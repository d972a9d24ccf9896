"""The config keys of what rank 0 writes besides the run directory's own files, declared apart from
the code that reads them (:mod:`fedcp_dist.rundir.loggers`).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

from fedcp_dist.options import Component, Option, described

#: the values of the ``logger`` config key
LOGGERS = ("none", "tensorboard")


def logger_problem(name: str) -> Optional[str]:
    """Why ``logger: name`` cannot run here (for the config check), or None."""
    if name not in LOGGERS:
        return f"must be one of {', '.join(LOGGERS)}, got {name!r}"
    if name == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        return ("'tensorboard' needs the tensorboard package, which is not installed: "
                "pip install tensorboard (or pip install -e '.[tensorboard]')")
    return None


class Logging(Component):
    """Where rank 0 also writes the metrics."""

    options = (
        Option("logger", "none", "none | tensorboard: rank 0 also writes every round's metrics and the analysis means "
               "as TensorBoard events into out_dir/tensorboard/ (needs the tensorboard package)",
               described(" | ".join(LOGGERS), logger_problem)),
    )
