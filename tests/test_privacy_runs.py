"""dp=central in whole runs on the 16x16 digits shard: every upload added to the sum is within the
clip norm (measured on the real uploads, fused and compressed), resume is bit-identical (adaptive
clipping's C included), 1 and 2 ranks give the same bits on the default fused path, it runs with a
disk client store and the probes, and what the client count rules out is refused before any round."""
import json

import pytest
import torch

from helpers import load_run, resume_before_last_checkpoint, run, runs_on_one_and_two_ranks
from fedcp_dist.comm.aggregate import FlatAggregator
from fedcp_dist.errors import UserError

CONFIG = "configs/digits_fedcp.yaml"


def _overrides(shard, out, *extra):
    return [f"data.path={shard}", f"out_dir={out}", "eval_every=1", "threads=1", "overwrite=true", "dp=central",
            *extra]


def _added_norms(monkeypatch) -> list:
    """The L2 norm of every weight·upload the aggregator adds (one per client and round)."""
    norms, add = [], FlatAggregator.add

    def recording(self, upload, weight, skip=()):
        norms.append(float(weight) * float(torch.linalg.vector_norm(
            torch.cat([upload[k].detach().double().reshape(-1) for k in self.sent]))))
        return add(self, upload, weight, skip)

    monkeypatch.setattr(FlatAggregator, "add", recording)
    return norms


@pytest.mark.parametrize("extra", [[], ["compress=topk", "compress_ratio=0.1", "compress_bits=8",
                                        "compress_error_feedback=true"]], ids=["dense", "topk8-ef"])
def test_every_upload_added_is_clipped(digits20_16px, tmp_path, monkeypatch, extra):
    """C = 0.05, below every client's update norm here: each added upload has norm C (to float64
    rounding; top-k: at most C, after the 8-bit codes), never more; on the default (fused) path."""
    norms = _added_norms(monkeypatch)
    lines = []
    summary = run(CONFIG, _overrides(digits20_16px, tmp_path, "rounds=2", "participation=0.5", "dp_clip=0.05",
                                     "dp_noise_multiplier=0.3", *extra), echo=lines.append)
    assert "training: fused" in lines[0] and "DP central: clip C=0.05" in lines[0]
    assert len(norms) == 2 * 10
    assert max(norms) <= 0.05 * (1 + 1e-12)
    # dense: every update was clipped to exactly C; top-k sends the largest tenth of the clipped delta
    assert min(norms) > (0.05 * (1 - 1e-6) if not extra else 0.0)
    assert summary["dp_epsilon"] > 0 and summary["dp_delta"] == 1e-5
    _, _, records = load_run(tmp_path)
    assert [r["dp_clip"] for r in records] == [0.05, 0.05]
    assert records[0]["dp_epsilon"] < records[1]["dp_epsilon"] == summary["dp_epsilon"]


ADAPTIVE = ("participation_sampling=poisson", "participation=0.5", "dp_clip=adaptive", "dp_clip_init=0.2",
            "dp_noise_multiplier=0.5")


def test_resume_is_bit_identical_with_adaptive_clipping(digits20_16px, tmp_path):
    def overrides(out):
        return _overrides(digits20_16px, out, "rounds=3", "checkpoint_every=1", "keep_checkpoints=5", *ADAPTIVE)

    run(CONFIG, overrides(tmp_path / "whole"))
    state, accs, records = load_run(tmp_path / "whole")
    clips = [r["dp_clip"] for r in records]
    assert len(set(clips)) == 3  # C moved every round
    state2, accs2, records2 = resume_before_last_checkpoint(CONFIG, overrides, tmp_path / "whole", tmp_path / "resumed", 3)
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert accs == accs2
    keep = ("dp_epsilon", "dp_clip", "dp_unclipped_fraction", "train_loss", "participants")
    assert [{k: r[k] for k in keep} for r in records] == [{k: r[k] for k in keep} for r in records2]
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "resumed"))
    assert s1["dp_clip"] == s2["dp_clip"] and s1["dp_epsilon"] == s2["dp_epsilon"]


@pytest.mark.slow
def test_one_and_two_ranks_give_the_same_bits_on_the_default_path(digits20_16px, tmp_path):
    """Adaptive clipping with Poisson cohorts, and fixed cohorts with compressed uploads and error
    feedback: the final global state, the clients' states, the records and the summary (timings
    aside) are the same bits on 1 and 2 ranks."""
    from golden.record import digest_run

    def job(*extra):
        return CONFIG, lambda out: ["rounds=2", "checkpoint_every=1", "keep_checkpoints=5",
                                    *_overrides(digits20_16px, out, *extra)]

    jobs = {"adaptive": job(*ADAPTIVE),
            "topk": job("method=fedavg", "participation=0.5", "compress=topk", "compress_ratio=0.2",
                        "compress_error_feedback=true", "dp_clip=1.0", "dp_noise_multiplier=0.1")}
    runs_on_one_and_two_ranks(tmp_path, jobs)
    for name in jobs:
        one, two = digest_run(tmp_path / "one" / name), digest_run(tmp_path / "two" / name)
        assert one["final_acc"] > 0.15, name  # it learned: not a comparison of untouched states
        assert one == two, name


def test_dp_runs_with_a_disk_store_and_the_probes(digits20_16px, tmp_path):
    summary = run(CONFIG, _overrides(digits20_16px, tmp_path, "rounds=2", "client_state=disk", "analysis=true",
                                     "participation=0.5", "dp_clip=adaptive", "compress=topk",
                                     "compress_error_feedback=true"))
    assert 0 <= summary["final_acc"] <= 1 and summary["dp_epsilon"] > 0
    assert (tmp_path / "analysis.jsonl").read_text().strip()


def test_what_the_shard_rules_out_is_refused_before_any_round(digits20_16px, tmp_path):
    with pytest.raises(UserError, match=r"config key 'dp_delta': 0.06 is not below 1/N = 1/20: .*; dp_delta=0.001, say$"):
        run(CONFIG, _overrides(digits20_16px, tmp_path, "dp_delta=0.06"))
    assert not (tmp_path / "metrics.jsonl").exists()
