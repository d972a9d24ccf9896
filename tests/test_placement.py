"""Clients placed on ranks and the rounds' cohorts: greedy placement by samples or by local steps
(config key ``placement``: hand-computed owners and imbalance, the rule ``auto`` picks), the cohorts
and random streams every rank draws alike, the same placement on every rank of a 2-rank fused run,
and that run's accuracy against the one recorded before (placement by samples)."""
import json
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO, run_cmd
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError
from fedcp_dist.state.placement import (client_steps, cohort_size, form_groups, imbalance, place_clients, place_groups,
                                  placement_rule, placement_weights, sample_cohort, steps_per_rank, stream_seed)
from fedcp_dist.engine.startup import place


def test_placement_greedy_largest_first():
    owner = place_clients([10, 50, 20, 40, 30], 2)
    # order 50(c1)→r0, 40(c3)→r1, 30(c4)→r1 (40<50), 20(c2)→r0 (50<70), 10(c0)→r0 or r1: loads 70/70 → r0
    assert owner.tolist() == [0, 0, 0, 1, 1]
    loads = np.bincount(owner, weights=[10, 50, 20, 40, 30])
    assert loads.tolist() == [80, 70]


def test_placement_every_client_once_and_balanced():
    rng = np.random.default_rng(0)
    counts = rng.integers(10, 1000, size=500)
    for world in (1, 2, 3, 8):
        owner = place_clients(counts, world)
        assert len(owner) == 500 and set(owner.tolist()) <= set(range(world))
        loads = np.bincount(owner, weights=counts, minlength=world)
        assert loads.max() - loads.min() <= counts.max()
        assert np.array_equal(owner, place_clients(counts, world))


def test_cohort_same_everywhere_and_sized():
    a = sample_cohort(1, 5, 20, 0.5)
    assert np.array_equal(a, sample_cohort(1, 5, 20, 0.5))
    assert len(a) == 10 and len(set(a.tolist())) == 10 and (np.diff(a) > 0).all()
    assert not np.array_equal(a, sample_cohort(1, 6, 20, 0.5))
    assert sample_cohort(1, 0, 20, 1.0).tolist() == list(range(20))
    assert cohort_size(0.29, 100) == 29 and cohort_size(0.01, 10) == 1


def test_cohort_with_participation_range():
    sizes = {len(sample_cohort(3, t, 50, 1.0, [0.2, 0.6])) for t in range(40)}
    assert min(sizes) >= 10 and max(sizes) <= 30 and len(sizes) > 5


def test_stream_seeds_differ():
    seeds = {stream_seed(1, 2, t, c) for t in range(10) for c in range(10)}
    assert len(seeds) == 100
    assert stream_seed(1, 2, 3) == stream_seed(1, 2, 3) != stream_seed(2, 2, 3)


# one client of 100 samples and ten of 11, batches of 10 without drop_last: 10 steps and 2 steps each
SIZES = [100] + [11] * 10


def test_client_steps_are_batches_times_epochs():
    # drop_last: 19 → 1 batch, 9 (< B) → 1, 0 → 0; without: 19 → 2; two epochs double them
    assert client_steps([19, 9, 0, 30], 10, 1, True).tolist() == [1, 1, 0, 3]
    assert client_steps([19, 9, 0, 30], 10, 1, False).tolist() == [2, 1, 0, 3]
    assert client_steps([19, 9, 0, 30], 10, 2, True).tolist() == [2, 2, 0, 6]
    assert client_steps(SIZES, 10, 1, False).tolist() == [10] + [2] * 10


def test_placement_by_samples_leaves_the_big_client_alone():
    # samples: 100 → rank 0; the 11s go to rank 1 while its load stays ≤ 100: nine reach 99, the
    # tenth meets 100 vs 99 and goes to rank 1 too → rank 0 holds 10 steps, rank 1 holds 20
    owner = place_clients(placement_weights("samples", SIZES, 10, 1, False), 2)
    assert owner.tolist() == [0] + [1] * 10
    per_rank = steps_per_rank(client_steps(SIZES, 10, 1, False), owner, 2)
    assert per_rank.tolist() == [10, 20]
    assert imbalance(per_rank) == pytest.approx(20 / 15)


def test_placement_by_steps_balances_the_steps():
    # steps [10, 2×10]: 10 → r0; clients 1-5 → r1 (2, 4, …, 10); then the loads tie at 10/10 and
    # alternate, rank 0 first: 6 → r0 (12), 7 → r1 (12), 8 → r0 (14), 9 → r1 (14), 10 → r0 (16)
    owner = place_clients(placement_weights("steps", SIZES, 10, 1, False), 2)
    assert owner.tolist() == [0, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0]
    per_rank = steps_per_rank(client_steps(SIZES, 10, 1, False), owner, 2)
    assert per_rank.tolist() == [16, 14]
    assert imbalance(per_rank) == pytest.approx(16 / 15)
    # three ranks: 10 → r0, then 2s to r1, r2 alternately until both reach 10 → loads 10/10/10
    owner3 = place_clients(placement_weights("steps", SIZES, 10, 1, False), 3)
    assert owner3.tolist() == [0, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2]
    assert steps_per_rank(client_steps(SIZES, 10, 1, False), owner3, 3).tolist() == [10, 10, 10]
    assert imbalance([10, 10, 10]) == 1.0 and imbalance([0, 0]) == 1.0


def test_auto_weighs_by_steps_unless_fused_is_off():
    assert placement_rule("auto", "auto") == "steps"
    assert placement_rule("auto", True) == "steps"
    assert placement_rule("auto", False) == "samples"
    assert placement_rule("samples", True) == "samples"
    assert placement_rule("steps", False) == "steps"


def test_place_is_a_function_of_config_and_sizes():
    cfg = SimpleNamespace(placement="auto", fused="auto", batch_size=10, local_epochs=1, drop_last=False)
    owner, rule, per_rank = place(cfg, np.asarray(SIZES), 2)
    assert rule == "steps" and owner.tolist() == [0, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0] and per_rank.tolist() == [16, 14]
    again = place(cfg, np.asarray(SIZES), 2)
    assert np.array_equal(again[0], owner)
    cfg.fused = False
    owner, rule, per_rank = place(cfg, np.asarray(SIZES), 2)
    assert rule == "samples" and owner.tolist() == [0] + [1] * 10 and per_rank.tolist() == [10, 20]


def test_fused_groups_follow_the_steps_and_are_placed_whole():
    # steps 10, 2 × 10 in ⌈11 / 4⌉ = 3 groups of at most 4: largest first (ties by id), each to the
    # lightest group with room (ties: the lower group): 0 → A; 1 → B, 2 → C, 3 → B, 4 → C, 5 → B,
    # 6 → C, 7 → B (full, 8), 8 → C (full, 8); 9, 10 → A (14)
    groups = form_groups(client_steps(SIZES, 10, 1, False), 4)
    assert [g.tolist() for g in groups] == [[0, 9, 10], [1, 3, 5, 7], [2, 4, 6, 8]]
    # 5, 5, 3, 1, 0 steps in 3 groups of at most 2: 1 → A, 2 → B, 3 → C, 0 → C (4), 4 → A (5 = B, the lower)
    assert [g.tolist() for g in form_groups([1, 5, 5, 3, 0], 2)] == [[1, 4], [2], [0, 3]]
    # groups weigh 14, 8, 8 steps: 14 → rank 0, 8 → rank 1, 8 → rank 1 (8 < 14)
    owner = place_groups(client_steps(SIZES, 10, 1, False), groups, 2)
    assert owner.tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    # the groups are the same lists on any world size; each lies on one rank of every world size
    for world in (1, 2, 3, 5):
        owner = place_groups(client_steps(SIZES, 10, 1, False), groups, world)
        assert all(len(set(owner[g].tolist())) == 1 for g in groups)
    cfg = SimpleNamespace(placement="auto", fused="auto", batch_size=10, local_epochs=1, drop_last=False)
    owner, rule, per_rank = place(cfg, np.asarray(SIZES), 2, group_size=4)
    assert rule == "steps" and owner.tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0] and per_rank.tolist() == [14, 16]


def test_bad_placement_is_a_one_line_error():
    with pytest.raises(UserError, match="'placement': must be one of auto, samples, steps, got 'rows'"):
        load_config(str(REPO / "configs" / "digits_fedcp.yaml"), ["placement=rows"])


@pytest.mark.slow
def test_two_rank_fused_run_places_alike_and_keeps_its_accuracy(digits20, tmp_path):
    """One 2-rank fused run (placement by steps, whole fused groups) of the golden fedcp-fused case:
    every client is held by exactly the rank the placement names (ranks that computed different
    placements would hold a client twice or not at all), the start line reports the imbalance, and
    the accuracy is the one recorded with placement by samples, within the golden tolerance."""
    from golden.record import ACC_TOLERANCE, ROUNDS

    out = tmp_path / "run"
    overrides = [f"rounds={ROUNDS}", "eval_every=1", "checkpoint_every=1", "keep_checkpoints=5", "threads=1",
                 f"data.path={digits20}", f"out_dir={out}", "overwrite=true", "fused=true", "placement=auto"]
    r = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "fedcp_dist.run", "--config", "configs/digits_fedcp.yaml", *overrides], timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    from fedcp_dist.data.shards import read_info

    from fedcp_dist.fused.groups import group_size

    cfg = load_config(str(REPO / "configs" / "digits_fedcp.yaml"), overrides)
    counts = read_info(str(digits20)).train_counts
    size = group_size(cfg, torch.device("cpu"), len(counts))
    owner, rule, per_rank = place(cfg, counts, 2, size)
    assert rule == "steps"
    # on this shard the groups matter: client by client they land elsewhere
    assert not np.array_equal(owner, place(cfg, counts, 2)[0])
    groups = form_groups(client_steps(counts, 10, 1, True), size)
    assert len(groups) > 1 and all(len(set(owner[g].tolist())) == 1 for g in groups)
    ck = out / "checkpoints" / "round_0000001"
    held = [sorted(int(c) for c in torch.load(ck / f"clients_{r}.pt", weights_only=True)["clients"]) for r in (0, 1)]
    assert held == [np.flatnonzero(owner == r).tolist() for r in (0, 1)]

    line = re.search(r"placed by (\w+)(?: in \d+ whole fused groups)?, max/mean steps per rank ([0-9.]+) \((\d+)/(\d+)\)", r.stdout)
    assert line, r.stdout[-2000:]
    assert line.group(1) == "steps" and [int(line.group(3)), int(line.group(4))] == per_rank.tolist()
    assert float(line.group(2)) == pytest.approx(imbalance(per_rank), abs=1e-3)
    assert f"placed by steps in {len(groups)} whole fused groups" in r.stdout

    recorded = json.loads((REPO / "tests" / "golden" / "digests.json").read_text())["world_sizes"]["2"]["fedcp-fused"]
    summary = json.loads((out / "summary.json").read_text())
    assert abs(summary["final_acc"] - recorded["final_acc"]) <= ACC_TOLERANCE
    assert abs(summary["best_acc"] - recorded["best_acc"]) <= ACC_TOLERANCE


def test_the_start_line_names_ranks_without_a_fused_group():
    """Groups are fixed by the configuration: with more ranks than groups some ranks train nothing,
    and the placement line says how many and which fused_group gives every rank a group."""
    from fedcp_dist.engine.startup import Setup

    steps = client_steps([30] * 20, 10, 1, False)
    for world, size, idle in ((2, 5, 0), (8, 5, 4), (8, 2, 0)):
        groups = form_groups(steps, size)
        owner = place_groups(steps, groups, world)
        setup = Setup(None, np.arange(20), owner, [], {}, 0.0, "steps", steps_per_rank(steps, owner, world), groups)
        line = setup.placement_line()
        assert line.startswith(f"placed by steps in {len(groups)} whole fused groups, max/mean steps per rank")
        if idle:
            assert line.endswith(f", {idle} of {world} ranks hold no fused group (fused_group=2 gives each rank one)")
        else:
            assert "hold no fused group" not in line
