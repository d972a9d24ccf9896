"""Where a run's numbers go besides ``metrics.jsonl``: the ``logger`` key (``none`` | ``tensorboard``).

Rank 0's :class:`~fedcp_dist.rundir.directory.RunWriter` hands every record it appends to ``metrics.jsonl``
and every batch of ``analysis.jsonl`` lines to the run's logger, so the logger sees the very values
those files hold. ``tensorboard`` writes them as TensorBoard scalars under ``RUN_DIR/tensorboard/``
(``tensorboard --logdir RUN_DIR``); ``none`` writes nothing.

Tags and steps (a step counts the rounds trained, as metrics.jsonl's ``round`` and
``evaluated_after`` do):

* ``round/<key>`` at step ``round``: every number of a round's record that is not an evaluation's
  (``train_loss``, ``seconds``, ``allreduce_bytes``, ``participants``, ...);
* ``eval/<key>`` at step ``evaluated_after``: the evaluation's numbers (``acc``, ``acc_client_mean``,
  ``auc``, ``test_loss``) of the round records and of the final evaluation;
* with analysis on: the scalars the method's probe layout makes of the ``analysis.jsonl`` lines
  (:meth:`fedcp_dist.capabilities.ProbeLayout.scalars`; FedCP's: ``analysis/pir_train``,
  ``analysis/loss_bef``, ``analysis/loss_aft`` at step ``round`` and ``analysis/pir_test`` at step
  ``evaluated_after``, each the sample-weighted mean over the clients probed).

TensorBoard stores a scalar as float32, so a value reads back as ``float(numpy.float32(value))``.

Resume: a run resumed after R rounds opens a new event file with ``purge_step=R`` (TensorBoard's own
convention: the readers hide every earlier event at a step >= R, the steps the stopped run may have
written past its checkpoint) and writes again the kept records' scalars at steps >= R; the rounds
after R then come as they are run, so each step holds one value. A run whose earlier part wrote no
events (``logger`` turned on when resuming) gets the kept records' scalars in full.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Tuple

#: the numbers of an evaluation (EvalSums.summary) in a metrics record
EVAL_KEYS = ("acc", "acc_client_mean", "auc", "test_loss")
#: keys of a metrics record that place it rather than measure it
_PLACE_KEYS = ("kind", "round", "evaluated_after")

Scalar = Tuple[str, int, float]  # (tag, step, value)
#: a method's analysis lines → scalars (its probe layout's ``scalars``)
AnalysisScalars = Callable[[Iterable[dict]], Iterator[Scalar]]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def record_scalars(record: dict) -> Iterator[Scalar]:
    """The scalars of one metrics.jsonl record (a round's or the final evaluation's)."""
    rnd, after = record.get("round"), record.get("evaluated_after")
    for key, value in record.items():
        if key in _PLACE_KEYS or not _number(value):
            continue
        if key in EVAL_KEYS and isinstance(after, int):
            yield f"eval/{key}", after, float(value)
        elif record.get("kind") == "round" and isinstance(rnd, int):
            yield f"round/{key}", rnd, float(value)


class NoLogger:
    """``logger: none``: every call does nothing."""

    def start(self, records: list, analysis_lines: list) -> None:
        pass

    def log_record(self, record: dict) -> None:
        pass

    def log_analysis(self, lines: list) -> None:
        pass

    def close(self) -> None:
        pass


def _quiet_writer_threads() -> None:
    """TensorBoard writes events from a thread of its own, which prints a traceback when a write
    fails (a full disk) and hands the error to the writer's next call, where the run says it in one
    line naming the folder: the thread's traceback is left out (any other thread's is printed)."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args):
        if not (isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


class TensorBoardLogger(NoLogger):
    """``logger: tensorboard``: TensorBoard event files in ``folder`` (the run's ``tensorboard/``);
    ``analysis``: what the method's analysis lines become (None: they write no scalars)."""

    def __init__(self, folder, analysis: Optional[AnalysisScalars] = None):
        self.dir = Path(folder)
        self._writer = None
        self._analysis = analysis or (lambda lines: iter(()))

    def start(self, records: list, analysis_lines: list) -> None:
        """Open the event file of this (possibly resumed) run: ``records`` and ``analysis_lines`` are
        what metrics.jsonl and analysis.jsonl keep of the rounds done before it."""
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.close()
        earlier = self.dir.is_dir() and any(p.name.startswith("events.") for p in self.dir.iterdir())
        # earlier event files are hidden whole (TensorBoard drops their steps >= the purge step) and
        # every kept record is written again: rounds run with the logger off in between, or past the
        # checkpoint resumed from, leave no gap and no stale value
        self._writer = SummaryWriter(str(self.dir), purge_step=0 if earlier else None)
        kept = [*(s for r in records for s in record_scalars(r)), *self._analysis(analysis_lines)]
        self._add(kept)

    def _add(self, scalars) -> None:
        if self._writer is None:
            self.start([], [])
        try:
            for tag, step, value in scalars:
                self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        except OSError:
            self._drop()  # its writer thread has ended: closing it later would raise the same again
            raise

    def _drop(self) -> None:
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except OSError:
            pass

    def log_record(self, record: dict) -> None:
        self._add(list(record_scalars(record)))

    def log_analysis(self, lines: list) -> None:
        self._add(list(self._analysis(lines)))

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def make_logger(name: str, folder, analysis: Optional[AnalysisScalars] = None) -> NoLogger:
    """The logger the ``logger`` key names, writing its files into ``folder`` (the run directory
    names it: :data:`fedcp_dist.rundir.directory.TENSORBOARD`); ``analysis``: the method's
    analysis lines → scalars."""
    return TensorBoardLogger(folder, analysis) if name == "tensorboard" else NoLogger()
