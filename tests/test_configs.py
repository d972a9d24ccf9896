"""Every shipped config and sweep is valid, and the paper settings carry the paper's values."""
import re

import pytest
import yaml

from conftest import REPO
from fedcp_dist.cli.sweep import main
from fedcp_dist.config import METHODS, flatten, load_config
from fedcp_dist.sweep import load_sweep

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SWEEPS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
#: practitioners' presets on users' own data (tests/test_own_data.py runs them)
PRESETS = ("medical_resnet18_fedcp.yaml", "fraud_mlp_fedcp.yaml")
PAPER = [p for p in CONFIGS if not p.name.startswith("digits_") and p.name not in PRESETS]


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


def test_a_digits_config_for_every_method():
    assert {p.name for p in CONFIGS if p.name.startswith("digits_")} == {f"digits_{m}.yaml" for m in METHODS}


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
    elif "_dir0.1" in path.name:
        assert "--partition dir --beta 0.1" in cmd


def test_the_n_of_50_settings():
    for k, rho in ((10, 0.2), (30, 0.6)):
        cfg = load_config(str(REPO / f"configs/cifar100_dir0.1_n{k}of50_fedcp.yaml"), validate=False)
        assert cfg.data.num_clients == 50 and cfg.participation == rho and round(rho * 50) == k


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_parses(path, capsys):
    """The dry run of every shipped sweep: its points expand and each point's config is valid."""
    main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    m = re.search(r"sweep \S+: (\d+) points", out)
    assert m and int(m.group(1)) == len(load_sweep(path).points) > 0
