"""Per-model cost of FedCP: seconds per 1,000 training and test samples, and the seconds per round
they imply for each paper setting on one rank.

    python bench/models.py                      # CPU, 1 thread, all settings
    python bench/models.py --device cuda --threads 0 --samples 2000

Inputs are synthetic tensors of each setting's shape (uint8 images, int64 token ids): the cost of
a step does not depend on the pixel values. One client of ``--samples`` training samples goes
through FedCP's real ``local_train`` (batch 10, one epoch, the setting's η and λ) after a warm-up on
a few batches, and ``--samples`` test samples through its ``predict``. A round of the setting on one
rank then costs (train samples × training cost + test samples × evaluation cost); on P ranks
divide by P (the clients are spread by sample count). Figures go to ``--json`` too.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedcp_dist.algorithms import make_algorithm  # noqa: E402
from fedcp_dist.algorithms.base import Context  # noqa: E402
from fedcp_dist.config import Config  # noqa: E402
from fedcp_dist.data.resident import to_device  # noqa: E402
from fedcp_dist.models import build_model  # noqa: E402

#: name -> (model, input shape, classes, vocabulary, η, λ, train samples per round, test samples per round)
#: the sample counts are the whole source split 75/25, as the paper's 20-client settings use it
SETTINGS = {
    "mnist_cnn": ("cnn", (1, 28, 28), 10, 0, 0.005, 5.0, 52_500, 17_500),
    "cifar100_cnn": ("cnn", (3, 32, 32), 100, 0, 0.005, 5.0, 45_000, 15_000),
    "tinyimagenet_cnn": ("cnn", (3, 64, 64), 200, 0, 0.005, 5.0, 82_500, 27_500),
    "tinyimagenet_resnet18": ("resnet18", (3, 64, 64), 200, 0, 0.1, 1.0, 82_500, 27_500),
    "agnews_fasttext": ("fasttext", (200,), 4, 50_000, 0.1, 1.0, 95_700, 31_900),
}


def client(shape, classes, vocab, n, device, seed=0):
    rng = np.random.default_rng(seed)
    if vocab:
        x = rng.integers(1, vocab, size=(2 * n, *shape)).astype(np.int32)
        lengths = rng.integers(20, shape[0] + 1, size=2 * n)
        x[np.arange(shape[0])[None, :] >= lengths[:, None]] = 0
        arrays = {"train_x": x[:n], "test_x": x[n:], "train_len": lengths[:n].astype(np.int32),
                  "test_len": lengths[n:].astype(np.int32)}
        mean = std = ()
    else:
        x = rng.integers(0, 256, size=(2 * n, *shape), dtype=np.uint8)
        arrays = {"train_x": x[:n], "test_x": x[n:]}
        mean = std = (0.5,) * shape[0]
    y = rng.integers(0, classes, size=2 * n)
    arrays.update(train_y=y[:n], test_y=y[n:])
    return to_device(0, arrays, mean, std, device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name, device, n, eval_bs):
    model_name, shape, classes, vocab, lr, lam, n_train, n_test = SETTINGS[name]
    cfg = Config(lr=lr, lam=lam, eval_batch_size=eval_bs)
    torch.manual_seed(0)
    algo = make_algorithm("fedcp", cfg, build_model(model_name, shape, classes, vocab_size=vocab), device)
    algo.num_clients = 1
    algo.set_global(algo.init_global_state())
    warm = client(shape, classes, vocab, 30, device, seed=1)
    data = client(shape, classes, vocab, n, device)
    state = algo.init_client_state(0)
    gen = torch.Generator(device=device)
    algo.local_train(state, warm, Context(0, 0, gen.manual_seed(1)))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    res = algo.local_train(state, data, Context(0, 0, gen.manual_seed(2)))
    sync(device)
    train_s = (time.perf_counter() - t0) / res.samples * 1000
    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(0, data.n_test, eval_bs):
            algo.predict(res.client_state, data.test_batch(i, i + eval_bs)[0], Context(0, 0, gen))
        sync(device)
    eval_s = (time.perf_counter() - t0) / data.n_test * 1000
    return {
        "setting": name, "model": model_name, "train_s_per_1k": train_s, "eval_s_per_1k": eval_s,
        "round_s_one_rank": (n_train * train_s + n_test * eval_s) / 1000, "train_samples": n_train,
        "test_samples": n_test,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    p.add_argument("--samples", type=int, default=500, help="training (and test) samples of the measured client")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    p.add_argument("--eval-batch-size", type=int, default=1000)
    p.add_argument("--json", default=str(REPO / "bench" / "models_last.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    rows = []
    print(f"FedCP per model on {device} ({torch.get_num_threads()} threads), client of {args.samples} samples, batch 10")
    print(f"{'setting':<24}{'train s/1k':>12}{'eval s/1k':>12}{'round s (1 rank)':>18}")
    for name in names:
        r = measure(name, device, args.samples, args.eval_batch_size)
        rows.append(r)
        print(f"{name:<24}{r['train_s_per_1k']:>12.3f}{r['eval_s_per_1k']:>12.3f}{r['round_s_one_rank']:>18.1f}", flush=True)
    Path(args.json).write_text(json.dumps({"device": str(device), "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    from fedcp_dist.errors import cli_main  # bad input: one line, no traceback
    cli_main(main)()
