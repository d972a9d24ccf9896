"""Rank 0 writes the run directory; every other rank gets a writer that does nothing.

Files: ``config.yaml`` (resolved), ``metrics.jsonl`` (one object per round), ``summary.json``,
``final_global.pt``. Whole-file writes go to a temporary name first and are renamed when complete.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fedcp_dist.fileio import atomic_torch_save, atomic_write_bytes


def _json_default(o: Any):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class RunWriter:
    def __init__(self, out_dir: str, enabled: bool):
        self.enabled = enabled
        self.dir = Path(out_dir)
        self._metrics = None
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write_text(self, name: str, text: str) -> None:
        if self.enabled:
            atomic_write_bytes(self.dir / name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        if self.enabled:
            self.write_text(name, json.dumps(obj, indent=2, default=_json_default) + "\n")

    def save_tensors(self, name: str, state: dict) -> None:
        if self.enabled:
            atomic_torch_save({k: v.detach().cpu() for k, v in state.items()}, self.dir / name)

    def start_metrics(self, records: list) -> None:
        """Begin metrics.jsonl afresh with ``records`` (those of a resumed checkpoint, or none)."""
        if not self.enabled:
            return
        self.close()
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in records)
        atomic_write_bytes(self.dir / "metrics.jsonl", text.encode("utf-8"))
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        """Append one line to metrics.jsonl and flush it."""
        if not self.enabled:
            return
        if self._metrics is None:
            self.start_metrics([])
        self._metrics.write(json.dumps(record, default=_json_default) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
