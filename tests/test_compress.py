"""Compressed uploads: top-k, quantisation and decoding, error feedback, the server's sum and the
byte accounting, on small tensors whose results are worked out by hand."""
import pytest
import torch

from helpers import FakeRuntime
from fedcp_dist.comm.aggregate import FlatAggregator
from fedcp_dist.state.client_store import ClientStore
from fedcp_dist.comm.compress import (Compressor, byte_totals, compress_tensor, index_bytes, index_width, kept_count,
                                 quantise, tensor_bytes)
from fedcp_dist.config import load_config
from fedcp_dist.errors import UserError


def test_kept_count_rounds_up_and_keeps_at_least_one():
    assert kept_count(10, 0.25) == 3  # ⌈2.5⌉
    assert kept_count(4, 0.01) == 1
    assert kept_count(3, 1.0) == 3
    assert kept_count(100, 0.3) == 30  # 0.3·100 is 30.000000000000004 in floats: still 30
    assert kept_count(0, 0.5) == 0


def test_top_k_keeps_the_largest_magnitudes_ties_to_the_lower_index():
    delta = torch.tensor([0.5, -2.0, 1.0, 0.25, -1.0, 3.0])
    # k = 3: |3.0| (5), |−2.0| (1), then 1.0 at 2 and −1.0 at 4 tie: the lower index wins
    assert compress_tensor(delta, 0.5, 32).tolist() == [0.0, -2.0, 1.0, 0.0, 0.0, 3.0]
    # the shape is kept, and ratio 1 at 32 bits sends everything as it is
    m = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    assert torch.equal(compress_tensor(m, 1.0, 32), m)
    assert compress_tensor(m, 0.25, 32).tolist() == [[0.0, -2.0], [0.0, 0.0]]


def test_8_bit_codes_use_the_kept_values_min_as_offset_and_range_over_255_as_scale():
    # lo = 0, s = 1/255: 0.11 → code round(28.05) = 28 → 28/255 = 0.10980392…
    got = quantise(torch.tensor([1.0, 0.11, 0.0]), 8)
    assert got.tolist() == pytest.approx([1.0, 28 / 255, 0.0], abs=1e-7)
    assert abs(got[1].item() - 0.11) > 1e-4  # the quantisation error shows
    # top-3 of six, then 8 bits over the kept [−2, 1, 3]: lo = −2, s = 5/255, codes 0, 153, 255
    delta = torch.tensor([0.5, -2.0, 1.0, 0.25, -1.0, 3.0])
    assert compress_tensor(delta, 0.5, 8).tolist() == pytest.approx([0, -2.0, -2 + 153 * 5 / 255, 0, 0, 3.0], abs=1e-6)
    # all kept values equal: scale 0, decoded exactly
    assert quantise(torch.tensor([2.5, 2.5]), 8).tolist() == [2.5, 2.5]


def test_16_bits_is_half_precision():
    assert quantise(torch.tensor([0.1, -3.0]), 16).tolist() == [0.0999755859375, -3.0]


def test_error_feedback_sends_what_was_left_out_later():
    # Δ = [1, 0.25, −0.5, 0] every round, one entry of four sent
    glob = {"w": torch.full((4,), 0.5)}
    upload = {"w": torch.tensor([1.5, 0.75, 0.0, 0.5])}
    c = Compressor("topk", 0.25, 32, True, {"w": (4,)})
    sent1, e1 = c.compress(upload, glob, None)
    assert sent1["w"].tolist() == [1.0, 0.0, 0.0, 0.0] and e1["w"].tolist() == [0.0, 0.25, -0.5, 0.0]
    sent2, e2 = c.compress(upload, glob, e1)  # Δ' = [1, 0.5, −1, 0]: |1| and |−1| tie, index 0 wins
    assert sent2["w"].tolist() == [1.0, 0.0, 0.0, 0.0] and e2["w"].tolist() == [0.0, 0.5, -1.0, 0.0]
    sent3, e3 = c.compress(upload, glob, e2)  # Δ' = [1, 0.75, −1.5, 0]: now the residual's entry goes
    assert sent3["w"].tolist() == [0.0, 0.0, -1.5, 0.0] and e3["w"].tolist() == [1.0, 0.75, 0.0, 0.0]
    # nothing is lost: what was sent plus what is kept is every delta
    total = sent1["w"] + sent2["w"] + sent3["w"] + e3["w"]
    assert total.tolist() == [3.0, 0.75, -1.5, 0.0]
    # without error feedback the same upload sends the same entry every round and keeps nothing
    plain = Compressor("topk", 0.25, 32, False, {"w": (4,)})
    sent, kept = plain.compress(upload, glob, None)
    assert sent["w"].tolist() == [1.0, 0.0, 0.0, 0.0] and kept is None


def test_every_averaging_run_counts_its_uplink_and_a_partly_sent_group_only_by_its_senders():
    from fedcp_dist.comm.compress import uplink_record

    shapes = {"a": torch.Size([10]), "p": torch.Size([2, 3])}
    agg = FlatAggregator(shapes, 1, torch.device("cpu"), groups={"p": "policy"})
    agg.begin_round()
    one = {"a": torch.ones(10), "p": torch.ones(2, 3)}
    agg.add(one, 3)
    agg.add(one, 2, skip=["policy"])  # the second client leaves its CPN out
    agg.add_metrics([0.0])
    agg.reduce(FakeRuntime())
    plain = Compressor("none", 1.0, 32, False, shapes)
    # dense: a from both (2 · 40), p from one (24); sent = the same, saved = the one skipped p
    assert uplink_record(plain, agg, 2, 2) == {"uplink_bytes": 104, "uplink_bytes_dense": 104,
                                               "downlink_bytes": 128, "downlink_bytes_dense": 128,
                                               "uplink_bytes_sent": 104, "uplink_bytes_saved": 24}
    topk = Compressor("topk", 0.5, 8, False, shapes)
    # compressed: a 15 bytes from each of two, p 12 from one
    assert uplink_record(topk, agg, 2, 2)["uplink_bytes"] == 2 * 15 + 12
    # no groups: every uploader sends everything
    flat = FlatAggregator({"a": torch.Size([10])}, 1, torch.device("cpu"))
    flat.add({"a": torch.ones(10)}, 1)
    flat.add_metrics([0.0])
    flat.reduce(FakeRuntime())
    assert uplink_record(Compressor("none", 1.0, 32, False, {"a": (10,)}), flat, 3, 4) == {
        "uplink_bytes": 120, "uplink_bytes_dense": 120, "downlink_bytes": 160, "downlink_bytes_dense": 160}
    # a method that averages nothing (its models travel in the peer exchange) counts nothing here
    none = FlatAggregator({}, 1, torch.device("cpu"))
    assert uplink_record(Compressor("none", 1.0, 32, False, {}), none, 3, 3) == {}


def test_server_adds_the_weighted_mean_of_the_decoded_deltas_to_its_model():
    agg = FlatAggregator({"w": torch.Size([2])}, 0, torch.device("cpu"))
    agg.add({"w": torch.tensor([1.0, 0.0])}, 1)
    agg.add({"w": torch.tensor([0.0, 3.0])}, 3)
    mean, total, _ = agg.reduce(FakeRuntime(), base={"w": torch.tensor([10.0, 10.0])})
    assert total == 4 and mean["w"].tolist() == [10.25, 12.25]  # 10 + [1·1, 3·3] / 4
    assert mean["w"].dtype == torch.float32


def test_index_bytes_take_the_cheaper_of_indices_and_a_bitmap():
    assert [index_width(n) for n in (256, 257, 65536, 65537)] == [1, 2, 2, 4]
    assert index_bytes(10, 3) == 2  # 3 one-byte indices vs a 2-byte bitmap
    assert index_bytes(1000, 5) == 10  # 5 two-byte indices vs 125 bytes of bitmap
    assert index_bytes(10, 10) == 0  # everything sent: no positions
    assert tensor_bytes(1000, 0.005, 8) == 5 + 8 + 10  # 5 codes, scale and offset, 5 indices
    assert tensor_bytes(1000, 1.0, 16) == 2000
    assert tensor_bytes(4, 0.5, 32) == 2 * 4 + 1


def test_round_and_run_byte_accounting():
    c = Compressor("topk", 0.5, 8, False, {"a": (10,), "b": (2, 3)})
    # a: k = 5, 5 codes + 8 + min(5, 2) = 15; b: k = 3, 3 + 8 + min(3, 1) = 12
    assert (c.client_bytes, c.dense_bytes) == (27, 64)
    r = c.round_bytes({"a": 3, "b": 3}, participants=4)
    assert r == {"uplink_bytes": 81, "uplink_bytes_dense": 192, "downlink_bytes": 256, "downlink_bytes_dense": 256}
    # b sent by one client only: 3 · 15 + 12 compressed, 3 · 40 + 24 dense
    assert c.round_bytes({"a": 3, "b": 1}, participants=3) == {
        "uplink_bytes": 57, "uplink_bytes_dense": 144, "downlink_bytes": 192, "downlink_bytes_dense": 192}
    assert byte_totals([r, r]) == {k: 2 * v for k, v in r.items()}
    # a count some rounds lack (resumed from a checkpoint of code that did not count it) has no
    # total: summing the rounds that have it gave a figure neither right nor marked missing
    assert byte_totals([{"kind": "round"}, r, r]) == {}
    off = Compressor("none", 1.0, 32, False, {"a": (10,)})
    assert not off.enabled and off.client_bytes == off.dense_bytes == 40


def test_a_round_that_skips_a_group_sends_and_counts_only_the_rest():
    # "p" (the policy group) is out of the round: not compressed, its residual kept for later,
    # its bytes neither sent nor in the dense figure but saved
    from fedcp_dist.comm.compress import uplink_record

    shapes = {"a": torch.Size([10]), "p": torch.Size([2, 3])}
    c = Compressor("topk", 0.5, 8, True, shapes)
    agg = FlatAggregator(shapes, 1, torch.device("cpu"), groups={"p": "policy"})
    agg.begin_round(("policy",))
    assert agg.sent == ["a"] and agg.buffer.numel() == 10 + 3 + 1
    g = {"a": torch.zeros(10), "p": torch.zeros(2, 3)}
    old = {"a": torch.zeros(10), "p": torch.full((2, 3), 0.5)}
    decoded, residual = c.compress({"a": torch.arange(10.0)}, g, old)
    assert set(decoded) == {"a"} and residual["p"] is old["p"]
    agg.add(decoded, 3)
    agg.add(decoded, 2)
    agg.add_metrics([0.0])
    agg.reduce(FakeRuntime(), base=g)
    # a: k = 5, 5 codes + scale and offset 8 + min(5 indices, a 2-byte bitmap) = 15 bytes (40 dense) per uploader
    assert uplink_record(c, agg, 2, 2) == {"uplink_bytes": 2 * 15, "uplink_bytes_dense": 2 * 40,
                                           "downlink_bytes": 2 * 64, "downlink_bytes_dense": 2 * 64,
                                           "uplink_bytes_sent": 2 * 40, "uplink_bytes_saved": 2 * 24}


def test_the_residual_is_part_of_the_checkpointed_client_state():
    class Algo:
        def set_global(self, g):
            pass

        def init_client_state(self, c):
            return None

    store = ClientStore(Algo(), {})
    store.put(3, None, {}, {"w": torch.tensor([0.25, -1.0])})
    store.put(4, None, {}, None)  # no error feedback: nothing kept
    saved = store.state_dict()
    assert set(saved) == {3} and saved[3]["__ef__/w"].tolist() == [0.25, -1.0]
    again = ClientStore(Algo(), {})
    again.load_state_dict(saved)
    assert again.residual(3)["w"].tolist() == [0.25, -1.0] and again.states[3] is None and again.residual(4) is None


@pytest.mark.parametrize("overrides, key", [
    (["compress_ratio=0.5"], "compress_ratio"),  # without compress=topk
    (["compress_error_feedback=true"], "compress_error_feedback"),
    (["compress=topk", "compress_bits=4"], "compress_bits"),
    (["compress=topk", "compress_ratio=0"], "compress_ratio"),
    (["compress=gzip"], "compress"),
    (["compress=topk", "method=fedamp"], "compress"),
])
def test_bad_compression_settings_name_the_key(overrides, key):
    with pytest.raises(UserError, match=f"config key '{key}'"):
        load_config(None, overrides)
