"""The gateway's latency histograms place every latency its default timeouts allow in a finite bucket."""

from __future__ import annotations

from gateway.config import Timeouts
from gateway.metrics import Metrics


def test_a_reply_just_within_the_default_timeout_lands_in_a_finite_bucket() -> None:
    """A reasoning model may take minutes for its whole reply or its first token, and the default
    `first_byte` timeout waits 600 s: a latency past the last finite bucket (it was 120 s) lands in
    `+Inf` alone, where histogram_quantile cannot tell 3 minutes from 9."""
    metrics = Metrics()
    seconds = Timeouts().first_byte - 1
    metrics.request_done("chat", "b", "m", 200, seconds)
    metrics.ttft.labels("chat", "b", "m").observe(seconds)
    for name in ("weir_request_duration_seconds", "weir_time_to_first_token_seconds"):
        labels = {"endpoint": "chat", "backend": "b", "model": "m"}
        finite = [
            float(sample.labels["le"])
            for family in metrics.registry.collect()
            if family.name == name
            for sample in family.samples
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf" and sample.value == 1
        ]
        assert finite, f"{name}: {seconds} s falls past every finite bucket"
        # and the buckets still tell minutes apart below it
        assert metrics.registry.get_sample_value(f"{name}_bucket", {**labels, "le": "120.0"}) == 0
