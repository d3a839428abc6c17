"""GET /metrics: Prometheus text from a real lab, open on loopback, behind a key from anywhere else, and
free of user, lease and job names."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from openrl_lab.gateway.app import create_app
from openrl_lab.gateway.store import Store
from openrl_lab.kernel.pool import KernelPool
from tests.gateway.helpers import TEXTS, new_trainer, sft_batch


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


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
    assert m[("openrl_http_request_duration_seconds_count", (("method", "POST"),
                                                             ("route", "/api/v1/forward_backward")))] >= 1
    assert m[("openrl_group_slices_total", (("group", "default"),))] >= 1
    assert ("openrl_group_queue_length", (("group", "default"),)) in m
    assert 0.0 <= m[("openrl_group_duty_cycle", (("group", "default"),))] <= 1.0
    assert m[("openrl_kernel_up", (("kernel", "kernel-default"),))] == 1
    assert m[("openrl_kernel_jobs", (("kernel", "kernel-default"),))] >= 1
    assert m[("openrl_kernel_rss_bytes", (("kernel", "kernel-default"),))] > 10_000_000
    assert ("openrl_kernel_swap_bytes_evicted_total", (("kernel", "kernel-default"),)) in m
    assert ("openrl_futures_pending", ()) in m
    # No names of users or their jobs: only routes, groups and kernels label anything.
    labels = {v for (_, ls) in m for _, v in ls}
    assert trainer.model_id not in got.text and "local" not in labels


def test_metrics_off_loopback_need_a_key(tmp_path):
    store = Store(tmp_path / "state.db")
    key = store.add_key("alice", "default")
    app = create_app(tmp_path, store, KernelPool(tmp_path))  # no kernel is started for these requests

    async def get(client_host: str, headers: dict | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://lab") as http:
            return await http.get("/metrics", headers=headers or {})

    assert asyncio.run(get("127.0.0.1")).status_code == 200
    assert asyncio.run(get("::1")).status_code == 200
    remote = asyncio.run(get("10.1.2.3"))
    assert remote.status_code == 401 and "X-API-Key" in remote.json()["detail"]
    assert asyncio.run(get("10.1.2.3", {"X-API-Key": key})).status_code == 200
    store.close()
