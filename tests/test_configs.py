"""Every shipped config and sweep is valid, and the paper settings carry the paper's values."""
import re

import pytest
import yaml

from conftest import REPO
from fedcp_dist.cli.partition import _build_parser as partition_parser
from fedcp_dist.cli.sweep import main
from fedcp_dist.config import METHODS, flatten, load_config
from fedcp_dist.sweep import load_sweep
from fedcp_dist.sweep.points import point_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SWEEPS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
#: practitioners' presets on users' own data (tests/test_own_data.py runs them)
PRESETS = ("medical_resnet18_fedcp.yaml", "fraud_mlp_fedcp.yaml")
#: natural clients: LEAF's data sets and FedProx's synthetic benchmark (not the paper's settings)
NATURAL = ("femnist_fedcp.yaml", "shakespeare_fedcp.yaml", "synthetic_fedcp.yaml")
PAPER = [p for p in CONFIGS if not p.name.startswith("digits_") and p.name not in PRESETS + NATURAL]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_and_means_what_it_says(path, tmp_path):
    """Every key the file sets arrives in the run's config with the file's value (none dropped
    or shadowed by a default)."""
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    cfg = flatten(load_config(str(path), [f"data.path={shard}"]).to_dict())
    written = flatten(yaml.safe_load(path.read_text()))
    written["data.path"] = str(shard)
    assert {k: cfg[k] for k in written} == written


def test_a_digits_preset_for_every_method_generated_from_its_declarations():
    """configs/digits_<method>.yaml is what the option declarations render (a new method gets its
    own by running python -m fedcp_dist.cli.config_reference), and there is one per method."""
    from fedcp_dist.cli.config_reference import preset, stale_presets

    assert {p.name for p in CONFIGS if p.name.startswith("digits_")} == {f"digits_{m}.yaml" for m in METHODS}
    assert stale_presets() == []
    fedcp = preset("fedcp")  # the method's own option at its default, a departure with its reason
    assert "\nfedcp_global_head: true\n" in fedcp and "\nlam: 0.1  # picked for this tiny set" in fedcp
    assert "lam:" not in preset("fedavg")  # no key of another method


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_settings_use_the_paper_hyperparameters(path):
    cfg = load_config(str(path), validate=False)
    assert (cfg.batch_size, cfg.local_epochs, cfg.rounds) == (10, 1, 2000)
    expected = {"cnn": (0.005, 5.0), "resnet18": (0.1, 1.0), "fasttext": (0.1, 1.0)}[cfg.model]
    assert (cfg.lr, cfg.lam) == expected
    # the partition command in the header names the same file and client count as the config
    cmd = " ".join(l.lstrip("# ").strip() for l in path.read_text().splitlines() if l.startswith("#"))
    assert f"--out {cfg.data.path}" in cmd and f"--num-clients {cfg.data.num_clients}" in cmd
    assert f"--source {cfg.data.source}" in cmd
    if "_pat_" in path.name:
        k = int(re.search(r"--classes-per-client (\d+)", cmd).group(1))
        assert k == {"mnist": 2, "fmnist": 2, "cifar10": 2, "cifar100": 10, "tinyimagenet": 20}[cfg.data.source]
        # the paper's (and the reference library's) pathological partitions give unequal shares
        words = cmd[cmd.index("fedcp-partition"):].replace("\\", " ").split()[1:]
        args = partition_parser().parse_args(words)
        assert args.unbalanced and args.partition == "pat" and args.classes_per_client == k
    elif "_dir0.1" in path.name:
        assert "--partition dir --beta 0.1" in cmd


def _partition_command(path):
    """The fedcp-partition command in a config's header comment, parsed by fedcp-partition's parser."""
    lines = [l.lstrip("# ").strip() for l in path.read_text().splitlines() if l.startswith("#")]
    cmd = next(l for l in lines if l.startswith("fedcp-partition"))
    return partition_parser().parse_args(cmd.split()[1:])


@pytest.mark.parametrize("name, source, model", [("femnist_fedcp.yaml", "femnist", "cnn"),
                                                 ("shakespeare_fedcp.yaml", "shakespeare", "lstm"),
                                                 ("synthetic_fedcp.yaml", "synthetic", "mlp")])
def test_natural_client_configs_say_how_to_make_their_shard(name, source, model):
    """The header's fedcp-partition command writes the config's data.path from the right source; the
    LSTM is LEAF's Shakespeare model; Synthetic(1, 1) trains a cohort of 100 of its 1,000 clients."""
    cfg = load_config(str(REPO / "configs" / name), validate=False)
    args = _partition_command(REPO / "configs" / name)
    assert args.out == cfg.data.path and cfg.data.source == source and cfg.model == model
    assert (cfg.method, cfg.batch_size, cfg.local_epochs) == ("fedcp", 10, 1)
    if source == "synthetic":
        assert (args.source, args.synthetic_alpha, args.synthetic_beta) == ("synthetic", 1.0, 1.0)
        assert args.num_clients == cfg.data.num_clients == 1000 and cfg.participation * 1000 == 100
    else:
        assert args.source == "leaf" and "-t sample" in (REPO / "configs" / name).read_text()
    if model == "lstm":
        assert (cfg.lstm_embed, cfg.lstm_hidden, cfg.lstm_layers) == (8, 256, 2)


def test_fraud_preset_selects_by_mean_features():
    """FedCP's own client vector (the personal head's column sums) does not move under CE + SGD
    (tests/test_selection.py::test_fedcp_client_vector_is_the_initial_vector_then_the_heads_column_sums_which_sgd_keeps),
    so the preset's feature-difference selection compares the banks' mean features instead."""
    cfg = load_config(str(REPO / "configs" / "fraud_mlp_fedcp.yaml"), validate=False)
    assert (cfg.client_selection, cfg.selection_vector) == ("feature_difference", "features")
    assert cfg.participation < 1  # a cohort is drawn at all


def test_the_n_of_50_settings():
    """N = K | 50: a random K of the 50 clients, every one of them training each round."""
    for k in (10, 30):
        cfg = load_config(str(REPO / f"configs/cifar100_dir0.1_n{k}of50_fedcp.yaml"), validate=False)
        assert (cfg.data.num_clients, cfg.data.clients, cfg.participation, cfg.participation_range) == (50, k, 1.0, None)


#: the paper's studies: sweep → (source, the swept key and its values, methods)
PAPER_SWEEPS = {
    "heterogeneity_tinyimagenet": ("tinyimagenet", "beta", [0.01, 0.1, 0.5, 1, 5], METHODS),
    "heterogeneity_agnews": ("agnews", "beta", [0.01, 0.1, 0.5, 1, 5], METHODS),
    "local_epochs": ("cifar10", "local_epochs", [5, 10, 20, 40], METHODS),
    "lambda": ("tinyimagenet", "lam", [0.0, 0.1, 1.0, 5.0, 10.0, 50.0], ("fedcp",)),
    "client_count": ("cifar100", "num_clients", [10, 30, 50, 100, 200, 500], METHODS),
    "client_subset": ("cifar100", "data.clients", [10, 30], METHODS),
    "dropout": ("cifar100", "participation_range", [[1.0, 1.0], [0.5, 1.0], [0.1, 1.0]],
                tuple(m for m in METHODS if m not in ("fedavg", "fedprox"))),  # Table 7 has ten methods
}


@pytest.mark.parametrize("name", PAPER_SWEEPS)
def test_paper_sweeps_run_the_papers_setting(name):
    """Each study on the paper's data set, every method of its table, 5 seeds, its base config's
    model and data set; the drop-out study draws participant counts as the reference does."""
    source, key, values, methods = PAPER_SWEEPS[name]
    sw = load_sweep(REPO / "configs" / "sweeps" / f"{name}.yaml")
    seen = {}
    for p in sw.points:
        cfg = point_config(sw, p)
        assert p.partition.source == source and cfg.data.source == source
        value = p.partition.num_clients if key == "num_clients" else (
            p.partition.beta if key == "beta" else flatten(cfg.to_dict())[key])
        seen.setdefault(value if not isinstance(value, list) else tuple(value), set()).add((cfg.method, cfg.seed))
        if name == "dropout":
            assert cfg.participation_draw == "count" and p.partition.num_clients == 50
        if name == "client_subset":
            assert p.partition.num_clients == 50 and cfg.participation == 1.0
        if name == "lambda":
            assert p.params["beta"] in (0.01, 0.1, 0.5)
    want = {(m, s) for m in methods for s in range(1, 6)}
    assert sorted(seen) == sorted(v if not isinstance(v, list) else tuple(v) for v in values)
    if name == "lambda":  # three β × six λ: each λ value holds 3 × 5 runs of FedCP
        assert all(len(v) == 5 and {m for m, _ in v} == {"fedcp"} for v in seen.values())
    elif name == "client_count":  # the paper reports Per-FedAvg as invalid at N >= 200: excluded, not run
        for n, v in seen.items():
            assert v == (want - {("perfedavg", s) for s in range(1, 6)} if n >= 200 else want), n
    else:
        assert all(v == want for v in seen.values())
    excluded = len(sw.excluded)
    assert excluded == (10 if name == "client_count" else 0)
    assert len(sw.points) + excluded == len(values) * len(want) * (3 if name == "lambda" else 1)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_parses(path, capsys):
    """The dry run of every shipped sweep: its points expand and each point's config is valid and
    holds the point's grid values and variant keys (none dropped or shadowed)."""
    main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    m = re.search(r"sweep \S+: (\d+) points?", out)
    sw = load_sweep(path)
    assert m and int(m.group(1)) == len(sw.points) > 0
    assert out.count("\nexcluded   ") == len(sw.excluded)
    for p in sw.points:
        cfg = point_config(sw, p)
        cfg.data.path = str(sw.base)  # the shard a partition block makes later
        cfg.validate()
        flat = flatten(cfg.to_dict())
        want = {k: v for k, v in p.params.items() if k != "variant" and k not in sw.partition_keys}
        want.update(sw.variants.get(p.params.get("variant"), {}))
        assert {k: flat[k] for k in want} == want, p.name


#: the studies on digits and MNIST: sweep -> (source, seeds, rounds, variant -> the keys it sets)
ABLATIONS = {"fedcp": {}, "wo_cs": {"cpn_input": "sample"}, "wo_cpn": {"fedcp_cpn": False},
             "wo_gfm": {"fedcp_gfm": False}}
CLIENT_VECTORS = {"head": {}, "head+stats": {"cpn_client_vector": "head+stats"},
                  "head+embed": {"cpn_client_vector": "head+embed"}, "sample": {"cpn_input": "sample"},
                  "rho0.5": {"participation": 0.5},
                  "select_features": {"participation": 0.5, "client_selection": "feature_difference",
                                      "selection_vector": "features"}}
STUDIES = {
    "ablations": ("digits", [1, 2, 3], 50, ABLATIONS),
    "ablations_mnist": ("mnist", [1], 30, ABLATIONS),
    "cpn_designs": ("digits", [1, 2, 3], 50, {
        "fedcp": {}, "layers2": {"cpn_layers": 2}, "layers3": {"cpn_layers": 3}, "layers4": {"cpn_layers": 4},
        "batchnorm": {"cpn_norm": "batchnorm"}, "groupnorm": {"cpn_norm": "groupnorm"}, "no_norm": {"cpn_norm": "none"},
        "tanh": {"cpn_act": "tanh"}, "sigmoid": {"cpn_act": "sigmoid"}}),
    "client_vectors": ("digits", [1, 2, 3, 4, 5], 200, CLIENT_VECTORS),
    "client_vectors_mnist": ("mnist", [1], 30, CLIENT_VECTORS),
}


@pytest.mark.parametrize("name", STUDIES)
def test_study_sweeps_run_each_variant_on_every_seed(name):
    """Each row of the ablation, CPN-design and client-vector studies changes only its own keys from
    FedCP's digits preset (or the paper's MNIST setting) on 20 clients Dir(0.1), every seed."""
    source, seeds, rounds, variants = STUDIES[name]
    sw = load_sweep(REPO / "configs" / "sweeps" / f"{name}.yaml")
    assert sw.variants == variants
    base = flatten(load_config(str(sw.base), [f"{k}={v}" for k, v in sw.overrides.items()], validate=False).to_dict())
    seen = set()
    for p in sw.points:
        cfg = flatten(point_config(sw, p).to_dict())
        assert (cfg["method"], cfg["rounds"], cfg["data.source"]) == ("fedcp", rounds, source)
        changed = {k for k in cfg if cfg[k] != base[k]} - {"out_dir", "data.path", "data.num_clients", "seed"}
        assert changed == set(variants[p.params["variant"]]), p.name
        assert (p.partition.source, p.partition.partition, p.partition.beta, p.partition.num_clients) == (
            source, "dir", 0.1, 20)
        seen.add((p.params["variant"], cfg["seed"]))
    assert seen == {(v, s) for v in variants for s in seeds} and len(sw.points) == len(seen)


def test_without_the_gfm_is_fedcp_at_lambda_zero(digits6, tmp_path):
    """Why the ablation sweeps have no separate λ = 0 row: fedcp_gfm=false trains the same numbers."""
    import torch

    from helpers import run

    states = []
    for name, keys in (("gfm", ["fedcp_gfm=false"]), ("lam0", ["lam=0"])):
        run(str(REPO / "configs" / "digits_fedcp.yaml"),
            [f"data.path={digits6}", "data.num_clients=6", "rounds=2", "eval_every=2", "threads=1",
             "checkpoint_every=0", f"out_dir={tmp_path / name}", *keys])
        states.append(torch.load(tmp_path / name / "final_global.pt", weights_only=True))
    assert sorted(states[0]) == sorted(states[1]) and all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_fedcp_against_fedper_on_mnist_to_50_and_150_rounds():
    sw = load_sweep(REPO / "configs" / "sweeps" / "mnist_fedcp_fedper.yaml")
    got = sorted((point_config(sw, p).rounds, point_config(sw, p).seed, point_config(sw, p).method) for p in sw.points)
    assert got == sorted([(50, s, m) for s in (1, 2, 3) for m in ("fedcp", "fedper")] +
                         [(150, 1, m) for m in ("fedcp", "fedper")])
    assert sorted((e.params["rounds"], e.params["seed"]) for e in sw.excluded) == [(150, 2), (150, 2), (150, 3), (150, 3)]
    for p in sw.points:  # resumable: the state after every round is kept
        cfg = point_config(sw, p)
        assert (cfg.checkpoint_every, cfg.keep_checkpoints, cfg.data.source, cfg.lam) == (1, 1, "mnist", 5.0)


def test_digits_methods_sweep_runs_each_digits_preset():
    """The headline sweep of docs/results.md: 12 methods × 3 seeds = 36 points, each point the method's own
    digits preset (configs/digits_<method>.yaml) but for the rounds, seed and where it is written."""
    sw = load_sweep(REPO / "configs" / "sweeps" / "digits_methods.yaml")
    assert len(sw.points) == 36
    assert {(point_config(sw, p).method, point_config(sw, p).seed) for p in sw.points} == {
        (m, s) for m in METHODS for s in (1, 2, 3)}
    assert {(p.partition.source, p.partition.partition, p.partition.beta, p.partition.num_clients,
             p.partition.seed) for p in sw.points} == {("digits", "dir", 0.1, 20, 1)}
    for p in sw.points:
        cfg = flatten(point_config(sw, p).to_dict())
        preset = flatten(yaml.safe_load((REPO / "configs" / f"digits_{cfg['method']}.yaml").read_text()))
        for key in ("rounds", "seed", "out_dir", "data.path"):
            preset.pop(key)
        assert {k: cfg[k] for k in preset} == preset, p.name
        assert (cfg["rounds"], cfg["eval_every"], cfg["threads"]) == (50, 5, 1)
