"""The round benchmark's figures: its FLOP count against a hand derivation, and its table's arithmetic.

The benchmark itself (bench/round.py) is a script, not a timed test; these tests only check that
what it counts and prints is computed right.
"""
import importlib.util
import json
import re
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import REPO, run_cmd
from fedcp_dist.algorithms.base import Context
from fedcp_dist.algorithms.fedcp import FedCP
from helpers import algo_with_moved_global as _algo
from helpers import random_client as _client


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_round", REPO / "bench" / "round.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fedcp_mnist_flops_per_sample(B: int = 10, K: int = 512, classes: int = 10) -> int:
    """FedCP's FLOPs per trained sample on the 4-layer MNIST CNN, derived by hand (2 per MAC).

    Extractor: conv 1→32 (5×5, 24×24 out), pool, conv 32→64 (5×5, 8×8 out), pool, Linear 1024→K.
    Backward: the first convolution needs no input gradient (its input is data), every other
    layer an input and a weight gradient (2× its forward). The frozen extractor runs forward only.
    CPN Linear K→2K forward + backward; the personal head forward + backward, the frozen global
    head forward + input gradient. MMD: three B×B Gram matrices of K-vectors (2·B²·K each per
    batch), backward two products for h·hᵀ and one for h·h_gᵀ (h_g needs none).
    """
    conv1 = 2 * 24 * 24 * 32 * (1 * 25)
    conv2 = 2 * 8 * 8 * 64 * (32 * 25)
    fc = 2 * 1024 * K
    fe_forward = conv1 + conv2 + fc
    fe_backward = conv1 + 2 * conv2 + 2 * fc
    cpn = 3 * (2 * K * 2 * K)
    head_p = 3 * (2 * K * classes)
    head_g = 2 * (2 * K * classes)
    mmd = (3 + 3) * 2 * B * B * K // B  # six B×B×K products per batch, per sample
    return fe_forward + fe_backward + fe_forward + cpn + head_p + head_g + mmd


def test_flop_count_matches_hand_derivation():
    """torch's FlopCounterMode over FedCP's real local training = the hand derivation, exactly."""
    algo, _ = _algo(FedCP, lr=0.005, lam=5.0)
    data = _client(0, 40)  # 4 full batches of MNIST-shaped images
    with FlopCounterMode(display=False) as fc:
        algo.local_train(algo.init_client_state(0), data, Context(0, 0, torch.Generator().manual_seed(1)))
    per_sample = fc.get_total_flops() / 40
    assert per_sample == fedcp_mnist_flops_per_sample()
    assert per_sample == 36_431_872  # the figure docs/performance.md derives


def fedcp_mnist_eval_flops_per_sample(K: int = 512, classes: int = 10) -> int:
    """One evaluated sample: the personal extractor forward, the CPN forward, both heads forward."""
    conv1 = 2 * 24 * 24 * 32 * (1 * 25)
    conv2 = 2 * 8 * 8 * 64 * (32 * 25)
    return conv1 + conv2 + 2 * 1024 * K + 2 * K * 2 * K + 2 * (2 * K * classes)


def test_peak_is_gemm_flops_over_the_best_time():
    """2·n³ FLOPs over the fastest repeat, in GFLOP/s of the given clock."""
    bench = _load_bench()
    ticks = iter([0.0, 4.0, 10.0, 12.0, 20.0, 25.0])  # repeats of 4, 2 and 5 clock units
    peak = bench.matmul_peak_gflops(torch.device("cpu"), n=64, repeats=3, clock=lambda: next(ticks))
    assert peak == pytest.approx(2 * 64**3 / 2.0 / 1e9)


def test_cpu_model_names_the_family_and_model(tmp_path):
    """The first processor's model name with its x86 family and model numbers (a bare "AMD EPYC"
    on a virtual machine says nothing of the generation); no family line, the name alone."""
    bench = _load_bench()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\n"
                    "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: other\n")
    assert bench.cpu_model(str(info)) == "AMD EPYC (family 26, model 2)"
    info.write_text("processor\t: 0\nmodel name\t: Neoverse\n")
    assert bench.cpu_model(str(info)) == "Neoverse"
    assert bench.cpu_model(str(tmp_path / "none")) != ""


def test_bench_trains_as_the_engine_does_unless_a_variant_is_forced(digits6):
    """No --fused/--sequential: no fused key, so the config's own (fused: auto, or the user's
    override) decides; a forced variant comes after the user's overrides."""
    from fedcp_dist.config import load_config

    bench = _load_bench()
    cfg_path = str(REPO / "configs" / "mnist_dir0.1_fedcp.yaml")
    plain = bench.bench_overrides(digits6, ["rounds=2"], None, 0)
    assert not any(o.startswith("fused=") for o in plain)
    assert load_config(cfg_path, plain).fused == "auto"
    assert load_config(cfg_path, bench.bench_overrides(digits6, ["fused=true"], None, 0)).fused is True
    assert load_config(cfg_path, bench.bench_overrides(digits6, ["fused=true"], False, 0)).fused is False
    assert load_config(cfg_path, bench.bench_overrides(digits6, [], True, 3)).fused_group == 3


@pytest.mark.slow
def test_bench_compare_table(digits6, tmp_path):
    """One documented command end to end (--compare on a small shard): both variants ran the path
    they name, trained exactly the samples the shard's clients hold, and the FLOP count is the
    hand-derived one (digits images are MNIST-shaped)."""
    from fedcp_dist.data.shards import read_info

    out = tmp_path / "bench.json"
    r = run_cmd([sys.executable, "bench/round.py", "--shard", str(digits6), "--config", "configs/digits_fedcp.yaml",
                 "--compare", "--warmup", "0", "--json", str(out), "rounds=1", "threads=1"], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    seq, fus = res["sequential"], res["fused"]
    assert seq["training"] == "sequential (fused=false)" and fus["training"].startswith("fused (fused=true")
    counts = read_info(digits6).train_counts  # every client trains once, B = 10, drop_last
    trained = sum(int(n) - int(n) % 10 if n >= 10 else int(n) for n in counts)
    for v in (seq, fus):
        assert v["client_samples_per_s_per_rank"][0] * v["train_seconds"] == pytest.approx(trained, rel=1e-9)
        assert v["train_flops_per_sample"] == fedcp_mnist_flops_per_sample()
        # the engine's CPU time of local training: one thread cannot spend more than the wall time
        assert 0 < v["train_cpu_seconds_per_thread"][0] <= 1.05 * v["train_seconds"] + 0.05
    # placement: by samples with fused=false, by steps with fused=true; one rank holds every step
    assert (seq["placement"], fus["placement"]) == ("samples", "steps")
    steps = sum((int(n) // 10 if n >= 10 else 1) if n else 0 for n in counts)
    for v in (seq, fus):
        assert v["steps_per_rank"] == [steps] and v["steps_imbalance"] == v["cohort_steps_imbalance"] == 1.0
    assert f"{steps} (placed by steps), max/mean 1.000; timed rounds' cohorts 1.000" in r.stdout
    # the fused steps: the six clients in one group of 8 slots all train at once, so the group
    # takes as many steps as its largest client, with every client's steps among them
    longest = max((int(n) // 10 if n >= 10 else 1) if n else 0 for n in counts)
    assert fus["fused_step_slots"] == 8 and fus["slot_steps_per_rank"] == [steps]
    assert fus["fused_steps_per_rank"] == [longest] and fus["mean_active_slots_per_rank"] == [pytest.approx(steps / longest)]
    assert re.search(rf"^fused steps per rank +{longest}, {steps / longest:.2f} of 8 slots active", r.stdout, re.M)
    assert "fused_steps_per_rank" not in seq
    assert "training / peak" in r.stdout and "fused / sequential" in r.stdout
    # the FLOP floor: every client trained and evaluated once a round, at the measured peak
    tests = int(sum(read_info(digits6).test_counts))
    for v in (seq, fus):
        assert v["eval_flops_per_sample"] == fedcp_mnist_eval_flops_per_sample()
        work = trained * fedcp_mnist_flops_per_sample() + tests * fedcp_mnist_eval_flops_per_sample()
        assert v["round_tflop"] * 1e12 == pytest.approx(work, rel=1e-12)
        assert v["flop_floor_seconds"] == pytest.approx(work / (v["matmul_peak_gflops_per_rank"][0] * 1e9), rel=1e-12)
        assert v["round_over_floor"] == pytest.approx(v["seconds_per_round"] / v["flop_floor_seconds"], rel=1e-12)
    assert r.stdout.count("FLOP floor of a round") == 2
    # threads=1: one fused group (fused_workers=auto takes one per thread); the ISA is named
    assert fus["fused_workers"] == 1 and seq["fused_workers"] is None
    assert seq["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert any(line.startswith("CPU instruction set") and line.split()[-1] == seq["cpu_isa"] for line in r.stdout.splitlines())
    assert seq["cpu_model"] == fus["cpu_model"] and any(line.split()[1:] == seq["cpu_model"].split() for line in r.stdout.splitlines() if line.startswith("CPU "))



@pytest.mark.slow
def test_bench_on_two_ranks_started_by_hand_shares_one_run_folder(digits6, tmp_path):
    """bench/round.py under two ranks (as mpirun or srun start them; torchrun's are the same
    processes): the ranks name one run folder, as the engine's start-up check demands; the six
    clients are one fused group, so rank 1 holds none and takes its FLOP count from rank 0; the
    table counts every step on rank 0, and the folder is gone afterwards."""
    from fedcp_dist.data.shards import read_info
    from helpers import rank_envs, run_hand_ranks

    runs = REPO / "data" / "bench-runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "bench/round.py", "--shard", str(digits6), "--config", "configs/digits_fedcp.yaml",
           "--fused", "--warmup", "0", "--json", str(out), "rounds=1", "threads=1"]
    done = run_hand_ranks([cmd, cmd], rank_envs(), timeout=300)
    assert [rc for rc, _, _ in done] == [0, 0], [err[-2000:] for _, _, err in done]
    res = json.loads(out.read_text())  # one variant: its figures alone
    counts = read_info(digits6).train_counts
    steps = sum((int(n) // 10 if n >= 10 else 1) if n else 0 for n in counts)
    assert res["steps_per_rank"] == [steps, 0]
    assert res["train_flops_per_sample"] == fedcp_mnist_flops_per_sample()
    assert res["train_gflops_per_rank"][0] > 0 and res["train_gflops_per_rank"][1] == 0
    assert (set(runs.iterdir()) if runs.exists() else set()) == before


def _load_kernels():
    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_kernel_bench_covers_the_fused_steps_products_and_convolutions():
    """The kernels of one fused FedCP step are the hand derivation's extractor, frozen extractor
    and CPN FLOPs (everything but the heads and the MMD), and each forward kernel's count is what
    torch's FlopCounterMode counts when it runs (so the timed kernels have the stated shapes)."""
    from fedcp_dist.models import build_model

    kb = _load_kernels()
    k, B, K, classes = 3, 10, 512, 10
    kernels = kb.step_kernels(build_model("cnn", (1, 28, 28), classes), (1, 28, 28), k, B)
    heads = 3 * (2 * K * classes) + 2 * (2 * K * classes)
    mmd = (3 + 3) * 2 * B * B * K // B
    assert sum(kern.flops for kern in kernels) == k * B * (fedcp_mnist_flops_per_sample() - heads - mmd)
    forward = [kern for kern in kernels if "forward" in kern.name]
    assert len(forward) == 7  # two convolutions and the Linear layer, personal and frozen; the CPN
    for kern in forward:
        with FlopCounterMode(display=False) as fc:
            out = kern.run()
        assert fc.get_total_flops() == kern.flops, kern.name
        assert out.shape[0] in (B, k, 1, k * B)


def test_step_cost_fit_by_hand():
    """fit_step_cost is the least-squares line: exact through points on a line, and by hand
    through (1, 4), (2, 7), (3, 8), (4, 11): slope 11 / 5 = 2.2, intercept 7.5 − 2.2 · 2.5 = 2."""
    kb = _load_kernels()
    assert kb.fit_step_cost([1, 2, 3], [5.0, 7.0, 9.0]) == pytest.approx((3.0, 2.0))
    assert kb.fit_step_cost([1, 2, 3, 4], [4.0, 7.0, 8.0, 11.0]) == pytest.approx((2.0, 2.2))
    with pytest.raises(ValueError, match="two different slot counts"):
        kb.fit_step_cost([3, 3], [1.0, 2.0])


def test_kernel_bench_summary_and_json(tmp_path):
    """The ceiling is the kernels' FLOPs over the sum of their times, against the better of the
    run's two peaks; the real step's rate uses the same FLOPs; the JSON holds what was printed."""
    kb = _load_kernels()
    rows = [kb.Row("a", "", 100.0, 2.0, 50.0, 0.5), kb.Row("b", "", 300.0, 2.0, 150.0, 1.5)]
    s = kb.summarise(rows, 100.0)
    assert s["step_gflop"] == pytest.approx(0.4) and s["kernel_seconds"] == pytest.approx(0.004)
    assert s["ceiling_gflops"] == pytest.approx(100.0) and s["ceiling_fraction_of_peak"] == pytest.approx(1.0)

    out = tmp_path / "k.json"
    r = run_cmd([sys.executable, "bench/kernels.py", "--slots", "2", "--calls", "1", "--repeats", "1", "--steps", "2",
                 "--split", "--linear-forms", "--slot-scan", "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    peak = max(res["matmul_peak_gflops"])
    assert len(res["kernels"]) == 11 and res["slots"] == 2 and res["batch"] == 10
    for row in res["kernels"]:
        assert row["gflops"] == pytest.approx(row["mflop"] / row["ms"], rel=1e-9)
        assert row["fraction_of_peak"] == pytest.approx(row["gflops"] / peak, rel=1e-9)
    heads_mmd = 5 * (2 * 512 * 10) + (3 + 3) * 2 * 10 * 512  # the heads and the MMD per sample (left out)
    assert res["step_gflop"] == pytest.approx(2 * 10 * (fedcp_mnist_flops_per_sample() - heads_mmd) / 1e9, rel=1e-12)
    assert res["ceiling_gflops"] == pytest.approx(res["step_gflop"] / res["kernel_seconds"], rel=1e-9)
    assert res["real_step_gflops"] == pytest.approx(res["step_gflop"] / res["real_step_seconds"], rel=1e-9)
    assert res["real_over_kernels"] == pytest.approx(res["real_step_seconds"] / res["kernel_seconds"], rel=1e-9)
    assert "all kernels of one step" in r.stdout and "the real fused step" in r.stdout
    # --linear-forms: the largest Linear (1024→512) of the 2 slots, eight forms, figures from their times
    forms = res["linear_forms"]
    assert len(forms) == 8 and sum(f["cold"] for f in forms) == 2
    assert forms[0]["mflop"] == pytest.approx(2 * 2 * 10 * 1024 * 512 / 1e6)
    for f in forms:
        assert f["gflops"] == pytest.approx(f["mflop"] / f["ms"], rel=1e-9)
        assert f["fraction_of_peak"] == pytest.approx(f["gflops"] / peak, rel=1e-9)
    # --slot-scan: the real step with 1 and 2 clients, the line through both points
    scan = res["slot_scan"]
    assert scan["slots"] == [1, 2] and len(scan["step_seconds"]) == 2 and min(scan["step_seconds"]) > 0
    for k, sec in zip(scan["slots"], scan["step_seconds"]):
        assert scan["fixed_seconds"] + k * scan["per_slot_seconds"] == pytest.approx(sec, rel=1e-9)
    assert "the real step with k active clients" in r.stdout
    # --split: every traced operation in one kind; the rest is what is not a product or convolution
    sp = res["split"]
    kinds = [kind for kind, _ in kb.OP_KINDS] + [kb.OTHER_OPS]
    assert list(sp["seconds"]) == kinds and list(sp["calls_per_step"]) == kinds
    assert sp["products_seconds"] == sp["seconds"][kinds[0]] > 0
    assert sp["rest_seconds"] == pytest.approx(sum(sp["seconds"][k] for k in kinds[1:]), rel=1e-12)
    assert sp["rest_over_products"] == pytest.approx(sp["rest_seconds"] / sp["products_seconds"], rel=1e-12)
    # a step's calls are the same every step: 2 steps give whole numbers; two slots draw Gumbel noise twice a step
    assert all(float(n).is_integer() for n in sp["calls_per_step"].values())
    assert sp["calls_per_step"]["random draws (Gumbel noise)"] == 2
    assert sum(line.startswith("  ") and " calls a step" in line for line in r.stdout.splitlines()) == len(kinds)


def test_kernel_bench_sorts_operations_by_kind():
    kb = _load_kernels()
    assert kb.op_kind("aten.convolution_backward.default") == "matrix products and convolutions"
    assert kb.op_kind("aten.baddbmm_.default") == kb.op_kind("bmm") == "matrix products and convolutions"
    assert kb.op_kind("aten.max_pool2d_with_indices_backward.default") == "max-pooling, forward and backward"
    assert kb.op_kind("aten.exponential_.default") == "random draws (Gumbel noise)"
    assert kb.op_kind("aten.fill_.Scalar") == "copies, fills and gathers"
    assert kb.op_kind("aten.mul.Tensor") == kb.op_kind("aten.sum.dim_IntList") == kb.OTHER_OPS



def test_kernel_bench_linear_forms_compute_the_products_of_the_step():
    """--linear-forms: every forward form gives the step's x·Wᵀ + b, every backward form the input
    gradient g·W and the SGD update W − η·gᵀx; a cold form flushes before each untimed-warm call."""
    kb = _load_kernels()
    torch.manual_seed(3)
    k, b, n_in, n_out, lr = 3, 4, 6, 5, 0.1
    forms, t = kb.linear_forms(n_in, n_out, k, b, lr=lr)
    x, g, w, bias = t["x"], t["g"], t["w"], t["bias"]
    names = [f.name for f in forms]
    assert len(names) == len(set(names)) == 8 and [f.cold for f in forms].count(True) == 2
    fwd = [f for f in forms if f.name.startswith("forward")]
    ref = torch.stack([x[j] @ w[j].t() + bias[j] for j in range(k)])
    for f in fwd[:4]:
        assert f.flops == 2 * k * b * n_in * n_out and torch.allclose(f.run(), ref, rtol=1e-5, atol=1e-6), f.name
    assert fwd[4].run().shape == (k, 64, n_out) and fwd[4].flops == fwd[0].flops * 64 // b
    for f in (f for f in forms if f.name.startswith("backward")):
        before = w.clone()
        gx = f.run()
        assert f.flops == 2 * fwd[0].flops
        assert torch.allclose(gx, torch.stack([g[j] @ before[j] for j in range(k)]), rtol=1e-5, atol=1e-6), f.name
        step = torch.stack([g[j].t() @ x[j] for j in range(k)])
        assert torch.allclose(w, before - lr * step, rtol=1e-5, atol=1e-6), f.name
    calls = []
    form = kb.Form("x", 1, lambda: calls.append(1), cold=True)
    assert kb.time_form(form, calls=2, repeats=3) >= 0 and len(calls) == 1 + 2 * 3


def test_kernel_bench_refuses_bad_arguments(capsys):
    r = run_cmd([sys.executable, "bench/kernels.py", "--input", "1,28"], timeout=120)
    assert r.returncode == 2 and "--input must be C,H,W" in r.stderr and "Traceback" not in r.stderr
    kb = _load_kernels()  # the other refusals in this process: the same main, no second start of torch
    bad = [(["--slots", "0"], "--slots must be at least 1"), (["--device", "tpu"], "--device must be cpu or cuda"),
           (["--split", "--steps", "0"], "--split times the real step")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "--device cuda: not available here"))
    for argv, said in bad:
        with pytest.raises(SystemExit) as exc:
            kb.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and said in err, (argv, err)


def test_dp_bench_means_and_ratios():
    """bench/dp.py: the timed rounds' means (warm-up left out) and DP / no-DP, by hand."""
    spec = importlib.util.spec_from_file_location("bench_dp", REPO / "bench" / "dp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = lambda s: {"kind": "round", "seconds": s, "train_seconds": s / 2, "eval_seconds": 0.1,  # noqa: E731
                     "allreduce_seconds": 0.01}
    base = mod.timed_means([rec(9.0), rec(2.0), rec(4.0), {"kind": "final_eval"}], warmup=1)
    assert base == {"seconds": 3.0, "train_seconds": 1.5, "eval_seconds": pytest.approx(0.1),
                    "allreduce_seconds": pytest.approx(0.01)}
    dp = mod.timed_means([rec(1.0), rec(3.3)], warmup=1)
    assert mod.ratios(base, dp)["seconds"] == pytest.approx(1.1)
    assert mod.variant_overrides("x.h5", ["rounds=2"], ["dp=central"])[-2:] == ["rounds=2", "dp=central"]


def _load_ab():
    spec = importlib.util.spec_from_file_location("bench_ab_step", REPO / "bench" / "ab_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_step_interleaves_two_trees_and_compares_their_results():
    """The A/B bench imports a tree per side, alternates their rounds and says whether the results
    are equal bit for bit: the same tree twice is, float32 against bf16 is not; the caller's own
    modules are in place afterwards."""
    import fedcp_dist.fused.groups as groups_before

    ab = _load_ab()
    same = ab.compare(str(REPO), str(REPO), ("none", "none"), pairs=2, slots=2, batch=2, steps=1)
    assert same["results_bit_identical"] and same["values_compared"] > 1000
    assert len(same["ratios"]) == 2 and all(r > 0 for r in same["ratios"])
    assert same["median_ratio_b_over_a"] == pytest.approx(sum(same["ratios"]) / 2)
    mixed = ab.compare(str(REPO), str(REPO), ("none", "bf16"), pairs=1, slots=2, batch=2, steps=1)
    assert not mixed["results_bit_identical"] and mixed["values_compared"] == same["values_compared"]
    assert sys.modules["fedcp_dist.fused.groups"] is groups_before
    v = ab.flat_values([{"b": torch.tensor([2.0, 3.0]), "a": 1}, (4.5, True)])
    assert v.tolist() == [1.0, 2.0, 3.0, 4.5]


def test_ab_step_refuses_what_is_not_a_tree(tmp_path, capsys):
    ab = _load_ab()
    with pytest.raises(SystemExit) as e:
        ab.main([str(tmp_path), str(REPO)])
    assert e.value.code == 2 and "not a source tree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(REPO), str(REPO), "--amp", "fp16"])


@pytest.mark.parametrize("argv, line", [
    (["bench/soak.py", "no/such/run"], "error: no/such/run/metrics.jsonl cannot be read (No such file or directory): "
                                       "give the folder of a run (its out_dir)"),
    (["bench/cohort.py", "--config", "configs/digits_fedcp.yaml", "data.path=no/such.h5"],
     f"error: config key 'data.path': no such file: no/such.h5 (a relative path, read from the current directory "
     f"{REPO})"),
])
def test_a_benchmark_given_bad_input_says_so_in_one_line(argv, line):
    r = run_cmd([sys.executable, *argv], timeout=120)
    assert (r.returncode, r.stderr) == (2, line + "\n"), r.stderr[-2000:]
