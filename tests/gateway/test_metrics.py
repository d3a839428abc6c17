"""GET /metrics: Prometheus text from a real lab, open on loopback, free of user, lease and job names
(from other machines it needs a key: tests/gateway/test_remote_clients.py)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.helpers import TEXTS, new_trainer, sft_batch


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_of_a_running_lab(lab, service):
    trainer = new_trainer(service, seed=11)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS[:2])
    trainer.forward_backward(batch, "cross_entropy").result()
    httpx.get(f"{lab.base_url}/api/v1/no-such-route", timeout=30)
    got = httpx.get(f"{lab.base_url}/metrics", timeout=30)  # loopback: no key
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    m = _samples(got.text)
    fb = ("openrl_http_requests_total", (("method", "POST"), ("route", "/api/v1/forward_backward"), ("status", "200")))
    assert m[fb] >= 1
    assert m[("openrl_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "401")))] >= 1
    assert (
        m[("openrl_http_request_duration_seconds_count", (("method", "POST"), ("route", "/api/v1/forward_backward")))]
        >= 1
    )
    assert m[("openrl_group_slices_total", (("group", "default"),))] >= 1
    assert ("openrl_group_queue_length", (("group", "default"),)) in m
    assert 0.0 <= m[("openrl_group_duty_cycle", (("group", "default"),))] <= 1.0
    assert m[("openrl_kernel_up", (("kernel", "kernel-default"),))] == 1
    assert m[("openrl_kernel_jobs", (("kernel", "kernel-default"),))] >= 1
    assert m[("openrl_kernel_rss_bytes", (("kernel", "kernel-default"),))] > 10_000_000
    assert ("openrl_kernel_swap_bytes_evicted_total", (("kernel", "kernel-default"),)) in m
    # every eviction so far freed what it moved (nothing outside a job's state kept a reference)
    assert m[("openrl_kernel_swap_bytes_retained_total", (("kernel", "kernel-default"),))] == 0
    assert ("openrl_futures_pending", ()) in m
    # No names of users or their jobs: only routes, groups and kernels label anything.
    labels = {v for (_, ls) in m for _, v in ls}
    assert trainer.model_id not in got.text and "local" not in labels
