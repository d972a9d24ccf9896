"""What a method may do besides the hooks every method has (:class:`~fedcp_dist.algorithms.base.Algorithm`):
each optional capability is a small protocol, which a method implements by defining its members.

* :class:`PeerExchange`: its clients need other clients' models (FedAMP, FedFomo): after the server
  update every participant's payload reaches every rank in one all-gather;
* :class:`ClientVectors`: it keeps a vector per client that feature-difference client selection
  compares (FedCP);
* :class:`Probes`: it measures itself for ``analysis: true`` (FedCP's policy): numbers per client
  that ride in the round's all-reduce as rows of its :class:`ProbeLayout`, which also says what
  the rows mean (the lines of ``analysis.jsonl``).

The engine asks :func:`supports` before it uses one, and a config key that needs one is refused for
a method without it. Nothing here imports the engine, so the option declarations can ask too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

if TYPE_CHECKING:  # for the annotations only: this module imports no torch
    import torch

    State = Dict[str, torch.Tensor]


class PeerExchange(Protocol):
    """Other clients' models each round: every participant's flat payload is gathered on every
    rank, and the method updates the global state from them, alike on every rank."""

    #: length of the flat float32 vector each participant shares (> 0)
    peer_dim: int

    def peer_payload(self, result: Any) -> "torch.Tensor":
        """The vector (``peer_dim`` long) a participant shares after training, from its LocalResult."""
        ...

    def receive_peers(self, round_idx: int, global_state: "State", peers: Dict[int, "torch.Tensor"]) -> "State":
        """New global state from the round's ``{client: payload}`` (the same on every rank)."""
        ...

    def peer_memory_bytes(self, num_clients: int) -> int:
        """Bytes per rank the method keeps for other clients' models (its part of the global state)."""
        ...


class ClientVectors(Protocol):
    """A vector per client (FedCP: the column sums of its personal head's weight) that
    feature-difference client selection gathers and compares."""

    #: the vectors' length
    client_vector_dim: int

    def client_vector(self, client_state: Optional["State"]) -> "torch.Tensor":
        """The client's latest vector (float32, ``client_vector_dim`` long) from its persistent state;
        ``None`` (it has not trained yet): its initial vector."""
        ...


class EvalTally(Protocol):
    """One client's evaluation probes, added up over its test batches."""

    def add(self, probe: Any) -> None:
        """A test batch's probe (what :meth:`Probes.predict_probe` returned beside the logits)."""
        ...

    def row(self) -> Optional[Sequence[float]]:
        """The client's evaluation row (``ProbeLayout.eval_width`` values), or None: nothing tallied."""
        ...


class ProbeLayout(Protocol):
    """A method's probe rows: a training row per member of a round's cohort and an evaluation row per
    evaluated client (the engine says which client each row is), float64, summed over ranks in the round's all-reduce (a client's rows are non-zero on its owner only), and
    the ``analysis.jsonl`` lines they mean. A line is ``{"kind": "train", "round": r, ...}`` (1-based)
    or ``{"kind": "eval", "evaluated_after": t, ...}``, which resume keeps up to the rounds done."""

    train_width: int
    eval_width: int

    def train_row(self, result: Any, losses: Tuple[float, float], loss_samples: int) -> Sequence[float]:
        """A trained client's row from its LocalResult (trained with ``ctx.probe``) and the (Σ loss
        before, Σ loss after) of :meth:`Probes.probe_losses` over ``loss_samples`` samples."""
        ...

    def eval_tally(self) -> EvalTally:
        """An empty evaluation tally for one client."""
        ...

    def records(self, train: "torch.Tensor", evals: "torch.Tensor", round_idx: Optional[int],
                evaluated_after: Optional[int], train_ids: Optional[Sequence[int]] = None,
                eval_ids: Optional[Sequence[int]] = None) -> List[dict]:
        """The lines of the reduced rows (train: (rows, train_width), evals: (rows, eval_width)): the
        evaluation after ``evaluated_after`` rounds, then round ``round_idx``'s training (0-based;
        None: none). Row k is client ``train_ids[k]`` / ``eval_ids[k]`` (None: client k); a row
        whose flag is 0 (a client without probes, or a row past the round's cohort) is no line."""
        ...

    def scalars(self, lines: Iterable[dict]) -> Iterator[Tuple[str, int, float]]:
        """(tag, step, value) of the lines for a logger (``logger: tensorboard``), steps counting
        the rounds trained as the lines' ``round`` and ``evaluated_after`` do."""
        ...


class Probes(Protocol):
    """Numbers about the method for ``analysis.jsonl`` (FedCP: its policy's personal share s and the
    loss before and after local learning); results are the same with them taken."""

    probe_layout: ProbeLayout

    def predict_probe(self, client_state: Optional["State"], x: "torch.Tensor", ctx: Any) -> Tuple["torch.Tensor", Any]:
        """(logits, probe): :meth:`~fedcp_dist.algorithms.base.Algorithm.predict`'s very logits and
        what the evaluation tally adds up (None: nothing for this batch)."""
        ...

    def probe_losses(self, before: Optional["State"], result: Any, data: Any, ctx: Any) -> Tuple[float, float]:
        """(Σ loss before, Σ loss after local learning) over the client's training samples; changes
        nothing the run goes on with."""
        ...


def members(capability: type) -> Tuple[str, ...]:
    """The names a method defines to implement ``capability``: its attributes and its operations."""
    names = set(getattr(capability, "__annotations__", {}))
    names |= {n for n, v in vars(capability).items() if callable(v) and not n.startswith("_")}
    return tuple(sorted(names))


def supports(method: Any, capability: type) -> bool:
    """Whether ``method`` (an algorithm or its class) implements ``capability``: it defines every member."""
    return all(hasattr(method, name) for name in members(capability))
