"""Kernel ceiling of a fused FedCP step: its matrix products and convolutions, each timed alone.

    python bench/kernels.py                          # MNIST CNN, 8 slots of B = 10, 1 thread
    python bench/kernels.py --batch 80               # the same kernels with 80 samples per client
    python bench/kernels.py --input 3,32,32 --classes 100 --compile
    python bench/kernels.py --device cuda --slots 64 --compile       # on a GPU (CUDA graphs: see bench/gpu.sh)
    python bench/kernels.py --split                  # where the real step's operations spend their CPU time
    python bench/kernels.py --linear-forms           # the per-client Linear's products written other ways
    python bench/kernels.py --slot-scan --steps 0    # the real step's time with 1, 2, … --slots clients

A fused FedCP step (``fused: auto``) of ``--slots`` clients with ``--batch`` samples each runs, for
every convolution and Linear layer of the model's feature extractor and for the CPN, the kernels
the fused path calls (``fedcp_dist/fused/slots.py``), in the layouts it calls them with:

* the personal layer's forward: a grouped channels-last convolution over the slots, or a batched
  product (``baddbmm``) with each slot's weight;
* the frozen received extractor's forward (the MMD target), one weight over all slots' samples;
* the personal layer's backward: the convolution's weight (and, past the first layer, input)
  gradient; for a Linear layer the input gradient (``bmm``) and the SGD step taken in place
  (``baddbmm_`` with α = −η), as ``_LinearSGD`` does.

Each kernel is timed alone (the best of ``--repeats`` means over ``--calls`` calls, after a
warm-up), its FLOPs counted from its shapes (2 per multiply-add). The sum of the kernels' times is
what the step would take if nothing else cost anything (no elementwise work, no pooling, no Python,
no cache misses from the other kernels), so the kernels' FLOPs over that sum, against the float32
matmul peak of the same run, bound the fraction of peak that fused training can reach on this CPU
with these kernels. The heads and the MMD (under 0.5 % of the step's FLOPs) are left out.

``--compile`` also times ``torch.compile`` (inductor) of the largest Linear layer's forward and of
its backward with the in-place SGD step, against the eager kernels, and prints the compile time.
On a GPU (``--device cuda``) the kernels are also captured as one CUDA graph and replayed: the
difference to launching them one by one is what graphs of the fused step could save.
``--split`` (CPU) times every aten operation of the real step around its call, in CPU time, and
sorts them by kind (products and convolutions, max-pooling, random draws, copies and fills, the
rest): the operations beside the products are the step's non-kernel rest that a leaner step cuts.
``--slot-scan`` times the real step with 1, 2, … ``--slots`` clients (CPU time on a CPU) and fits
a fixed part plus a part per client to it: what a step costs however few of its slots are active,
beside what each active client adds (``bench/round.py`` prints how many slots a run's fused steps
have active on average).
``--linear-forms`` (CPU) times the largest per-client Linear layer's products written other ways
(another weight layout, one product per slot, a grouped 1×1 convolution, more rows a client; the
backward with the cache flushed first, and interleaved slot by slot): what the per-client products,
the step's least efficient kernels, could gain from a different formulation.
The allocator keeps freed memory as the engine does on a CPU (``--keep-freed-memory``, the config key
``keep_freed_memory``). The figures go to ``--json`` (default bench/kernels.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.round import cpu_model, matmul_peak_gflops  # noqa: E402
from fedcp_dist.models import build_model  # noqa: E402
from fedcp_dist.fused.groups import train_group  # noqa: E402
from fedcp_dist.runtime import keep_freed_memory  # noqa: E402

#: a tiny step size: the in-place updates run many times on the same weights
LR = 1e-9


@dataclass
class Kernel:
    name: str
    shape: str
    flops: int  # per call, for all slots
    run: Callable[[], object]


@dataclass
class Row:
    name: str
    shape: str
    mflop: float
    ms: float
    gflops: float
    fraction_of_peak: float


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def layer_shapes(model: nn.Module, input_shape) -> list:
    """[(module, input shape, output shape)] of each Conv2d and Linear of ``model.features``, per sample."""
    found = []

    def hook(m, inp, out):
        found.append((m, tuple(inp[0].shape[1:]), tuple(out.shape[1:])))

    handles = [m.register_forward_hook(hook) for m in model.features.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model.features(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
    return found


def conv_kernels(i: int, m: nn.Conv2d, xin: tuple, yout: tuple, k: int, b: int, first: bool) -> List[Kernel]:
    cin, h, w = xin
    cout, ho, wo = yout
    macs = ho * wo * cout * (cin // m.groups) * m.kernel_size[0] * m.kernel_size[1]  # per sample
    geo = (m.stride, m.padding, m.dilation)
    xp = _cl(torch.randn(b, k * cin, h, w))
    # weights channels-last too, as the fused path stacks them (fedcp_dist.fused.step.stacked_like)
    wp = _cl(torch.randn(k * cout, cin // m.groups, *m.kernel_size) * 0.05)
    bp = torch.randn(k * cout)
    xs = _cl(torch.randn(k * b, cin, h, w))
    ws, bs = _cl(torch.randn(cout, cin // m.groups, *m.kernel_size) * 0.05), torch.randn(cout)
    gy = _cl(torch.randn(b, k * cout, ho, wo))
    groups = k * m.groups
    mask = [not first, True, True]  # the first layer's input is data: no input gradient
    tag = f"conv{i} {cin}→{cout} {m.kernel_size[0]}×{m.kernel_size[1]}"
    return [
        Kernel(f"{tag}, personal forward", f"({b}, {k}·{cin}, {h}, {w}) groups={k}", 2 * macs * k * b,
               lambda: F.conv2d(xp, wp, bp, *geo, groups)),
        Kernel(f"{tag}, frozen forward", f"({k}·{b}, {cin}, {h}, {w})", 2 * macs * k * b,
               lambda: F.conv2d(xs, ws, bs, *geo, m.groups)),
        Kernel(f"{tag}, personal backward", "weight grad" + ("" if first else " + input grad"),
               2 * macs * k * b * (1 if first else 2),
               lambda: torch.ops.aten.convolution_backward(gy, xp, wp, [k * cout], *geo, False, [0, 0], groups, mask)),
    ]


def linear_kernels(tag: str, n_in: int, n_out: int, k: int, b: int, frozen: bool, input_grad: bool = True) -> List[Kernel]:
    x = torch.randn(k, b, n_in)
    w = torch.randn(k, n_out, n_in) * 0.02
    bias = torch.randn(k, n_out)
    g = torch.randn(k, b, n_out)
    xs, ws, bs = x.reshape(1, k * b, n_in), w[:1].clone(), bias[:1].clone()
    macs = n_in * n_out * k * b

    def backward():
        gx = torch.bmm(g, w) if input_grad else None
        w.baddbmm_(g.transpose(1, 2), x, alpha=-LR)
        bias.sub_(g.sum(1), alpha=LR)
        return gx

    out = [Kernel(f"{tag}, personal forward", f"bmm ({k}, {b}, {n_in})·({k}, {n_in}, {n_out})", 2 * macs,
                  lambda: torch.baddbmm(bias.unsqueeze(1), x, w.transpose(1, 2)))]
    if frozen:
        out.append(Kernel(f"{tag}, frozen forward", f"bmm (1, {k}·{b}, {n_in})·(1, {n_in}, {n_out})", 2 * macs,
                          lambda: torch.baddbmm(bs.unsqueeze(1), xs, ws.transpose(1, 2))))
    out.append(Kernel(f"{tag}, personal backward + SGD step", "input grad + in-place update" if input_grad else
                      "in-place update", 2 * macs * (2 if input_grad else 1), backward))
    return out



#: bytes written before each cold call of :func:`linear_forms`: past the last-level cache
FLUSH_BYTES = 64 * 2**20


@dataclass
class Form:
    """One way of computing a per-client Linear layer's product: ``run`` returns its result (the
    forward's output, or the backward's input gradient after its in-place SGD step on ``w``)."""
    name: str
    flops: int
    run: Callable[[], torch.Tensor]
    cold: bool = False  # the last-level cache flushed before each call (as in the step: other layers ran between)


def linear_forms(n_in: int, n_out: int, k: int, b: int, lr: float = LR) -> tuple:
    """The per-client Linear layer's products written the ways they could be: the forward as the
    step calls it (``baddbmm`` on a transposed view of each slot's (out, in) weight), with the weight
    stored (in, out), as one product per slot, as a grouped 1×1 convolution, and with 64 rows a
    client instead of ``b`` (what the small row count costs); the backward (input gradient, then
    the SGD step in place) as the step calls it, hot and with the cache flushed before each call,
    and per slot interleaved (input gradient then update of one slot's weight while it is in
    cache), with step size ``lr``. Returns (forms, operands): the input ``x``, the output gradient
    ``g``, the (k, out, in) weight ``w`` the backward forms update and the ``bias``."""
    x, g = torch.randn(k, b, n_in), torch.randn(k, b, n_out)
    w = torch.randn(k, n_out, n_in) * 0.02
    bias = torch.randn(k, n_out)
    w_in_out = w.transpose(1, 2).contiguous()
    x_conv = x.transpose(0, 1).reshape(b, k * n_in, 1, 1).contiguous()
    w_conv = w.reshape(k * n_out, n_in, 1, 1)
    x64 = torch.randn(k, 64, n_in)
    macs = n_in * n_out * k * b

    def per_slot_forward():
        return torch.stack([torch.addmm(bias[j], x[j], w[j].t()) for j in range(k)])

    def conv_forward():
        return F.conv2d(x_conv, w_conv, bias.reshape(-1), groups=k).reshape(b, k, n_out).transpose(0, 1)

    def backward():
        gx = torch.bmm(g, w)
        w.baddbmm_(g.transpose(1, 2), x, alpha=-lr)
        return gx

    def backward_per_slot():
        gx = torch.empty(k, b, n_in)
        for j in range(k):
            torch.mm(g[j], w[j], out=gx[j])
            w[j].addmm_(g[j].t(), x[j], alpha=-lr)
        return gx

    forms = [
        Form("forward, as the step: baddbmm, (out, in) weight", 2 * macs,
             lambda: torch.baddbmm(bias.unsqueeze(1), x, w.transpose(1, 2))),
        Form("forward, weight stored (in, out)", 2 * macs, lambda: torch.baddbmm(bias.unsqueeze(1), x, w_in_out)),
        Form("forward, one addmm per slot", 2 * macs, per_slot_forward),
        Form("forward, grouped 1×1 convolution", 2 * macs, conv_forward),
        Form(f"forward with 64 rows a client (not {b})", 2 * macs * 64 // b,
             lambda: torch.baddbmm(bias.unsqueeze(1), x64, w.transpose(1, 2))),
        Form("backward + SGD step, as the step (hot cache)", 4 * macs, backward),
        Form("backward + SGD step, as the step (cold cache)", 4 * macs, backward, cold=True),
        Form("backward + SGD step, per slot interleaved (cold)", 4 * macs, backward_per_slot, cold=True),
    ]
    return forms, {"x": x, "g": g, "w": w, "bias": bias}


def time_form(form: Form, calls: int, repeats: int) -> float:
    """Best mean CPU seconds per call of ``form`` (a flush of :data:`FLUSH_BYTES` before each
    call of a cold form, not timed)."""
    if not form.cold:
        return time_call(form.run, calls, repeats, clock=time.process_time)
    src = torch.ones(FLUSH_BYTES // 4)
    dst = torch.empty_like(src)
    form.run()
    best = float("inf")
    for _ in range(repeats):
        spent = 0.0
        for _ in range(calls):
            dst.copy_(src)
            t0 = time.process_time()
            form.run()
            spent += time.process_time() - t0
        best = min(best, spent / calls)
    return best


def step_kernels(model: nn.Module, input_shape, k: int, b: int) -> List[Kernel]:
    """The fused FedCP step's products and convolutions for ``k`` slots of ``b`` samples."""
    kernels: List[Kernel] = []
    shapes = layer_shapes(model, input_shape)
    conv_i = 0
    for j, (m, xin, yout) in enumerate(shapes):
        if isinstance(m, nn.Conv2d):
            conv_i += 1
            kernels += conv_kernels(conv_i, m, xin, yout, k, b, first=j == 0)
        else:
            kernels += linear_kernels(f"Linear {m.in_features}→{m.out_features}", m.in_features, m.out_features, k, b,
                                      frozen=True, input_grad=j > 0)
    feat = model.feature_dim
    kernels += linear_kernels(f"CPN {feat}→{2 * feat}", feat, 2 * feat, k, b, frozen=False)
    return kernels


#: waits for the device's queued work before a clock is read (set for CUDA by main)
SYNC: Callable[[], None] = lambda: None


def time_call(fn: Callable[[], object], calls: int, repeats: int, clock=time.perf_counter) -> float:
    """Best mean seconds per call of ``fn`` over ``repeats`` runs of ``calls`` calls, after a warm-up."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        SYNC()
        t0 = clock()
        for _ in range(calls):
            fn()
        SYNC()
        best = min(best, (clock() - t0) / calls)
    return best


def summarise(rows: List[Row], peak: float) -> dict:
    flops = sum(r.mflop for r in rows) * 1e6
    seconds = sum(r.ms for r in rows) / 1e3
    rate = flops / seconds / 1e9
    return {"step_gflop": flops / 1e9, "kernel_seconds": seconds, "ceiling_gflops": rate,
            "ceiling_fraction_of_peak": rate / peak}


def compile_comparison(n_in: int, n_out: int, k: int, b: int, calls: int, repeats: int) -> dict:
    """Eager vs inductor-compiled forward and backward-with-SGD-step of one grouped Linear layer."""
    x, w, g = torch.randn(k, b, n_in), torch.randn(k, n_out, n_in) * 0.02, torch.randn(k, b, n_out)
    bias = torch.randn(k, n_out)

    def forward(x, w, bias):
        return torch.baddbmm(bias.unsqueeze(1), x, w.transpose(1, 2))

    def backward(g, w, x):
        gx = torch.bmm(g, w)
        w.baddbmm_(g.transpose(1, 2), x, alpha=-LR)
        return gx

    out = {}
    for name, fn, args in (("forward", forward, (x, w, bias)), ("backward + SGD step", backward, (g, w, x))):
        eager = time_call(lambda: fn(*args), calls, repeats)
        compiled = torch.compile(fn, dynamic=False)
        t0 = time.perf_counter()
        compiled(*args)
        SYNC()
        compile_s = time.perf_counter() - t0
        out[name] = {"eager_ms": 1e3 * eager, "compiled_ms": 1e3 * time_call(lambda: compiled(*args), calls, repeats),
                     "compile_seconds": compile_s}
    return out


def graph_seconds(kernels: List[Kernel], calls: int, repeats: int) -> float:
    """Seconds to replay all ``kernels`` captured as one CUDA graph (no launches from Python)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (library handles, workspaces)
        for kern in kernels:
            kern.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kern in kernels:
            kern.run()
    return time_call(graph.replay, calls, repeats)


def real_round(model_name: str, input_shape, classes: int, k: int, b: int, steps: int,
               device: torch.device = torch.device("cpu")) -> Callable[[], None]:
    """One round of FedCP's real fused local training (the paper's η = 0.005, λ = 5) of ``k``
    synthetic clients of ``steps`` full batches each: every step has all ``k`` slots."""
    from bench.models import client
    from fedcp_dist.algorithms import make_algorithm
    from fedcp_dist.algorithms.base import Context
    from fedcp_dist.config import Config

    cfg = Config(lr=0.005, lam=5.0, batch_size=b, fused="true", fused_workers=1)
    torch.manual_seed(0)
    algo = make_algorithm("fedcp", cfg, build_model(model_name, input_shape, classes).to(device), device)
    algo.num_clients = k
    algo.set_global(algo.init_global_state())
    datas = [dataclasses.replace(client(input_shape, classes, 0, steps * b, device, seed=c), cid=c)
             for c in range(k)]

    def one_round():
        items = [(algo.init_client_state(c), datas[c], Context(1, c, torch.Generator(device=device).manual_seed(c)))
                 for c in range(k)]
        train_group(algo, items)

    return one_round


def real_step_seconds(model_name: str, input_shape, classes: int, k: int, b: int, steps: int, repeats: int,
                      device: torch.device = torch.device("cpu")) -> float:
    """Seconds per step of :func:`real_round`'s training (the best of ``repeats`` rounds)."""
    return time_call(real_round(model_name, input_shape, classes, k, b, steps, device), 1, repeats) / steps


#: the aten operations of a fused step by what they do (``--split``); the rest are elementwise
#: operations, reductions and views
OP_KINDS = (
    ("matrix products and convolutions", ("convolution", "convolution_backward", "bmm", "baddbmm", "baddbmm_",
                                          "mm", "addmm", "addmm_", "addbmm", "addbmm_")),
    ("max-pooling, forward and backward", ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "maximum")),
    ("random draws (Gumbel noise)", ("exponential_", "uniform_", "normal_", "random_", "bernoulli_", "bernoulli")),
    ("copies, fills and gathers", ("copy_", "fill_", "zero_", "clone", "_to_copy", "index", "index_select", "cat",
                                   "stack", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
                                   "new_empty", "new_zeros", "new_empty_strided")),
)
OTHER_OPS = "other operations (elementwise, reductions, views)"


def op_kind(op_name: str) -> str:
    """The :data:`OP_KINDS` entry of an aten operation's name ("aten.bmm.default" or "bmm")."""
    parts = op_name.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    for kind, names in OP_KINDS:
        if base in names:
            return kind
    return OTHER_OPS


def split_step(one_round: Callable[[], None], steps: int, repeats: int) -> dict:
    """Where a real fused step's operations spend their time: CPU seconds per step by
    :func:`op_kind`, each aten operation timed around its own call (``time.process_time``: other
    work on the machine does not count) in one traced round after two untraced ones, beside the
    best untraced round's CPU seconds per step. What no operation's call holds (Python, autograd's
    engine between the operations) cannot be told apart from the tracing's own cost, so it is not
    split out. CPU only: a GPU's operations run after their calls return."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spent = {kind: 0.0 for kind, _ in OP_KINDS}
    spent[OTHER_OPS] = 0.0
    calls = {kind: 0 for kind in spent}

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.process_time()
            out = func(*args, **(kwargs or {}))
            kind = op_kind(str(func))
            spent[kind] += time.process_time() - t0
            calls[kind] += 1
            return out

    untraced = time_call(one_round, 1, repeats, clock=time.process_time) / steps
    with Timed():
        one_round()
    per_step = {kind: v / steps for kind, v in spent.items()}
    products = per_step[OP_KINDS[0][0]]
    rest = sum(per_step.values()) - products
    return {"untraced_step_seconds": untraced, "seconds": per_step,
            "calls_per_step": {kind: v / steps for kind, v in calls.items()},
            "products_seconds": products, "rest_seconds": rest, "rest_over_products": rest / products}


def print_split(split: dict, width: int) -> None:
    """Prints :func:`split_step`'s figures."""
    sec, total = split["seconds"], sum(split["seconds"].values())
    width = max(width, 2 + max(len(kind) for kind in sec))
    print(f"where the real step's operations spend their time (CPU ms a step, each operation timed around its call "
          f"in one traced round; the same step untraced: {1e3 * split['untraced_step_seconds']:.3f} ms):")
    for kind, v in sec.items():
        print(f"  {kind:{width - 2}}  {1e3 * v:7.3f} ms  {100 * v / total:5.1f} %  {split['calls_per_step'][kind]:6.1f} calls a step")
    print(f"  the operations beside the products and convolutions: {1e3 * split['rest_seconds']:.3f} ms, "
          f"{split['rest_over_products']:.2f}× the products' and convolutions' time in the same step")


def fit_step_cost(slots: List[int], seconds: List[float]) -> tuple:
    """(fixed, per slot): the least-squares line ``seconds ≈ fixed + per_slot · k`` through the
    step times ``seconds`` measured with ``slots`` = k active clients (at least two distinct k)."""
    n = len(slots)
    mk, ms = sum(slots) / n, sum(seconds) / n
    var = sum((k - mk) ** 2 for k in slots)
    if n < 2 or var == 0:
        raise ValueError("a fit of the step's cost needs at least two different slot counts")
    per_slot = sum((k - mk) * (s - ms) for k, s in zip(slots, seconds)) / var
    return ms - per_slot * mk, per_slot


def slot_scan(model_name: str, input_shape, classes: int, slots: int, b: int, steps: int, repeats: int,
              device: torch.device) -> dict:
    """The real fused step's seconds with k = 1 … ``slots`` clients (the best of ``repeats`` rounds
    of ``steps`` steps each, in CPU time on a CPU), and the fit of :func:`fit_step_cost`."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    ks = list(range(1, slots + 1))
    secs = [time_call(real_round(model_name, input_shape, classes, k, b, steps, device), 1, repeats, clock=clock) / steps
            for k in ks]
    fixed, per_slot = fit_step_cost(ks, secs)
    return {"slots": ks, "step_seconds": secs, "fixed_seconds": fixed, "per_slot_seconds": per_slot}


def print_slot_scan(scan: dict) -> None:
    """Prints :func:`slot_scan`'s figures."""
    fixed, per = scan["fixed_seconds"], scan["per_slot_seconds"]
    worth = f", the fixed part {fixed / per:.2f} clients' worth" if per > 0 else ""  # a GPU's step may not grow with k
    print(f"the real step with k active clients (ms a step; the fit: {1e3 * fixed:.2f} ms + {1e3 * per:.2f} ms per "
          f"client{worth}):")
    for k, s in zip(scan["slots"], scan["step_seconds"]):
        print(f"  k = {k:2d}  {1e3 * s:7.2f} ms a step, {1e3 * s / k:6.2f} ms a client, fit {1e3 * (fixed + per * k):7.2f} ms")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="cnn", choices=["cnn"], help="the model (the fused path's image CNN)")
    p.add_argument("--input", default="1,28,28", help="one sample's shape C,H,W (default MNIST)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--slots", type=int, default=8, help="clients in the fused step (default: the CPU cap, 8)")
    p.add_argument("--batch", type=int, default=10, help="samples per client and step (default: the paper's B = 10)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: the kernels run and are timed there")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1: one fused worker's)")
    p.add_argument("--calls", type=int, default=10, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per kernel (the best is kept)")
    p.add_argument("--steps", type=int, default=20, help="steps of the real fused training timed for comparison (0: skip)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the largest Linear layer")
    p.add_argument("--split", action="store_true",
                   help="also time every aten operation of the real step (CPU only): where the rest beyond the kernels goes")
    p.add_argument("--linear-forms", action="store_true",
                   help="also time the largest per-client Linear layer's products written other ways (CPU only)")
    p.add_argument("--slot-scan", action="store_true",
                   help="also time the real step with 1, 2, … --slots clients and fit a fixed part plus a part per client")
    p.add_argument("--keep-freed-memory", default="auto", choices=["auto", "true", "false"],
                   help="the allocator setting, as the engine's config key keep_freed_memory (default auto: on)")
    p.add_argument("--json", default=str(REPO / "bench" / "kernels.json"))
    args = p.parse_args(argv)
    try:
        input_shape = tuple(int(v) for v in args.input.split(","))
    except ValueError:
        p.error(f"--input must be C,H,W integers, got {args.input!r}")
    if len(input_shape) != 3 or min(input_shape) < 1:
        p.error(f"--input must be C,H,W with positive sizes, got {args.input!r}")
    if args.steps < 0:
        p.error("--steps must be at least 0")
    if args.split and args.steps == 0:
        p.error("--split times the real step: it needs --steps of at least 1")
    if args.slot_scan and args.slots < 2:
        p.error("--slot-scan fits the step's cost over 1 … --slots clients: --slots must be at least 2")
    for flag in ("slots", "batch", "threads", "calls", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device}: not available here (cpu, or cuda with a visible GPU)")
    if args.linear_forms and device.type != "cpu":
        p.error("--linear-forms flushes the CPU's cache and times in CPU time: CPU only")
    if args.split and device.type != "cpu":
        p.error("--split times operations as they return: CPU only (on a GPU use torch.profiler)")
    global SYNC
    if device.type == "cuda":
        SYNC = lambda: torch.cuda.synchronize(device)  # noqa: E731
    torch.set_num_threads(args.threads)
    keep = keep_freed_memory({"true": True, "false": False}.get(args.keep_freed_memory, "auto"), device)
    on = torch.device(device)  # as a context: the device every tensor the kernels make lands on
    torch.manual_seed(0)
    k, b = args.slots, args.batch
    with on:
        model = build_model(args.model, input_shape, args.classes)
        peak_before = matmul_peak_gflops(device)
        timed = [(kern, time_call(kern.run, args.calls, args.repeats)) for kern in step_kernels(model, input_shape, k, b)]
    real = real_step_seconds(args.model, input_shape, args.classes, k, b, args.steps, args.repeats, device) if args.steps else None
    split = (split_step(real_round(args.model, input_shape, args.classes, k, b, args.steps, device), args.steps, args.repeats)
             if args.split else None)
    scan = (slot_scan(args.model, input_shape, args.classes, k, b, args.steps or 20, args.repeats, device)
            if args.slot_scan else None)
    with on:
        peak_after = matmul_peak_gflops(device)
    peak = max(peak_before, peak_after)  # the machine's speed moves: the better of the two
    rows = [Row(kern.name, kern.shape, kern.flops / 1e6, 1e3 * s, kern.flops / s / 1e9, kern.flops / s / 1e9 / peak)
            for kern, s in timed]
    summary = summarise(rows, peak)

    where = (f"{args.threads} thread(s), CPU {cpu_model()} {torch.backends.cpu.get_cpu_capability()}, keep_freed_memory={keep}"
             if device.type == "cpu" else f"GPU {torch.cuda.get_device_name(device)}")
    print(f"fused FedCP step kernels: {args.model} {args.input}, {k} slots × B = {b}, {where}, torch {torch.__version__}")
    print(f"float32 matmul peak (2048³ GEMM), same run: {peak_before:.1f} GFLOP/s before the kernels, "
          f"{peak_after:.1f} after; fractions below are of {peak:.1f}")
    w = max(len(r.name) for r in rows)
    print(f"{'kernel':{w}}  {'MFLOP':>8}  {'ms':>7}  {'GFLOP/s':>8}  {'of peak':>7}  shape")
    for r in rows:
        print(f"{r.name:{w}}  {r.mflop:8.1f}  {r.ms:7.3f}  {r.gflops:8.1f}  {100 * r.fraction_of_peak:6.1f} %  {r.shape}")
    print(f"{'all kernels of one step':{w}}  {1e3 * summary['step_gflop']:8.1f}  {1e3 * summary['kernel_seconds']:7.3f}  "
          f"{summary['ceiling_gflops']:8.1f}  {100 * summary['ceiling_fraction_of_peak']:6.1f} %  "
          f"(the ceiling: nothing but these kernels, each alone)")
    if device.type == "cuda":  # the same kernels without Python's launches: what CUDA graphs could save
        with on:
            replay = graph_seconds(step_kernels(model, input_shape, k, b), args.calls, args.repeats)
        summary.update(graph_seconds=replay, graph_over_kernels=replay / summary["kernel_seconds"])
        print(f"{'all kernels of one step as one CUDA graph':{w}}  {1e3 * summary['step_gflop']:8.1f}  {1e3 * replay:7.3f}  "
              f"{summary['step_gflop'] / replay:8.1f}  {100 * summary['step_gflop'] / replay / peak:6.1f} %  "
              f"({replay / summary['kernel_seconds']:.2f}× the kernels launched one by one)")
    if real is not None:
        rate = summary["step_gflop"] / real
        summary.update(real_step_seconds=real, real_step_gflops=rate, real_step_fraction_of_peak=rate / peak,
                       real_over_kernels=real / summary["kernel_seconds"])
        print(f"{'the real fused step (FedCP local training)':{w}}  {1e3 * summary['step_gflop']:8.1f}  {1e3 * real:7.3f}  "
              f"{rate:8.1f}  {100 * rate / peak:6.1f} %  ({real / summary['kernel_seconds']:.2f}× the kernels' sum; "
              f"mean of {args.steps} steps of {k} synthetic clients)")
    if split is not None:
        print_split(split, w)
    if scan is not None:
        print_slot_scan(scan)
    out = {"model": args.model, "input": list(input_shape), "slots": k, "batch": b, "threads": args.threads,
           "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "cpu_isa": torch.backends.cpu.get_cpu_capability(), "cpu_model": cpu_model(), "keep_freed_memory": keep, "matmul_peak_gflops": [peak_before, peak_after],
           "kernels": [asdict(r) for r in rows], **summary}
    if split is not None:
        out["split"] = split
    if scan is not None:
        out["slot_scan"] = scan
    if args.linear_forms:
        lin = [m for m in model.features.modules() if isinstance(m, nn.Linear)]
        big = max(lin, key=lambda m: m.in_features * m.out_features)
        forms, _ = linear_forms(big.in_features, big.out_features, k, b)
        out["linear_forms"] = []
        print(f"Linear {big.in_features}→{big.out_features} of {k} clients × B = {b}, written other ways "
              f"(CPU ms a call, best of {args.repeats} × {args.calls}):")
        fw = max(len(f.name) for f in forms)
        for form in forms:
            sec = time_form(form, args.calls, args.repeats)
            rate = form.flops / sec / 1e9
            out["linear_forms"].append({"name": form.name, "mflop": form.flops / 1e6, "ms": 1e3 * sec, "gflops": rate,
                                        "fraction_of_peak": rate / peak, "cold": form.cold})
            print(f"  {form.name:{fw}}  {form.flops / 1e6:8.1f}  {1e3 * sec:7.3f}  {rate:8.1f}  {100 * rate / peak:6.1f} %")
    if args.compile:
        lin = [m for m in model.features.modules() if isinstance(m, nn.Linear)]
        big = max(lin, key=lambda m: m.in_features * m.out_features)
        with on:
            comp = compile_comparison(big.in_features, big.out_features, k, b, args.calls, args.repeats)
        for name, v in comp.items():
            print(f"torch.compile, Linear {big.in_features}→{big.out_features} {name}: eager {v['eager_ms']:.3f} ms, "
                  f"compiled {v['compiled_ms']:.3f} ms ({v['eager_ms'] / v['compiled_ms']:.2f}× eager's speed), "
                  f"compiled in {v['compile_seconds']:.1f} s")
        out["compile"] = comp
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
