"""fedcp-analyze / fedcp-dlg: PSNR, SSIM, Grad-CAM and DLG against hand computations; probes read
from hand-made analysis.jsonl files; the server's copy of each method against the method's upload;
one end-to-end CLI call on a 2-round digits run with a checkpoint."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcp_dist.analysis import dlg, gradient_match, server_copy
from fedcp_dist.analysis.gradcam import grad_cam, last_conv
from fedcp_dist.analysis.imaging import match_images, psnr, ssim
from fedcp_dist.analysis.plots import s_shares
from fedcp_dist.analysis.records import loss_by_round, pir_by_round, read_probes
from fedcp_dist.errors import UserError

PNG = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- PSNR, SSIM


def test_psnr_matches_hand_values():
    a = torch.zeros(1, 4, 4)
    assert psnr(a, a + 0.1) == pytest.approx(20.0)  # MSE 0.01: 10·log10(1/0.01)
    b = a.clone()
    b[:, :2] = 0.5  # half the pixels off by 0.5: MSE 0.125, 10·log10(8)
    assert psnr(a, b) == pytest.approx(10 * math.log10(8))
    assert psnr(a, b, peak=255.0) == pytest.approx(10 * math.log10(255.0 ** 2 / 0.125))
    assert psnr(a, a) == 100.0


def test_ssim_hand_values_and_scikit_image():
    x = torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(0))
    assert ssim(x, x) == pytest.approx(1.0)
    # constant images: variances and covariance vanish, SSIM = (2ab + C1) / (a² + b² + C1)
    c1 = 0.01 ** 2
    a, b = torch.full((1, 12, 12), 0.2), torch.full((1, 12, 12), 0.4)
    assert ssim(a, b) == pytest.approx((2 * 0.2 * 0.4 + c1) / (0.2 ** 2 + 0.4 ** 2 + c1))
    assert ssim(x, 1 - x) < 0
    metrics = pytest.importorskip("skimage.metrics")
    y = (x + 0.2 * torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    ref = metrics.structural_similarity(x[0].numpy().astype(np.float64), y[0].numpy().astype(np.float64),
                                        gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0)
    assert ssim(x, y) == pytest.approx(ref, abs=1e-6)


def test_match_images_pairs_by_psnr():
    t = torch.stack([torch.full((1, 3, 3), v) for v in (0.0, 0.5, 1.0)])
    guess = t[[2, 0, 1]] + 0.01
    assert match_images(t, guess) == [1, 2, 0]


# ----------------------------------------------------------------------------- Grad-CAM


class TinyNet(nn.Module):
    """A 1×1 convolution to two maps (x and 0.5 − x), then a linear layer on the flattened maps."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, kernel_size=1)
        self.fc = nn.Linear(18, 2)
        with torch.no_grad():
            self.conv.weight.copy_(torch.tensor([1.0, -1.0]).view(2, 1, 1, 1))
            self.conv.bias.copy_(torch.tensor([0.0, 0.5]))
            w = torch.zeros(2, 2, 3, 3)
            w[1, 0, 0, 0] = 3.0  # class 1: channel 0's gradient averages to 3/9
            w[1, 1] = -1.0  # channel 1's to −1
            w[0, 0] = 1.0
            self.fc.weight.copy_(w.view(2, 18))
            self.fc.bias.zero_()

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def test_grad_cam_equals_hand_computed_map():
    net = TinyNet()
    x = (torch.arange(9.0) / 8).view(1, 1, 3, 3)
    cam = grad_cam(net, net.conv, x, torch.tensor([1]))
    # α = (1/3, −1); L = ReLU(x/3 − (0.5 − x)) = ReLU(4x/3 − 0.5) = ReLU(i/6 − 0.5) for x = i/8;
    # divided by its maximum 5/6
    expected = torch.tensor([[0, 0, 0], [0, 0.2, 0.4], [0.6, 0.8, 1.0]])
    assert torch.allclose(cam[0], expected, atol=1e-6)
    # class 0: α = (1, 0), L = x / max(x); each input of a batch keeps its own class
    both = grad_cam(net, net.conv, torch.cat([x, x]), torch.tensor([0, 1]))
    assert torch.allclose(both[0], x[0, 0], atol=1e-6)
    assert torch.allclose(both[1], expected, atol=1e-6)
    # up-sampled to the input's size, still in [0, 1]; an all-negative map stays zero
    up = grad_cam(net, net.conv, x, torch.tensor([1]), size=(6, 6))
    assert up.shape == (1, 6, 6) and float(up.min()) >= 0 and float(up.max()) <= 1
    assert float(grad_cam(net, net.conv, torch.zeros_like(x), torch.tensor([1])).abs().max()) == 0.0
    assert last_conv(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 3, 3))).out_channels == 3


# ----------------------------------------------------------------------------- DLG on a plain linear model


def _linear_case(num_classes=4, side=6, label=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(side * side, num_classes)
    with torch.no_grad():
        lin.weight.copy_(0.1 * torch.randn(lin.weight.shape, generator=gen))
        lin.bias.zero_()
    truth = torch.rand(1, 1, side, side, generator=gen)

    def grad_fn(x, y):
        params = [lin.weight, lin.bias]
        loss = gradient_match.soft_cross_entropy(lin(x.flatten(1)), y)
        gw, gb = torch.autograd.grad(loss, params, create_graph=True)
        return {"head.weight": gw, "head.bias": gb}

    y = F.one_hot(torch.tensor([label]), num_classes).float()
    observed = {k: v.detach() for k, v in grad_fn(truth, y).items()}
    return truth, grad_fn, observed


def test_dlg_recovers_one_image_from_a_linear_models_gradient():
    truth, grad_fn, observed = _linear_case()
    for labels in (None, gradient_match.infer_labels(observed["head.weight"], 1)):  # DLG, then iDLG
        rec = gradient_match.reconstruct(grad_fn, observed, tuple(truth.shape), 4, labels=labels, steps=60, seed=0)
        assert int(rec.labels[0]) == 2
        assert psnr(truth[0], rec.images[0]) > 40.0, psnr(truth[0], rec.images[0])
        assert rec.loss < 1e-5


def test_infer_labels_and_soft_cross_entropy():
    g = torch.tensor([[0.3, 0.1], [-0.5, -0.2], [0.2, 0.0]])
    assert gradient_match.infer_labels(g, 1).tolist() == [1]
    assert gradient_match.infer_labels(g, 2).tolist() == [1, 2]
    assert gradient_match.infer_labels(g, 4).tolist() == [1, 2, 0, 1]
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    target = torch.tensor([1, 2])
    assert float(gradient_match.soft_cross_entropy(logits, F.one_hot(target, 3).float())) == pytest.approx(
        float(F.cross_entropy(logits, target)))


# ----------------------------------------------------------------------------- the probes


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _hist(bins):
    h = [0] * 50
    for b, n in bins.items():
        h[b] = n
    return h


def test_probes_are_read_and_averaged_by_samples(tmp_path):
    path = _write(tmp_path / "analysis.jsonl", [
        {"kind": "train", "round": 1, "client": 0, "samples": 10, "pir": 0.2, "loss_bef": 2.0, "loss_aft": 1.0},
        {"kind": "train", "round": 1, "client": 1, "samples": 30, "pir": 0.6, "loss_bef": 1.0, "loss_aft": 0.5},
        {"kind": "eval", "evaluated_after": 1, "client": 0, "samples": 5, "pir": 0.4, "s_hist": _hist({10: 4, 20: 4})},
    ], tail='{"kind": "train", "rou')  # a last line cut short by a run still writing
    train, evals = read_probes(path)
    assert len(train) == 2 and len(evals) == 1
    assert pir_by_round(train) == {1: pytest.approx((10 * 0.2 + 30 * 0.6) / 40)}
    assert loss_by_round(train) == {1: (pytest.approx(1.25), pytest.approx(0.625))}
    shares = s_shares(evals[0].s_hist)  # what the s-distribution map colours: half the samples in each bin
    assert shares[10] == shares[20] == 0.5 and shares.sum() == 1.0 and (shares > 0).sum() == 2
    assert not s_shares([0] * 50).any()  # a client without samples: an empty row, not a division by zero


def test_a_diverged_clients_nan_loss_as_a_run_wrote_it_is_read(tmp_path):
    """A run under on_nonfinite=skip writes a diverged client's loss as NaN (and exits 0): the probe
    reader refused the file ("'loss_aft' must be a finite number"), so fedcp-analyze and fedcp-report
    failed on what the run itself wrote. The round's loss is then NaN; the other rounds stay."""
    path = tmp_path / "analysis.jsonl"
    path.write_text("\n".join([
        '{"kind": "train", "round": 1, "client": 0, "samples": 10, "pir": 0.2, "loss_bef": 2.0, "loss_aft": 1.0}',
        '{"kind": "train", "round": 2, "client": 0, "samples": 10, "pir": 0.2, "loss_bef": 1.0, "loss_aft": NaN}',
        '{"kind": "train", "round": 2, "client": 1, "samples": 10, "pir": 0.2, "loss_bef": Infinity, "loss_aft": 0.5}',
    ]) + "\n")
    train, _ = read_probes(path)
    losses = loss_by_round(train)
    assert losses[1] == (2.0, 1.0) and all(math.isnan(v) or math.isinf(v) for v in losses[2])
    path.write_text(path.read_text().replace('"pir": 0.2, "loss_bef": 1.0', '"pir": NaN, "loss_bef": 1.0'))
    with pytest.raises(UserError, match="analysis.jsonl:2: 'pir' must be a finite number in"):  # still refused
        read_probes(path)


def test_s_distribution_map_draws_each_clients_shares_at_the_last_evaluation():
    from fedcp_dist.analysis.plots import plot_s_distribution, pyplot
    from fedcp_dist.analysis.records import EvalProbe, Run

    probes = [EvalProbe(1, c, 8, 0.5, _hist({25: 8})) for c in range(3)]  # an earlier evaluation: not drawn
    probes += [EvalProbe(2, 0, 8, 0.3, _hist({10: 6, 30: 2})), EvalProbe(2, 1, 4, 0.9, _hist({45: 4})),
               EvalProbe(2, 2, 0, 0.0, [0] * 50)]  # client 2 has no test sample at round 2: no row
    run = Run(Path("r"), "fedcp", {}, [], [], None, eval_probes=probes)
    fig = plot_s_distribution([run], None)
    (ax, _colourbar) = fig.axes
    drawn = np.ma.filled(ax.images[0].get_array(), np.nan)
    assert drawn.shape == (2, 50) and [t.get_text() for t in ax.get_yticklabels()] == ["client 0", "client 1"]
    assert drawn[0, 10] == 0.75 and drawn[0, 30] == 0.25 and drawn[1, 45] == 1.0
    assert np.isnan(drawn).sum() == 100 - 3  # empty bins blank, not the smallest colour
    assert list(ax.lines[0].get_xdata()) == [0.3, 0.9]  # each client's PIR marked on its row
    assert "after 2 rounds" in ax.get_title()
    pyplot().close(fig)
    assert plot_s_distribution([run], [1]).axes[0].images[0].get_array().shape == (1, 50)  # --clients 1


@pytest.mark.parametrize("bad, what", [
    ({"kind": "train", "round": 1, "client": 0, "samples": 3, "pir": 1.5, "loss_bef": 1, "loss_aft": 1}, "'pir'"),
    ({"kind": "train", "round": 0, "client": 0, "samples": 3, "pir": 0.5, "loss_bef": 1, "loss_aft": 1}, "'round'"),
    ({"kind": "eval", "evaluated_after": 1, "client": 0, "samples": 3, "pir": 0.5, "s_hist": [1] * 49}, "'s_hist'"),
    ({"kind": "probe"}, "'kind'"),
])
def test_bad_probe_lines_are_named(tmp_path, bad, what):
    good = {"kind": "train", "round": 1, "client": 0, "samples": 3, "pir": 0.5, "loss_bef": 1.0, "loss_aft": 0.9}
    path = _write(tmp_path / "analysis.jsonl", [good, bad, good])
    with pytest.raises(UserError, match=f"analysis.jsonl:2: {what}" if what != "'kind'" else "analysis.jsonl:2"):
        read_probes(path)


# ----------------------------------------------------------------------------- runs with a checkpoint


def _run(shard, out, method, **over):
    from fedcp_dist.config import load_config
    from fedcp_dist.runtime import init_runtime
    from fedcp_dist.engine.simulator import Simulator

    args = [f"method={method}", "rounds=2", "eval_every=1", "checkpoint_every=1", f"data.path={shard}",
            f"out_dir={out}", "threads=1", *[f"{k}={v}" for k, v in over.items()]]
    cfg = load_config("configs/digits_fedcp.yaml", args)
    rt = init_runtime("cpu", 1, env={})
    try:
        Simulator(cfg, rt, echo=lambda *_: None).run()
    finally:
        rt.close()
    return out


@pytest.fixture(scope="module")
def runs(digits6, tmp_path_factory):
    """2-round digits runs (6 clients) with checkpoints after rounds 1 and 2; FedCP without training Gumbel
    noise, so that its upload is a deterministic function of the attacked images."""
    root = tmp_path_factory.mktemp("analysis_runs")
    return {m: _run(digits6, root / m, m, **({"cpn_train_gumbel": "false"} if m == "fedcp" else {}))
            for m in ("fedcp", "fedavg", "fedper")}


@pytest.mark.parametrize("method", ["fedavg", "fedper", "fedcp"])
def test_server_copy_reproduces_the_methods_upload(runs, method):
    """Given the client's private state and the true images, the server's copy of one local step
    gives exactly what the method's own local_train uploads; with what a server knows, FedPer's and
    FedCP's uploads no longer match it."""
    from fedcp_dist.analysis.runstate import load_run_state

    setup = dlg.AttackSetup(clients=[1], batch_size=2, local_steps=1, knowledge="oracle")
    state = load_run_state(runs[method], changes=dlg.state_changes(setup))
    assert state.rounds_done == 2  # the checkpoint after the last round: the final models
    data = state.load_data([1])[1]
    dlg.self_check(state, 1, data.train_batch()[0][:8])
    up = dlg.client_upload(state, data, 1, 0, setup)
    assert up.truth.shape == (2, 1, 28, 28)
    y = F.one_hot(up.labels, state.info.num_classes).float()
    for knowledge, close in (("oracle", True), ("server", method == "fedavg")):
        copy_ = dlg.server_copy(state, 1, knowledge, 1)
        got = copy_.pseudo_gradient(up.truth, y)
        assert sorted(got) == sorted(up.observed)
        err = max(float((got[k].detach() - up.observed[k]).norm() / up.observed[k].norm()) for k in got)
        # float32 uploads over η: a few 1e-4 relative on the CPN's LayerNorm weight; a wrong copy is O(1) off
        assert err < 1e-2 if close else err > 0.1, (knowledge, err)


def test_the_attack_reads_the_upload_as_dp_central_releases_it(runs):
    """Clipped to C without noise, the observed gradient is the plain one times min(1, C/‖Δ‖), Δ the
    delta over every uploaded tensor; with σ the difference from that is N(0, (σC/(η·S))²) per value."""
    from fedcp_dist.analysis.runstate import load_run_state
    from fedcp_dist.comm.privacy import total_norm

    setup = dlg.AttackSetup(clients=[1], batch_size=2)
    state = load_run_state(runs["fedavg"], changes=dlg.state_changes(setup))
    up = dlg.client_upload(state, state.load_data([1])[1], 1, 0, setup)
    norm = total_norm([up.upload[k].double() - up.sent[k].double() for k in up.upload])
    clip = norm / 4
    clipped = dlg.dp_upload(up, clip, 0.0, seed=0)
    for k in up.observed:
        assert torch.allclose(clipped.observed[k], up.observed[k] * 0.25, rtol=1e-4, atol=1e-6), k
    noised = dlg.dp_upload(up, clip, 0.5, seed=0)
    diff = torch.cat([(noised.observed[k] - clipped.observed[k]).reshape(-1).double() for k in up.observed])
    assert float(diff.std()) == pytest.approx(0.5 * clip / up.lr_steps, rel=0.02)
    assert torch.equal(dlg.dp_upload(up, clip, 0.5, seed=0).observed["head.weight"], noised.observed["head.weight"])


def test_dp_settings_of_the_command_line():
    from fedcp_dist.cli.analyze import dp_settings

    assert dp_settings("0.1,inf", "0,0.5") == ((0.1, 0.0), (0.1, 0.5), (math.inf, 0.0))
    assert dp_settings("1", None) == ((1.0, 0.0),) and dp_settings(None, None) == ()
    with pytest.raises(UserError, match="--dp-noise needs --dp-clip"):
        dp_settings(None, "0.1")
    with pytest.raises(UserError, match="--dp-clip inf takes --dp-noise 0 only"):
        dp_settings("inf", "0.1")
    with pytest.raises(UserError, match="--dp-clip must be > 0"):
        dlg.AttackSetup(clients=[0], dp=((0.0, 0.1),)).check()


def test_self_check_catches_a_drifted_copy(runs, monkeypatch):
    from fedcp_dist.analysis.runstate import load_run_state

    state = load_run_state(runs["fedcp"], changes={"cpn_eval_gumbel": False})
    x = state.load_data([0])[0].train_batch()[0][:4]
    dlg.self_check(state, 0, x)
    monkeypatch.setattr(server_copy.ServerCopy, "policy", lambda self, cpn, h: (torch.ones_like(h), torch.zeros_like(h)))
    with pytest.raises(UserError, match="does not reproduce"):
        dlg.self_check(state, 0, x)


def _main(argv):
    from fedcp_dist.cli.analyze import main

    main([str(a) for a in argv])


def test_fedcp_analyze_end_to_end(runs, tmp_path, capsys):
    run = runs["fedcp"]
    probes = [{"kind": "train", "round": r, "client": c, "samples": 10 + c, "pir": 0.1 * c + 0.05 * r,
               "loss_bef": 2.0 / r, "loss_aft": 1.0 / r} for r in (1, 2) for c in range(6)]
    probes += [{"kind": "eval", "evaluated_after": e, "client": c, "samples": 4 + c, "pir": 0.1 * c,
                "s_hist": _hist({5 * c: 4 + c})} for e in (0, 1, 2) for c in range(6)]
    _write(run / "analysis.jsonl", probes)
    out = tmp_path / "out"
    _main([run, "--out", out, "--gradcam", "--clients", "0,3", "--samples", "2"])
    _main(["--no-progress", run, "--out", out, "--dlg", "--clients", "1", "--batches", "1", "--steps", "3",
           "--attacks", "dlg"])
    report = json.loads((out / "report.json").read_text())
    for name in ("accuracy", "pir", "s_distribution", "loss_before_after", "gradcam", "dlg_dlg"):
        assert (out / report["figures"][name]["file"]).read_bytes()[:8] == PNG, name
    summary = report["runs"][0]
    assert summary["rounds_recorded"] == 2 and summary["method"] == "fedcp"
    # last evaluation's PIR weighted by test samples: Σ (4 + c)·0.1c / Σ (4 + c)
    assert summary["pir_eval"]["mean"] == pytest.approx(sum((4 + c) * 0.1 * c for c in range(6)) / sum(4 + c for c in range(6)))
    assert summary["loss_last_round"] == {"round": 2, "before": pytest.approx(1.0), "after": pytest.approx(0.5)}
    assert "after 2 of 2 rounds" in report["gradcam"]["note"]  # the final models
    (row,) = report["dlg"]["rows"]
    assert row["method"] == "fedcp" and row["uploads"] == 1 and 0 < row["psnr_mean"] < 100
    md = (out / "report.md").read_text()
    assert "![PIR against rounds](pir.png)" in md and "| fedcp | fedcp | DLG |" in md
    uploads = json.loads((out / "dlg.json").read_text())["uploads"]
    assert [(u["client"], u["attack"]) for u in uploads] == [(1, "dlg")]
    # under DP settings: a row per setting, the C and σ columns, the PSNR/label figure
    dp_out = tmp_path / "dp"
    _main(["--no-progress", runs["fedavg"], "--out", dp_out, "--dlg", "--clients", "1", "--batches", "1", "--steps",
           "2", "--attacks", "idlg", "--dp-clip", "0.05,inf", "--dp-noise", "0,1"])
    report = json.loads((dp_out / "report.json").read_text())
    assert (dp_out / report["figures"]["dlg_dp"]["file"]).read_bytes()[:8] == PNG
    rows = report["dlg"]["rows"]
    assert [(r["dp_clip"], r["dp_noise"]) for r in rows] == [(0.05, 0.0), (0.05, 1.0), (math.inf, 0.0)]
    assert "| fedavg C=0.05 σ=1 | fedavg | iDLG | 0.05 | 1 |" in report["dlg"]["table"]
    # the folder reused for another run: FedAvg's DLG table and figures are not this run's (they were kept)
    capsys.readouterr()
    _main([runs["fedper"], "--out", dp_out])
    assert capsys.readouterr().err == (f"note: {dp_out / 'report.json'} described other runs: its sections (dlg, "
                                       f"figures, runs) are dropped, not merged with these runs'\n")
    report = json.loads((dp_out / "report.json").read_text())
    assert sorted(report) == ["figures", "run_dirs", "runs"] and list(report["figures"]) == ["accuracy"]
    assert report["run_dirs"] == [str(runs["fedper"].resolve())]
    assert "DLG" not in (dp_out / "report.md").read_text()


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        _main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ")
    return err


def test_one_line_errors(runs, tmp_path, capsys, digits6):
    assert "not a run directory" in _error(capsys, [tmp_path])
    no_ckpt = _run(digits6, tmp_path / "nockpt", "fedcp", checkpoint_every=0)
    assert "checkpoint_every set" in _error(capsys, [no_ckpt, "--gradcam", "--out", tmp_path / "o"])
    assert "ran fedavg" in _error(capsys, [runs["fedavg"], "--gradcam", "--out", tmp_path / "o"])
    assert "--clients" in _error(capsys, [runs["fedcp"], "--clients", "a,b", "--out", tmp_path / "o"])
    # refused by the curves where the run has probe rows (an earlier test may have written them),
    # else by Grad-CAM
    err = _error(capsys, [runs["fedcp"], "--gradcam", "--clients", "9", "--out", tmp_path / "o"])
    assert "client 9 is not in" in err or "no probe rows of client(s) 9 in these runs (their clients: 0 to 5)" in err
    assert "--attacks" in _error(capsys, [runs["fedcp"], "--dlg", "--attacks", "gan", "--out", tmp_path / "o"])
    # DLG checks the clients before its progress bar starts: the refusal is the only output (_error
    # checks one line); FedAvg's run has no probe rows, so DLG, not the curves, refuses
    err = _error(capsys, [runs["fedavg"], "--dlg", "--clients", "9", "--out", tmp_path / "o"])
    assert err == f"error: client 9 is not in {runs['fedavg']} (clients 0..5)"
    assert "'bogus' is not a torch device" in _error(capsys, [runs["fedcp"], "--gradcam", "--device", "bogus", "--out", tmp_path / "o"])
    if not torch.cuda.is_available():
        assert "0 CUDA device(s)" in _error(capsys, [runs["fedcp"], "--dlg", "--device", "cuda:7", "--out", tmp_path / "o"])
    assert "--seed must be an integer in [0," in _error(capsys, [runs["fedcp"], "--dlg", "--seed", "-5", "--out", tmp_path / "o"])
    assert "no client id" in _error(capsys, [runs["fedcp"], "--clients", ",", "--out", tmp_path / "o"])
    assert "--labels" in _error(capsys, [runs["fedcp"], "--labels", "", "--out", tmp_path / "o"])
    # another shard than the run's (another partition of the same set): its clients are other clients
    other = tmp_path / "other.h5"
    from fedcp_dist.cli.partition import main as partition_main

    partition_main(["--source", "digits", "--partition", "dir", "--beta", "0.5", "--num-clients", "6", "--seed", "3",
                    "--out", str(other)])
    capsys.readouterr()
    assert "is not the one the run was made on" in _error(
        capsys, [runs["fedcp"], "--gradcam", "--data", other, "--out", tmp_path / "o"])
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.yaml", "metrics.jsonl"):
        (bad / f).write_bytes((runs["fedcp"] / f).read_bytes())
    (bad / "analysis.jsonl").write_text('{"kind": "eval"}\n')
    assert "analysis.jsonl:1" in _error(capsys, [bad])


def test_figure_names_made_from_labels_are_plain_file_names():
    """--labels 'x/y,z' made Grad-CAM write under a folder x/ that did not exist (a traceback after
    half the figures), and labels with '#' or a space broke report.md's links to the figures."""
    from fedcp_dist.cli.analyze import _file_stems, _labels

    assert _file_stems(["x/y", "z", "my run", "a1#0", "x_y", "../"]) == {
        "x/y": "x_y", "z": "z", "my run": "my_run", "a1#0": "a1_0", "x_y": "x_y_", "../": "run"}
    assert _file_stems(_labels(["r/a1", "s/a1"], None)) == {"a1#0": "a1_0", "a1#1": "a1_1"}


def test_fedcp_analyze_says_a_run_diverged(tmp_path, capsys):
    """A diverged run (it learned nothing) was analysed like any other, its untrained model's
    figures shown with nothing to say so; fedcp-report lists such runs apart."""
    import json

    from fedcp_dist.cli import analyze

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"method: fedcp\nrounds: 1\nout_dir: {run}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "round", "round": 1, "evaluated_after": 0, "acc": 0.1}) + "\n")
    (run / "summary.json").write_text(json.dumps({"method": "fedcp", "status": "diverged", "best_acc": 0.1,
                                                  "rounds": 1}))
    analyze.main([str(run), "--out", str(tmp_path / "out")])
    assert (f"note: {run} diverged (every update was non-finite; it learned nothing): its figures show the untrained "
            f"model, not a result") in capsys.readouterr().err


def _fake_run(folder, rounds=2, method="fedcp"):
    """A run folder with what the curves read: config.yaml and ``rounds`` evaluated rounds."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"method: {method}\nrounds: {rounds}\nout_dir: {folder}\n")
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "round", "round": r, "evaluated_after": r - 1, "acc": 0.1 * r}) + "\n"
        for r in range(1, rounds + 1)))
    return folder


def test_a_sweeps_runs_analysed_again_leave_out_the_analysis_folder_among_them(tmp_path, capsys):
    """Several runs are analysed into their parent's analysis/, which the same glob
    (runs/sweeps/X/runs/*) matches the next time: that call was refused as not a run directory."""
    from fedcp_dist.cli import analyze

    points = [_fake_run(tmp_path / "runs" / name) for name in ("p1", "p2")]
    analyze.main([str(p) for p in points])
    folder = tmp_path / "runs" / "analysis"
    assert (folder / "report.json").is_file()
    capsys.readouterr()
    analyze.main(sorted(str(p) for p in (tmp_path / "runs").iterdir()))  # the glob again: p1, p2 and analysis
    err = capsys.readouterr().err
    assert err == f"note: {folder} skipped: an analysis folder fedcp-analyze wrote (report.json), not a run\n"
    assert [r["label"] for r in json.loads((folder / "report.json").read_text())["runs"]] == ["p1", "p2"]
    assert _error(capsys, [folder]) == (f"error: {folder} is an analysis folder fedcp-analyze wrote (report.json), "
                                        f"not a run directory")
    # recognised by what fedcp-analyze writes there, not by the name
    (tmp_path / "other" / "analysis").mkdir(parents=True)
    (tmp_path / "other" / "analysis" / "report.md").write_text("# mine\n")
    assert _error(capsys, [points[0], tmp_path / "other" / "analysis"]) == (
        f"error: {tmp_path / 'other' / 'analysis'} is not a run directory (no config.yaml)")


def test_options_that_would_do_nothing_and_values_given_twice_are_refused(tmp_path, capsys):
    """fedcp-analyze RUN took --samples 3 without --gradcam and --knowledge oracle without --dlg, and
    did nothing with them; --clients 0,0 attacked client 0 twice and --attacks dlg,dlg ran DLG twice."""
    from fedcp_dist.cli.analyze import main_dlg

    run = _fake_run(tmp_path / "run")
    out = tmp_path / "out"
    for argv, line in (
        (["--samples", "3"], "--samples applies to --gradcam only"),
        (["--layer", "conv1"], "--layer applies to --gradcam only"),
        (["--knowledge", "oracle"], "--knowledge applies to --dlg only"),
        (["--dp-clip", "1"], "--dp-clip applies to --dlg only"),
        (["--gradcam", "--no-progress"], "--no-progress applies to --dlg only"),
        (["--dlg", "--samples", "2"], "--samples applies to --gradcam only"),
        (["--device", "cuda"], "--device applies to --gradcam or --dlg only"),
        (["--data", "x.h5"], "--data applies to --gradcam or --dlg only"),
        # at their default values too: given, they would still do nothing
        (["--steps", "100"], "--steps applies to --dlg only"),
        (["--samples=6"], "--samples applies to --gradcam only"),
        (["--device", "cpu"], "--device applies to --gradcam or --dlg only"),
        (["--clients", "0,3,0"], "--clients: client 0 is given twice"),
        (["--dlg", "--attacks", "dlg,idlg,DLG"], "--attacks: dlg is given twice"),
        (["--dlg", "--dp-clip", "0.1,inf,0.10"], "--dp-clip: 0.1 is given twice"),
        (["--dlg", "--dp-clip", "1", "--dp-noise", "0,0.5,0.5"], "--dp-noise: 0.5 is given twice"),
    ):
        assert _error(capsys, [run, *argv, "--out", out]) == f"error: {line}", argv
    for argv, line in ((["--clients", "1,1"], "--clients: client 1 is given twice"),
                       (["--attacks", "idlg,idlg"], "--attacks: idlg is given twice")):
        with pytest.raises(SystemExit) as exc:
            main_dlg([str(run), *argv, "--out", str(out)])
        assert exc.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"
    assert not out.exists()  # each refused before anything was computed or written


def test_a_config_with_bytes_that_are_not_utf8_is_one_line(tmp_path, capsys):
    """fedcp-analyze printed a UnicodeDecodeError traceback (fedcp-dlg and fedcp-report said one line)."""
    run = _fake_run(tmp_path / "run")
    cfg = run / "config.yaml"
    cfg.write_bytes(cfg.read_bytes().replace(b"fedcp", b"fed\xe9cp", 1))
    said = _error(capsys, [run, "--out", tmp_path / "out"])
    assert said.startswith(f"error: {cfg} cannot be read: 'utf-8' codec can't decode byte 0xe9"), said


def test_a_config_its_summary_contradicts_is_refused(tmp_path, capsys):
    """A config.yaml edited to another method: fedcp-dlg attacked the FedCP checkpoint as FedAvg."""
    import json as _json

    run = _fake_run(tmp_path / "run")
    (run / "summary.json").write_text(_json.dumps({"method": "fedavg", "best_acc": 0.5}))
    method = __import__("yaml").safe_load((run / "config.yaml").read_text())["method"]
    assert method != "fedavg"
    said = _error(capsys, [run, "--out", tmp_path / "out"])
    assert said == (f"error: {run}: config.yaml says method {method} but summary.json says fedavg: one of them was "
                    f"edited or replaced"), said


def _dlg_error(capsys, argv) -> str:
    from fedcp_dist.cli.analyze import main_dlg

    with pytest.raises(SystemExit) as exc:
        main_dlg([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


def test_a_run_without_a_round_a_checkpoint_or_a_finite_model_is_named_so(runs, tmp_path, capsys, monkeypatch):
    """A failed sweep point (metrics.jsonl empty) gave 'wrote 0 figure(s)' and exit 0; one that failed
    before its first checkpoint was told to set checkpoint_every, which it had; fedcp-dlg on a run whose
    model went nan said the method had changed (its self-check's max difference nan)."""
    from fedcp_dist.analysis import runstate

    failed = tmp_path / "failed"
    failed.mkdir()
    config = (runs["fedavg"] / "config.yaml").read_text()
    assert "\ncheckpoint_every: 1\n" in config
    (failed / "config.yaml").write_text(config.replace("\ncheckpoint_every: 1\n", "\ncheckpoint_every: 50\n"))
    (failed / "metrics.jsonl").write_text("")
    assert _error(capsys, [failed, "--out", tmp_path / "o"]) == (
        f"error: {failed} has no recorded round (its metrics.jsonl holds none): the run stopped before its first "
        f"round ended, or has not ended one yet")
    assert _dlg_error(capsys, [failed, "--out", tmp_path / "o"]) == (
        f"error: {failed} has no complete checkpoint: the run ended before its first one, due after round 2 "
        f"(checkpoint_every=50), and the clients' states are kept only in checkpoints")
    # a finished run whose checkpoints were removed: it had left one, not "ended before its first"
    removed = tmp_path / "removed"
    removed.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (removed / name).write_bytes((runs["fedavg"] / name).read_bytes())
    assert _dlg_error(capsys, [removed, "--out", tmp_path / "o"]) == (
        f"error: {removed} has no complete checkpoint: its 2 rounds recorded should have left one (checkpoint_every=1): "
        f"the checkpoints were removed or damaged, and the clients' states are kept only in checkpoints")

    load = runstate.load_run_state

    def diverged(*args, **kwargs):  # the checkpoint of a run whose model went nan
        state = load(*args, **kwargs)
        state.store.set_global({k: t.fill_(math.nan) if t.is_floating_point() else t
                                for k, t in state.global_state.items()})
        return state

    monkeypatch.setattr(runstate, "load_run_state", diverged)
    err = _dlg_error(capsys, [runs["fedavg"], "--clients", "1", "--batches", "1", "--steps", "1", "--out", tmp_path / "o"])
    assert err == (f"error: the model checkpointed in {runs['fedavg']} after 2 round(s) is not finite "
                   f"('{next(iter(load(runs['fedavg']).global_state))}'): the run diverged, and there is nothing to attack")
    state = diverged(runs["fedavg"])
    with pytest.raises(UserError, match=r"after 2 round\(s\) predicts non-finite values for client 0: the run diverged"):
        dlg.self_check(state, 0, state.load_data([0])[0].train_batch()[0][:4])


def test_a_run_given_twice_is_refused_and_its_report_kept(tmp_path, capsys):
    """`fedcp-analyze runs/a runs/a` drew the run beside itself (labels a#0, a#1) into its own
    analysis/ and dropped that report's sections (Grad-CAM's among them) as another run's."""
    from fedcp_dist.cli import analyze

    run = _fake_run(tmp_path / "runs" / "a")
    analyze.main([str(run)])
    report = (run / "analysis" / "report.json").read_text()
    capsys.readouterr()
    assert _error(capsys, [run, run]) == f"error: run {str(run)!r} is given twice; give each run once"
    assert _error(capsys, [run, f"{run}/"]) == f"error: {str(run)!r} and {str(run) + '/'!r} are one run; give each run once"
    assert (run / "analysis" / "report.json").read_text() == report
