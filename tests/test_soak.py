"""A brief soak of a real `pallasite serve` process on loopback: mixed streaming requests with
cancels, deadlines and bad inputs, overload bursts past the queue bound. Every status is an
expected one, no KV page stays held after a quiet period, and service resumes after overload."""

from pallasite.tools import soak


def test_brief_soak(tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--minutes", "0.15", "--per-wave", "12", "--max-queue", "4",
                      "--max-rss-growth", "0.5", "--out", str(out), "--",
                      "--max-model-len", "256", "--max-num-seqs", "4",
                      "--max-num-batched-tokens", "64", "--token-buckets", "4,64",
                      "--page-buckets", "16"])
    import json
    rec = json.loads(out.read_text())
    assert code == 0, rec["failures"]
    assert rec["codes"].get("OK", 0) > 0 and rec["codes"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert rec["codes"].get("INVALID_ARGUMENT", 0) + rec["codes"].get("CANCELLED", 0) > 0
    # Two waves at least, so that the RSS growth after warm-up compares two samples.
    assert rec["leaked_pages"] == 0 and rec["waves"] >= 2
