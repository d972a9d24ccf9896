"""Every shipped config and sweep is valid, and the paper settings carry the paper's values."""
import re
import sys

import pytest

from conftest import REPO, run_cmd
from fedcp_dist.config import METHODS, load_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SWEEPS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
PAPER = [p for p in CONFIGS if not p.name.startswith("digits_")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(path, tmp_path):
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"")
    cfg = load_config(str(path), [f"data.path={shard}"])
    assert cfg.method in METHODS


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
def test_sweep_parses(path, tmp_path):
    r = run_cmd([sys.executable, "-m", "fedcp_dist.cli.sweep", str(path), "--dry-run"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(r"sweep \S+: \d+ points", r.stdout)
