"""FedCP: a conditional policy network splits each feature into a global and a personal part.

Per client i (paper, section 4):

* h = f(x; W_i^fe), the client's feature extractor, overwritten by the global W^fe when selected;
* C = v̂_i ⊙ h, with v_i the column sums of the personal head's weight, L2-normalised (:mod:`.client_vector`);
* the CPN Θ: Linear(K, 2K) → LayerNorm(2K) → ReLU, viewed as (B, 2, K); a softmax over the pair
  gives (s, r) with s + r = 1 (soft Gumbel-softmax with temperature τ while training; :mod:`.cpn`);
* out = g(s ⊙ h; W_i^hd) + g(r ⊙ h; W^hd): the personal head on the personal part, the frozen
  global head on the global part;
* loss = CE(out, y) + λ · MMD²(h, f(x; W^fe)) against the frozen received extractor (:mod:`.regularisers`).

Upload: W_i^fe, (W^hd + W_i^hd) / 2 and Θ_i. Persistent client state: W_i^hd and v_i.

This class composes the parts; each part owns its options and their checks: the policy (CPN design),
the policy input (client vector), the regularisers, the schedules of τ and the CPN's rate, and the
policy's synchronisation (:mod:`.sync`). The paper's ablations are options of those parts;
``fedcp_global_head=false`` (with ``fedcp_cpn=false``) is this class's own: out = g(h; W_i^hd), only
the extractor is uploaded (with ``fedcp_gfm=false`` too this is FedPer).
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch

from fedcp_dist.algorithms.base import LocalResult, SGDAlgorithm, freeze, load_module, module_state
from fedcp_dist.algorithms.fedcp.client_vector import ClientVector
from fedcp_dist.algorithms.fedcp.cpn import Policy, cpn_cost
from fedcp_dist.algorithms.fedcp.probing import PolicyProbes
from fedcp_dist.algorithms.fedcp.regularisers import REGULARISERS
from fedcp_dist.algorithms.fedcp.schedules import Schedules
from fedcp_dist.algorithms.fedcp.modules import registered
from fedcp_dist.algorithms.fedcp.sync import PolicySync
from fedcp_dist.local_train import ClientPhase, Phase
from fedcp_dist.options import Option
from fedcp_dist.state.placement import STREAM_INIT, stream_seed


class Heads(NamedTuple):
    """What the personalized model computes on a batch."""

    personal: torch.Tensor  # the personal head's logits, g(s ⊙ h; W_i^hd)
    glob: Optional[torch.Tensor]  # the frozen global head's logits, g(r ⊙ h; W^hd) (None: no global head)
    h: torch.Tensor  # the feature
    s: Optional[torch.Tensor]  # the personal share of each feature (None: no CPN); r = 1 − s
    #: Σ_k −(s_k log s_k + r_k log r_k) per sample, of the soft policy (only where the loss needs it)
    entropy: Optional[torch.Tensor] = None
    c: Optional[torch.Tensor] = None  # the policy's input C
    policy_logits: Optional[torch.Tensor] = None  # the pair logits (..., 2K) the policy is the softmax of

    @property
    def logits(self) -> torch.Tensor:
        return self.personal if self.glob is None else self.personal + self.glob


#: FedCP's parts, each a class with its options and their checks
PARTS = (*REGULARISERS, Policy, ClientVector, Schedules, PolicySync)


class FedCP(PolicyProbes, SGDAlgorithm):
    name = "fedcp"
    parts = PARTS
    digits_preset = {"lam": (0.1, "picked for this tiny set from the paper's grid: with λ = 5 its small features "
                                  "barely grow")}
    options = (
        Option("fedcp_global_head", True, "FedCP ablation (paper, Table 1): false drops the frozen global head "
               "(needs fedcp_cpn=false; only the extractor is shared)"),
    )

    privacy_uploads = ("its extractor W_i^fe, its CPN Θ_i and the mixed head (W^hd + W_i^hd)/2 (through which half of "
                       "its personal head is uploaded)")
    privacy_keeps = "its personal head W_i^hd (but for its half in the mixed head) and its client vector v_i"

    @classmethod
    def privacy_coverage(cls, cfg):
        if not cfg.fedcp_global_head:
            return "its extractor W_i^fe", "its personal head W_i^hd and its client vector v_i"
        return cls.privacy_uploads, cls.privacy_keeps

    @classmethod
    def uneven_uploads(cls, cfg):
        if cfg.cpn_async_min_rate > 0:
            return "cpn_async_min_rate", ("leaves the CPN out of the uploads of clients below the rate, and averages it "
                                          "over its senders")
        return None

    @classmethod
    def check_config(cls, cfg):
        if not cfg.fedcp_global_head and cfg.fedcp_cpn:
            return "fedcp_global_head", "false needs fedcp_cpn=false too: the CPN splits features between the two heads"
        if not cfg.fedcp_cpn:
            needs_cpn = [*Policy.cpn_keys, *(k for part in PARTS for k in getattr(part, "needs_cpn", ()))]
            options = {o.name: o for part in PARTS for o in part.options}
            for key in needs_cpn:
                if getattr(cfg, key) != options[key].default:
                    return key, "acts on the CPN, but fedcp_cpn=false has none"
            if cfg.probe_every:
                return ("analysis" if cfg.analysis else "analysis_every",
                        "the probes measure the CPN's policy (PIR, s), and fedcp_cpn=false has none")
        return None

    @classmethod
    def rounds_scheduled(cls, cfg: dict) -> Optional[str]:
        return Schedules.rounds_scheduled(cfg)

    def __init__(self, cfg, model, device):
        super().__init__(cfg, model, device)
        self.K = K = model.feature_dim
        self.num_classes = int(model.head.out_features)
        self.policy = Policy(cfg, K)
        self.vector = ClientVector(cfg, K, model, self.num_classes).to(device)
        self.terms = [part(cfg) for part in REGULARISERS]
        self.schedules, self.sync = Schedules(cfg), PolicySync(cfg)
        self.tau = cfg.tau  # this round's temperature (annealed: set per round in phases and evaluation)
        # drawn from the same seeded global RNG as the model, in this order (the recorded results' order):
        # the paper's CPN, the shared policy modules, a CPN design replacing the paper's, the clients' own
        cpn = self.policy.build_cpn().to(device)
        #: {name: module} of the registered policy modules on in this run (:mod:`.modules`), trained
        self.own = self._build_modules(registered(shared=True), device)
        self.cpn = self.policy.redesign(cpn).to(device)
        self.own.update(self._build_modules(registered(shared=False), device))
        self.policy.extra = [m for m in registered() if m.logits is not None and m.name in self.own]
        # selection_vector=features: the loss tallies Σ h (float64) in every round; finish keeps its mean
        self.track_features = cfg.selection_vector == "features"
        self.use_global_head = bool(cfg.fedcp_global_head)
        self.fe = model.features.to(device)  # W_i^fe, trained
        self.head_p = model.head.to(device)  # W_i^hd, trained
        # received global parts, frozen: the MMD reference, the global head, and what evaluation uses
        self.fe_g = freeze(copy.deepcopy(self.fe)).eval()  # BatchNorm: running statistics at evaluation
        self.head_g = freeze(copy.deepcopy(self.head_p))
        self.cpn_g = freeze(copy.deepcopy(self.cpn)).eval()
        #: {name: its received copy, frozen} of the shared policy modules on in this run
        self.received = {m.name: freeze(copy.deepcopy(self.own[m.name])) for m in self._on(shared=True)}
        #: a client's own modules' values before it has trained
        self._init_own = {k: v for m in self._on(shared=False) for k, v in module_state(m.prefix, self.own[m.name]).items()}
        self._init_head = module_state("head.", self.head_p)
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, STREAM_INIT))
        self._init_v = torch.rand(self.K, generator=gen).to(device)
        self._round = 0  # the round being run (begin_round): the server update's refresh schedule
        self._eval_policy_round = None  # the round whose interpolated policy evaluation holds (refresh)
        self._declare_phases()
        self.gs = self.init_global_state()

    def _build_modules(self, modules: list, device) -> dict:
        """{name: module} of ``modules`` that are on in this run, each built (and drawn) in turn."""
        out = {}
        for m in modules:
            module = m.build(self)
            if module is not None:
                out[m.name] = module.to(device)
        return out

    def _on(self, shared: Optional[bool] = None) -> list:
        """The registered policy modules on in this run (shared or the clients' own only), in draw order."""
        return [m for m in registered(shared) if m.name in self.own]

    def _modules(self, trained: bool) -> dict:
        """{prefix: module} of the trained model (or of the evaluated one: received extractor and policy)."""
        m = {"features.": self.fe if trained else self.fe_g, "cpn.": self.cpn if trained else self.cpn_g,
             "head.": self.head_p}
        for pm in self._on(shared=True):
            m[pm.prefix] = self.own[pm.name] if trained else self.received[pm.name]
        for pm in self._on(shared=False):
            m[pm.prefix] = self.own[pm.name]
        return m

    def _declare_phases(self) -> None:
        modules = self._modules(trained=True)
        # the distillation's teacher: the received CPN (and the modules adding to its logits), alike for every client
        shared = (self.fe_g, self.head_g)
        if self.cfg.cpn_distill:
            shared += (self.cpn_g,) + tuple(self.received[m.name] for m in self.policy.extra if m.shared)
        tallied = ("h",) if self.track_features else ()  # selection_vector=features: Σ h over the samples trained
        trainable = tuple(p + n for p, m in modules.items() for n, t in m.named_parameters() if t.requires_grad)
        self.train_phase = Phase("train", self.loss, modules, trainable=trainable, epochs=self.cfg.local_epochs,
                                 shared=shared, tallied=tallied)
        # Θ frozen (warm-up, caching, asynchronous): the same loss, the policy's networks constants
        self.frozen_phase = Phase("train-cpn-frozen", self.loss, modules,
                                  trainable=tuple(n for n in trainable if not n.startswith(self.sync.prefixes)),
                                  epochs=self.cfg.local_epochs, shared=shared, tallied=tallied)
        self.training_phases = [self.train_phase]
        self.eval_modules = self._modules(trained=False)
        self.keys = {p: list(module_state(p, m)) for p, m in modules.items()}

    # -- state ------------------------------------------------------------
    def init_global_state(self):
        state = {}
        for prefix in ("features.", "head.", *self.sync.prefixes):
            if prefix in self.train_phase.modules:
                state.update(module_state(prefix, self.train_phase.modules[prefix]))
        return self.sync.init_global(state)

    def set_global(self, global_state):
        own = {"head.", *(m.prefix for m in self._on(shared=False))}  # the client's, loaded from its state
        for prefix, module in self.eval_modules.items():
            if prefix not in own:
                load_module(module, global_state, prefix)
        load_module(self.head_g, global_state, "head.")
        self.gs = global_state
        self._eval_policy_round = None

    def upload_keys(self, global_state):
        keys = self.sync.upload_keys(global_state)
        return keys if self.use_global_head else [k for k in keys if k.startswith("features.")]

    def aggregation_groups(self, upload_keys):
        return self.sync.groups(upload_keys)

    def skipped_groups(self, t: int) -> tuple:
        return self.sync.skipped(t)

    def begin_round(self, t: int) -> None:
        self._round = t

    def server_update(self, global_state, averaged):
        return self.sync.server_update(super().server_update(global_state, averaged), global_state, self._round)

    def init_client_state(self, client):
        """A copy of the initial global head, and one random client vector from the run seed
        (and the initial values of its own policy modules: head+embed's zero embedding)."""
        state = {**{k: v.clone() for k, v in self._init_head.items()}, "v": self._init_v.clone()}
        self.sync.init_client(state, self._init_v)
        state.update({k: v.clone() for k, v in self._init_own.items()})
        if self.track_features:  # selection_vector=features: no features seen yet
            state["fmean"] = torch.zeros_like(self._init_v)
        return state

    def prepare_eval(self, client_state, data, ctx):
        if self.vector.kind != "head+stats":
            return client_state
        return {**client_state, "stats": self.vector.values(client_state, data, ctx.client)["stats"]}

    def fused_reason(self):
        if self.sync.min_rate:
            return "cpn_async_min_rate freezes some clients' CPN: they train one at a time"
        if self.vector.kind != "head":
            return f"cpn_client_vector={self.vector.kind} trains one client at a time"
        return super().fused_reason()

    # -- the client vector (fedcp_dist.capabilities.ClientVectors: feature-difference selection)
    @property
    def client_vector_dim(self) -> int:
        return self.K

    def client_vector(self, client_state):
        """v_i: the column sums of the personal head's weight after the client's last round (the
        random initial vector before it has trained); with ``selection_vector=features`` the mean
        of its features h over the samples of its last local training (zero before it has trained)."""
        if self.track_features:
            return torch.zeros_like(self._init_v) if client_state is None else client_state["fmean"]
        return self._init_v if client_state is None else client_state["v"]

    # -- the personalized model and its loss, written once for training, fused training and evaluation
    def heads(self, step, gumbel: bool) -> Heads:
        """The personalized model on the step's batch: g(s ⊙ h; W_i^hd) (the personal head on the
        personal part), g(r ⊙ h; W^hd) (the frozen global head on the global part), h and s."""
        h = step.run("features", step.x)
        if not self.policy.enabled:  # the whole feature to both heads
            return Heads(step.run("head", h), step.shared(self.head_g, h) if self.use_global_head else None, h, None)
        c = self.vector.policy_input(step, h)
        logits = self.policy.logits(step, c)
        s, r, ent = self.policy.split(logits, self.tau, step.gumbel_like if gumbel else None,
                                      entropy=bool(self.cfg.policy_entropy))
        return Heads(step.run("head", s * h), step.shared(self.head_g, r * h), h, s, ent, c, logits)

    def loss(self, step):
        """CE(personalized output) + the regularisers' terms (λ·MMD², entropy, distillation)."""
        out = self.heads(step, self.cfg.cpn_train_gumbel)
        if self.track_features:  # selection_vector=features: the batch's Σ h (in float64), every round
            step.tally("h", out.h, dtype=torch.float64)
        if out.s is not None and step.tallies is not None:  # probing: Σ over the batch of s̄ = (1/K) Σ_k s^k
            step.tally("s", out.s.detach().mean(dim=-1))
        loss = step.cross_entropy(out.logits)
        for term in self.terms:
            value = term.term(self, step, out)
            if value is not None:
                loss = loss + value
        return loss

    def sgd_settings(self, ctx=None):
        kw = super().sgd_settings(ctx)
        rates = None if ctx is None else self.schedules.param_lr(ctx.round, self.sync.prefixes)
        if rates is not None:
            kw["param_lr"] = rates
        return kw

    def describe(self) -> str:
        if not self.policy.enabled:
            return ""
        params, flops = cpn_cost(self.cpn)
        design = f"light, H={self.cfg.cpn_hidden}" if self.cfg.cpn_hidden else "Linear(K, 2K)"
        line = f"CPN ({design}, K={self.K}): {params} parameters, {flops} FLOPs/sample"
        for m in self._on():
            if m.note is not None:
                line += f"; {m.note(self.policy, self.own[m.name])}"
        return line

    # -- local training ---------------------------------------------------
    def phases(self, client_state, data, ctx):
        k = self.keys
        start = {**{n: self.gs[n] for p in ("features.", "cpn.") for n in k[p]},
                 **{n: client_state[n] for n in k["head."]}, "v": client_state["v"]}
        start.update({n: self.gs[n] for m in self._on(shared=True) for n in k[m.prefix]})
        start.update(self.vector.values(client_state, data, ctx.client))
        start.update({n: client_state[n] for m in self._on(shared=False) for n in k[m.prefix]})
        self.tau = self.schedules.tau_at(ctx.round)
        plan = self.sync.round_of(client_state, self.gs, ctx.round)
        if plan.values is not None:
            start.update(plan.values)
        phase = self.train_phase if plan.trains else self.frozen_phase
        return [(phase, ClientPhase(start, info={"async_frozen": plan.async_frozen, "sends": plan.sends}))]

    def finish(self, client_state, outcomes, ctx):
        """Upload W_i^fe, (W^hd + W_i^hd)/2 and Θ_i; keep W_i^hd and v_i = its weight's column sums."""
        o, k = outcomes[0], self.keys
        v = o.values
        with torch.no_grad():
            upload = {n: v[n] for n in k["features."]}
            if self.use_global_head:
                upload.update({n: 0.5 * (self.gs[n] + v[n]) for n in k["head."]})
                if o.info["sends"]:
                    upload.update({n: v[n] for p in self.sync.prefixes for n in k.get(p, ())})
            new_state = {**{n: v[n] for n in k["head."]}, "v": v["head.weight"].sum(dim=0)}
            self.sync.finish_client(new_state, client_state)
            new_state.update({n: v[n] for m in self._on(shared=False) for n in k[m.prefix]})
            tallies = o.tallies
            if self.track_features:  # the mean of h over every sample the local training saw
                tallies = dict(tallies)
                h_sum = tallies.pop("h", None)
                new_state["fmean"] = (torch.zeros_like(self._init_v) if h_sum is None  # no step: still unseen
                                      else (h_sum / max(o.samples, 1)).to(self._init_v.dtype))
        # probing: the trained values (no copies) for the loss after local learning
        return LocalResult(upload=upload, client_state=new_state, loss_sum=o.loss_sum, samples=o.samples,
                           extra={"trained": v} if ctx.probe else {}, tallies=tallies,
                           skipped=("policy",) if o.info["async_frozen"] else ())
