"""The plan explorer's prices for context parallelism (the prefill ring) and pipeline stages,
on the Llama-3 8B and 70B shapes, against arithmetic done by hand."""


import pytest

from pallasite.tools.plan import inputs as pi, parallel as pp

H100 = pi.Cluster(pi.GPUS["h100"])


@pytest.fixture(scope="module")
def eight_b():
    return pi.load_model("llama-3-8b")


def test_ring_bytes_and_overlap_on_the_8b_shape(eight_b):
    """K and V of one token, 32 layers x 8 kv heads x 128 x 2 bytes x 2 = 128 KiB; cp=2 over
    128k tokens sends one block of 64k tokens: 8 GiB per device. The ring of cp=4 sends three
    blocks of 32k (3 x 4 GiB); its attention hides most of the link time."""
    wl = pi.Workload()
    c2 = pp.cp_prefill(eight_b, H100, wl, 131072, 2)
    assert c2.ring_bytes == 65536 * 131072
    c4 = pp.cp_prefill(eight_b, H100, wl, 131072, 4)
    assert c4.ring_bytes == 3 * 32768 * 131072
    bw, lat = H100.link(4)
    assert c4.ring_s == pytest.approx(c4.ring_bytes / bw + 3 * lat * 32)
    assert 0 <= c4.ring_exposed_s < c4.ring_s
    one = pp.cp_prefill(eight_b, H100, wl, 131072, 1)
    assert one.ring_bytes == 0 and one.ttft_s == one.compute_s
    # Compute splits; every device still reads the weights and gathers the new pages.
    assert one.ttft_s / 2 < c2.ttft_s < one.ttft_s / 1.5
    assert c4.ttft_s < c2.ttft_s


def test_cp_is_recommended_under_a_ttft_target(eight_b):
    wl = pi.Workload()
    one = pp.cp_prefill(eight_b, H100, wl, 131072, 1).ttft_s * 1e3
    rec = pp.recommend(eight_b, H100, wl, 131072, ttft_ms=0.6 * one)
    assert rec["cp"]["cp"] == 2 and rec["cp"]["ttft_ms"] <= 0.6 * one
    assert "cp" not in pp.recommend(eight_b, H100, wl, 131072, ttft_ms=2 * one)
    assert "pp" not in rec  # 16 GB fits one H100


def test_pipeline_bubble_imbalance_and_memory():
    """80 layers in 3 stages: 27, 27, 26; the slowest stage over the mean 80/3 is 81/80 of
    the layers' share; 4 micro-batches over 3 stages idle 2/6 of the time."""
    seventy = pi.load_model("llama-3-70b")
    wl = pi.Workload()
    assert pp.stage_split(80, 3) == [27, 27, 26]
    c = pp.pp_step(seventy, H100, wl, 64, 4096, 3, micro_batches=4)
    assert c.bubble == pytest.approx(2 / 6)
    layer = (c.stage_s - c.p2p_s) / 27
    assert c.imbalance == pytest.approx((27 * layer + c.p2p_s) / (80 / 3 * layer + c.p2p_s))
    assert c.imbalance > 1
    one = pp.pp_step(seventy, H100, wl, 64, 4096, 1)
    two = pp.pp_step(seventy, H100, wl, 64, 4096, 2)
    assert two.weights_gib == pytest.approx(one.weights_gib / 2, rel=0.05)  # half the layers
    assert one.bubble == 0 and two.bubble == pytest.approx(1 / 3)


def test_pp_is_recommended_where_tensor_parallel_alone_does_not_fit():
    """70B in bf16 (141 GB) on hosts of two H100s: tp=2 holds 70 GB a device, more than the
    budget; two stages of tp=2 hold 35 GB."""
    seventy = pi.load_model("llama-3-70b")
    pairs = pi.Cluster(pi.GPUS["h100"], gpus_per_host=2, hosts=2)
    assert pp.recommend(seventy, pairs, pi.Workload(), 4096)["pp"] == dict(pp=2, tp=2)
    assert "pp" not in pp.recommend(seventy, H100, pi.Workload(), 4096)  # tp=4 fits in 8
