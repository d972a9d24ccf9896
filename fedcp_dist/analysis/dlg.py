"""Deep Leakage from Gradients (DLG) and iDLG: how much a semi-honest server sees in an upload.

The threat model (the protocol FedCG uses and FedCP's paper follows): the server runs the protocol
honestly but tries to reconstruct a client's training images from what that client uploads in one
round. It knows what it sent (the global state), the upload, the learning rate η, the batch size B
and the number of local steps S, and the architecture. It treats (sent − uploaded) / (η·S) of every
uploaded parameter as the gradient of the round's loss (exact for S = 1 and plain SGD), and looks for
dummy images x' (and, for DLG, soft labels y') whose gradient matches it:

    min over x', y'   Σ_k ‖ĝ_k(x', y') − g_k‖² / Σ_k ‖g_k‖²

with L-BFGS (DLG, Zhu et al. 2019). iDLG (Zhao et al. 2020) first reads the labels off the
classification layer's gradient (the row of the true class is the only one with a negative sum,
since ∂CE/∂W_c = (p_c − y_c)·hᵀ and h ≥ 0) and optimises the images only.

What each method uploads, and so what the server matches:

* FedAvg — the whole model: the gradient of every parameter.
* FedPer — the extractor only; the personal head never leaves the client, so the server computes its
  gradients through the head it knows (the initial one it keeps), not the client's.
* FedCP — the extractor, the CPN and the mixed head Ŵ_i = (W^hd + W_i^hd)/2. The personal head
  W_i^hd the client started from is unknown to the server, so (W^hd − Ŵ_i)/(η·S) carries
  (W^hd − W_i^hd)/(2η·S) besides half the head's gradient; the server's copy uses its own W^hd for
  W_i^hd (and the column sums of W^hd for the client vector v_i) and the expected policy (no Gumbel
  noise). The MMD term has a zero gradient at the start of local training (it is minimal when
  the trained and the frozen extractor agree), so it does not enter the server's copy.

``knowledge="oracle"`` gives the server the client's private state as well (an upper bound on
leakage). The upload itself always comes from the method's real ``local_train`` on the attacked
samples, starting from the run's checkpointed states; before attacking, the server's copy of the
method is checked against the method's own ``predict``.

Reconstructions live in pixel space, x' = sigmoid(z) ∈ [0, 1], normalised as the run normalises its
images before the model sees them; scores are PSNR and SSIM against the true pixels, the images of
a batch paired by an optimal assignment.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from fedcp_dist.analysis.imaging import match_images, psnr, ssim
from fedcp_dist.errors import UserError

ATTACKS = ("dlg", "idlg")
KNOWLEDGE = ("server", "oracle")
#: largest difference allowed between the server's copy of a method and the method's own predictions
SELF_CHECK_TOL = 1e-4

from fedcp_dist.analysis.gradient_match import infer_labels, reconstruct
from fedcp_dist.analysis.server_copy import METHODS, ServerCopy, observed_gradient


# ----------------------------------------------------------------------------- attacking a run


@dataclass
class AttackSetup:
    """How the attacked client trains and how hard the server tries."""

    clients: list
    batches: int = 2  # attacked uploads per client
    batch_size: int = 1  # B
    local_steps: int = 1  # S: the client trains S steps of B samples, on B·S samples
    attacks: tuple = ATTACKS
    steps: int = 100  # L-BFGS iterations per restart
    restarts: int = 1
    knowledge: str = "server"
    seed: int = 0
    #: DP settings the upload is attacked under, [(clip C, noise multiplier σ)] (empty: as sent)
    dp: tuple = ()

    def check(self) -> None:
        if not self.clients:
            raise UserError("--clients: name at least one client to attack")
        for key in ("batches", "batch_size", "local_steps", "steps", "restarts"):
            if getattr(self, key) < 1:
                raise UserError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad or not self.attacks:
            raise UserError(f"--attacks: choose from {', '.join(ATTACKS)}, got {','.join(self.attacks) or 'none'}")
        if self.knowledge not in KNOWLEDGE:
            raise UserError(f"--knowledge must be one of {', '.join(KNOWLEDGE)}, got {self.knowledge!r}")
        for clip, noise in self.dp:
            if not clip > 0 or not noise >= 0 or math.isnan(noise) or math.isinf(noise):
                raise UserError(f"--dp-clip must be > 0 (inf: no clipping) and --dp-noise >= 0, got C={clip}, σ={noise}")
            if math.isinf(clip) and noise > 0:
                raise UserError(f"--dp-noise {noise:g} needs a finite --dp-clip: the noise's standard deviation is σ·C")

    @property
    def samples(self) -> int:
        return self.batch_size * self.local_steps


@dataclass
class AttackResult:
    run: str
    method: str
    client: int
    batch: int
    attack: str
    psnr: float  # mean over the batch's images, dB
    ssim: float
    label_acc: float  # fraction of the batch's labels recovered (after pairing)
    labels_inferred: bool  # iDLG could read the labels off the upload
    distance: float  # relative gradient distance reached
    truth: torch.Tensor = field(repr=False)
    guess: torch.Tensor = field(repr=False)
    #: the DP setting the upload was attacked under (None: as sent)
    dp_clip: Optional[float] = None
    dp_noise: Optional[float] = None

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("run", "method", "client", "batch", "attack", "psnr", "ssim", "label_acc",
                                               "labels_inferred", "distance", "dp_clip", "dp_noise")}


def attacked_samples(n_train: int, count: int, seed: int, client: int, batch: int) -> np.ndarray:
    """Which of a client's training samples an attacked upload trains on: ``count`` distinct rows
    drawn from (seed, client, batch), the same in every run on the same shard."""
    rng = np.random.default_rng([int(seed), int(client), int(batch)])
    return np.sort(rng.choice(n_train, size=count, replace=False))


def server_copy(state, cid: int, knowledge: str, local_steps: int) -> ServerCopy:
    """The server's copy of client ``cid``'s local training in the run ``state``: the method's model
    built afresh, the global state the server sent (with the client's own BatchNorm statistics,
    which the client does not upload), and the client's private state only with ``oracle``."""
    from fedcp_dist.models import build_model, model_options

    cfg, info = state.cfg, state.info
    model = build_model(cfg.model, info.input_shape, info.num_classes, vocab_size=info.vocab_size, **model_options(cfg)).to(state.device)
    sent = state.sent(cid)
    private = None
    if knowledge == "oracle" and cfg.method != "fedavg":
        private = state.use_client(cid)
    return ServerCopy(cfg.method, model, sent, private, cfg.lr * local_steps, info.mean, info.std, cfg.tau)


def check_finite(state, clients) -> None:
    """The models the attack starts from are finite: a diverged run's nan weights predict nan, and
    the self-check took that for a copy of the method that had drifted from its code."""
    for cid in clients:
        for what, tensors in (("model", state.sent(cid)), (f"client {cid}'s state", state.store.get(cid) or {})):
            bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            if bad:
                raise UserError(f"the {what} checkpointed in {state.run_dir} after {state.rounds_done} round(s) is not "
                                f"finite ('{bad[0]}'): the run diverged, and there is nothing to attack")


def self_check(state, cid: int, x_norm: torch.Tensor) -> None:
    """The server's copy, given the client's true state, must predict what the method predicts:
    a guard against the copy drifting from the method's code."""
    from fedcp_dist.algorithms.base import Context

    copy_ = server_copy(state, cid, "oracle", 1)
    client_state = state.use_client(cid)
    ctx = Context(state.rounds_done, cid, torch.Generator(device=state.device).manual_seed(0))
    expected = state.algo.predict(client_state, x_norm, ctx)
    got = copy_.predict(x_norm)
    if not bool(torch.isfinite(expected).all()):
        raise UserError(f"the model checkpointed in {state.run_dir} after {state.rounds_done} round(s) predicts "
                        f"non-finite values for client {cid}: the run diverged, and there is nothing to attack")
    diff = float((expected - got).abs().max())
    if not diff <= SELF_CHECK_TOL:
        raise UserError(f"the DLG attacker's copy of {state.cfg.method} does not reproduce the method's own "
                        f"predictions in {state.run_dir} (max difference {diff:.3g}); the method has changed")


@dataclass
class Upload:
    """One client's round as the server sees it, with the truth kept for scoring."""

    client: int
    batch: int
    truth: torch.Tensor  # (n, C, H, W) the attacked images, pixels in [0, 1]
    labels: torch.Tensor  # (n,)
    observed: dict  # (sent − uploaded)/(η·S) of each matched key
    copy: ServerCopy
    #: what the server sent, what the client uploaded (every key it uploads, BatchNorm statistics
    #: aside), and η·S: for the same upload under DP (:func:`dp_upload`)
    sent: dict = field(default_factory=dict, repr=False)
    upload: dict = field(default_factory=dict, repr=False)
    lr_steps: float = 1.0


def client_upload(state, data, cid: int, b: int, setup: AttackSetup) -> Upload:
    """Client ``cid`` trains one round on its ``b``-th attacked sample set with the method's own
    ``local_train`` (B per step, S steps) from the run's states; the server reads the upload.

    ``state`` must have been loaded with ``batch_size=B``, ``local_epochs=1``, ``drop_last=True``
    (see :data:`STATE_CHANGES`)."""
    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.data.resident import ClientData

    cfg = state.cfg
    n = setup.samples
    if data.n_train < n:
        raise UserError(f"client {cid} of {state.run_dir} has {data.n_train} training samples, fewer than "
                        f"--batch-size × --local-steps = {n}")
    idx = torch.as_tensor(attacked_samples(data.n_train, n, setup.seed, cid, b), device=data.train_x.device)
    victim = ClientData(cid, data.train_x[idx], data.train_y[idx], data.test_x[:0], data.test_y[:0], data.mean,
                        data.inv_std, data.kind)
    client_state = state.use_client(cid)
    sent = state.sent(cid)
    gen = torch.Generator(device=state.device).manual_seed(int(setup.seed) * 7919 + cid * 101 + b)
    result = state.algo.local_train(client_state, victim, Context(state.rounds_done, cid, gen))
    copy_ = server_copy(state, cid, setup.knowledge, setup.local_steps)
    lr_steps = cfg.lr * setup.local_steps
    observed = observed_gradient(sent, result.upload, copy_.matched_keys(), lr_steps)
    from fedcp_dist.state.client_store import BN_STAT_SUFFIXES

    uploaded = {k: result.upload[k] for k in state.algo.upload_keys(sent)
                if k in result.upload and not k.endswith(BN_STAT_SUFFIXES)}
    return Upload(cid, b, victim.train_x.float() / 255.0, victim.train_y, observed, copy_, sent, uploaded, lr_steps)


def dp_upload(up: Upload, clip: float, noise: float, seed: int) -> Upload:
    """The upload as ``dp: central`` releases it, seen by a server that knows every other
    participant's update (the strongest position against the noised sum): its delta from the sent
    values over every uploaded tensor clipped to L2 norm ``clip`` as one vector, plus N(0, (σ·C)²)
    on every value (:func:`fedcp_dist.comm.privacy.clip_and_noise`), drawn from (seed, client, batch)."""
    from fedcp_dist.state.placement import stream_seed
    from fedcp_dist.comm.privacy import clip_and_noise

    device = next(iter(up.upload.values())).device
    gen = torch.Generator(device=device).manual_seed(stream_seed(seed, up.client, up.batch, 17))
    released = clip_and_noise(up.upload, up.sent, list(up.upload), clip, noise * clip if noise > 0 else 0.0, gen)
    observed = observed_gradient(up.sent, released, up.copy.matched_keys(), up.lr_steps)
    return dataclasses.replace(up, observed=observed, upload=released)


#: config changes for attacking: the client trains B samples per step for S steps, once; evaluation
#: (the self-check) without Gumbel noise
def state_changes(setup: AttackSetup) -> dict:
    return {"batch_size": setup.batch_size, "local_epochs": 1, "drop_last": True, "cpn_eval_gumbel": False,
            "amp": "none", "fused": False}


def attack_upload(up: Upload, setup: AttackSetup, attack: str, num_classes: int, label: str, method: str,
                  on_step: Optional[Callable[[float], None]] = None) -> AttackResult:
    """Run ``attack`` (dlg or idlg) on one upload and score it against the true images."""
    n = up.truth.shape[0]
    inferred = attack == "idlg" and "head.weight" in up.observed
    fixed = infer_labels(up.observed["head.weight"], n) if inferred else None
    rec = reconstruct(up.copy.pseudo_gradient, up.observed, tuple(up.truth.shape), num_classes, labels=fixed,
                      steps=setup.steps, restarts=setup.restarts, seed=setup.seed * 31 + up.batch, on_step=on_step)
    guess = rec.images.to(up.truth.device)
    order = match_images(up.truth, guess)
    guess = guess[order]
    got = rec.labels.to(up.labels.device)[order]
    return AttackResult(
        run=label, method=method, client=up.client, batch=up.batch, attack=attack,
        psnr=float(np.mean([psnr(up.truth[i], guess[i]) for i in range(n)])),
        ssim=float(np.mean([ssim(up.truth[i], guess[i]) for i in range(n)])),
        label_acc=float((got == up.labels).float().mean()),
        labels_inferred=inferred, distance=rec.loss,
        truth=up.truth.cpu(), guess=guess.cpu(),
    )


# ----------------------------------------------------------------------------- several runs, one table


def attack_runs(runs: list, setup: AttackSetup, data_path: Optional[str] = None, device: str = "cpu",
                progress: bool = True, warn: Callable[[str], None] = print) -> list:
    """Attack the same clients' same samples in each run of ``runs`` = [(run directory, label)];
    every :class:`AttackResult`, in order. A tqdm bar counts L-BFGS iterations."""
    from tqdm import tqdm

    from fedcp_dist.analysis.runstate import load_run_state

    setup.check()
    settings = list(setup.dp) or [None]
    per_run = len(setup.clients) * setup.batches * len(settings) * len(setup.attacks) * setup.restarts * setup.steps
    states = []  # every run read and checked before the bar starts: a refusal is the only line printed
    for run_dir, label in runs:
        state = load_run_state(run_dir, data_path, device, changes=state_changes(setup), warn=warn)
        if state.cfg.method not in METHODS:
            raise UserError(f"DLG attacks {', '.join(METHODS)}; {run_dir} ran {state.cfg.method}")
        if state.info.kind != "image":
            raise UserError(f"DLG reconstructs images; {run_dir} trained on {state.info.kind}")
        bad = [c for c in setup.clients if not 0 <= c < state.num_clients]
        if bad:
            raise UserError(f"client {bad[0]} is not in {run_dir} (clients 0..{state.num_clients - 1})")
        check_finite(state, setup.clients)
        states.append((state, label))
    results = []
    with tqdm(total=per_run * len(runs), disable=not progress, desc="DLG", unit="it", mininterval=1.0) as bar:
        for state, label in states:
            datas = state.load_data(list(setup.clients))
            for cid in setup.clients:
                self_check(state, cid, datas[cid].train_batch()[0][:16])
                for b in range(setup.batches):
                    sent_up = client_upload(state, datas[cid], cid, b, setup)
                    for setting in settings:
                        up, name = sent_up, label
                        if setting is not None:
                            up = dp_upload(sent_up, *setting, setup.seed)
                            name = f"{label} C={setting[0]:g} σ={setting[1]:g}"
                        results += _attacks(up, setup, state, name, bar, setting)
    return results


def _attacks(up: Upload, setup: AttackSetup, state, name: str, bar, setting) -> list:
    """Every attack of ``setup`` on one upload (under the DP ``setting``, or None)."""
    done: dict = {}
    for attack in setup.attacks:
        bar.set_postfix_str(f"{name} client {up.client} batch {up.batch} {attack}")
        start = bar.n
        if attack == "idlg" and "head.weight" not in up.observed and "dlg" in done:
            res = dataclasses.replace(done["dlg"], attack="idlg")  # no labels to read: iDLG is DLG
        else:
            res = attack_upload(up, setup, attack, state.info.num_classes, name, state.cfg.method,
                                lambda loss: bar.update(1))
            if setting is not None:
                res.dp_clip, res.dp_noise = float(setting[0]), float(setting[1])
        bar.update(start + setup.restarts * setup.steps - bar.n)  # restarts that stopped early
        done[attack] = res
    return list(done.values())
