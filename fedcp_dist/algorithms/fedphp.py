"""FedPHP (Li, Zhan, Shao, Li, Song, ECML PKDD 2021): federated personalisation with an inherited
private model (HPM).

Each client keeps its HPM v_i, a temporal ensemble of its past personalised (locally trained)
models; it starts as the initial global model. A participant

1. trains the received global model w with SGD on (1 − λ)·CE + λ·MMD²(f_w(x), f_v(x)): the MMD
   between its features and the HPM's (frozen, no gradient) transfers the HPM's knowledge; both
   feature sets normalise by the batch's own statistics where the model has BatchNorm, as the
   reference's (training-mode) HPM does, and the HPM's running statistics are left untouched;
2. folds the trained w into the HPM:  v ← μ·v + (1 − μ)·w,  with
   μ = μ̄·min(1, k / max(1, ⌊ρ·T⌋)), k the client's earlier participations, ρ the participation
   rate (the middle of ``participation_range`` when that is set) and T = ``rounds``: a new client's
   HPM follows its local models, a frequent one's is an ever slower average;
3. uploads w (averaged as FedAvg).

The HPM is what is evaluated. The MMD² is FedCP's (the same RBF kernels).

``fedphp_reference_compat=true`` is the reference library's 2023 variant, behind the FedCP paper's
FedPHP figures: in round t (0-based) a client's model is m = (1 − μ_t)·w_global + μ_t·w_last, with
μ_t = μ̄·t/T and w_last its own model after its last local training (the initial model before);
m is what is evaluated before the round's training, training starts from m and distils from the
received global model's features (not the HPM's), and the client keeps the trained model as its
w_last. (The slot named ``hpm.`` then holds w_last.)
"""
from __future__ import annotations

import copy

import torch

from fedcp_dist.algorithms.base import LocalResult, freeze, load_module, module_state
from fedcp_dist.algorithms.fedavg import FedAvg
from fedcp_dist.local_train import ClientPhase, Phase
from fedcp_dist.options import Option, within

HPM = "hpm."
COUNT = "participations"


def hpm_momentum(mu_max: float, participations: int, participation: float, rounds: int) -> float:
    """μ for a client that has trained ``participations`` times before: μ̄·k/⌊ρT⌋, capped at μ̄."""
    expected = max(1, int(participation * rounds + 1e-9))
    return float(min(max(mu_max * participations / expected, 0.0), mu_max))


class FedPHP(FedAvg):
    name = "fedphp"
    privacy_uploads = "the global model it trained"
    privacy_keeps = "its inherited private model (HPM)"
    options = (
        Option("fedphp_lam", 0.1, "FedPHP: λ: local loss = (1 − λ)·CE + λ·MMD²(local features, inherited private "
               "model's features)", within(0, 1)),
        Option("fedphp_mu", 0.9, "FedPHP: μ̄: the inherited model's moving-average weight μ rises from 0 to μ̄ over a "
               "client's expected participations", within(0, 1, high_open=True)),
        Option("fedphp_reference_compat", False, "FedPHP: the reference library's 2023 variant: start from and evaluate "
               "(1 − μ_t)·global + μ_t·the client's last local model, μ_t = fedphp_mu·round/rounds, distilling from "
               "the global model, instead of the paper's inherited private model"),
    )

    @classmethod
    def rounds_scheduled(cls, cfg):
        return "fedphp's training depends on the total number of rounds (its moving-average weight rises over " \
               "participation · rounds)"

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.hpm = freeze(copy.deepcopy(self.model)).eval()
        self._init_state = module_state(HPM, self.model)
        self.lam = float(cfg.fedphp_lam)
        self.train_phase = Phase("php", self.php_loss, {"": self.model, HPM: self.hpm},
                                 trainable=self.train_phase.trainable, epochs=cfg.local_epochs)
        self.training_phases = [self.train_phase]

    def init_client_state(self, client):
        state = {k: v.clone() for k, v in self._init_state.items()}
        state[COUNT] = torch.zeros((), device=self.device)
        return state

    def _participation(self) -> float:
        r = self.cfg.participation_range
        return float(self.cfg.participation) if r is None else 0.5 * (float(r[0]) + float(r[1]))

    def php_loss(self, step):
        """(1 − λ)·CE + λ·MMD²(features, the HPM's features with batch statistics, no gradient)."""
        h = step.run("features", step.x)
        loss = step.cross_entropy(step.run("head", h))
        if self.lam > 0:
            h_hpm = step.run("hpm.features", step.x, grad=False, batch_stats=True)
            loss = (1.0 - self.lam) * loss + self.lam * step.mmd2(h, h_hpm)
        return loss

    def _reference_mix(self, client_state, round_idx: int) -> dict:
        """The reference's round-t model: (1 − μ_t)·global + μ_t·the client's last local model."""
        rounds = int(self.cfg.rounds)
        mu = float(self.cfg.fedphp_mu) * min(max(round_idx, 0), rounds) / rounds
        return {k: ((1.0 - mu) * g + mu * client_state[HPM + k]) if g.is_floating_point() else g
                for k, g in self.gs.items()}

    def phases(self, client_state, data, ctx):
        if self.cfg.fedphp_reference_compat:  # start from the mix, distil from the received global model
            start = {**self._reference_mix(client_state, ctx.round), **{HPM + k: v for k, v in self.gs.items()}}
            return [(self.train_phase, ClientPhase(start))]
        hpm = {k: v for k, v in client_state.items() if k.startswith(HPM)}
        return [(self.train_phase, ClientPhase({**self.gs, **hpm}))]

    def prepare_eval(self, client_state, data, ctx):
        if not self.cfg.fedphp_reference_compat:
            return client_state
        return {**{HPM + k: v for k, v in self._reference_mix(client_state, ctx.round).items()},
                COUNT: client_state[COUNT]}

    def finish(self, client_state, outcomes, ctx):
        o = outcomes[0]
        if self.cfg.fedphp_reference_compat:  # the trained model is the client's last local model
            return LocalResult(upload={key: o.values[key] for key in self.gs},
                               client_state={**{HPM + key: o.values[key].clone() for key in self.gs},
                                             COUNT: client_state[COUNT] + 1},
                               loss_sum=o.loss_sum, samples=o.samples)
        k = int(client_state[COUNT].item())
        mu = hpm_momentum(float(self.cfg.fedphp_mu), k, self._participation(), int(self.cfg.rounds))
        with torch.no_grad():
            new_state = {HPM + key: mu * client_state[HPM + key] + (1.0 - mu) * o.values[key] for key in self.gs}
        new_state[COUNT] = client_state[COUNT] + 1
        return LocalResult(upload={key: o.values[key] for key in self.gs}, client_state=new_state,
                           loss_sum=o.loss_sum, samples=o.samples)

    @torch.no_grad()
    def predict(self, client_state, x, ctx):
        load_module(self.hpm, client_state, HPM)
        return self.hpm(x)
