"""`GET /metrics` in the Prometheus text format (prometheus-client), for operators.

Requests are counted by route template (never the raw path: a fuzzer must not mint series), method and
status, with a latency histogram. Everything else is read when Prometheus scrapes: futures still pending,
each group's queue, holder and duty cycle from the orchestrator (same process), and each kernel's memory,
resident jobs and swap totals (one short kernel call that does not wait for the kernel's running work).
No label carries a user, lease or job name: any key holder may read this page off loopback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("openrl_lab.gateway.metrics")
KERNEL_METRICS_TIMEOUT_S = 2.0
DUTY_WINDOW_S = 60.0


class RequestMetrics:
    """ASGI middleware: openrl_http_requests_total and openrl_http_request_duration_seconds."""

    def __init__(self, app, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter(
            "openrl_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "openrl_http_request_duration_seconds",
            "HTTP request latency (to the response's first byte) by route template and method",
            ["route", "method"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [500]  # if the app raises before it answers

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                route = _template(scope)
                self.latency.labels(route, scope["method"]).observe(time.perf_counter() - t0)
                self.requests.labels(route, scope["method"], str(status[0])).inc()
            await send(message)

        await self.app(scope, receive, send_and_count)
        return None


def _template(scope) -> str:
    """The matched route's path with its parameters as names, prefix included ("unmatched" when none
    matched): a route of a router included under a prefix knows only its own part of the path."""
    route = scope.get("route")
    if route is None or not hasattr(route, "path_format"):
        return "unmatched"
    try:
        own = route.path_format.format(**scope.get("path_params", {}))
    except (KeyError, IndexError, ValueError):
        return route.path
    path = scope["path"]
    return (path[: len(path) - len(own)] if own and path.endswith(own) else "") + route.path


class LabCollector:
    """The control plane's state, read at scrape time. `pending_futures()`, `scheduler` (the in-process
    orchestrator's, or None) and `kernels()` (name -> client with `.call`) are passed in, so this module
    knows nothing of how the gateway keeps them."""

    def __init__(
        self, pending_futures: Callable[[], int], scheduler: Any | None, kernels: Callable[[], dict[str, Any]]
    ):
        self.pending_futures = pending_futures
        self.scheduler = scheduler
        self.kernels = kernels

    def collect(self):
        yield GaugeMetricFamily(
            "openrl_futures_pending", "Requests accepted and not yet answered", value=self.pending_futures()
        )
        if self.scheduler is not None:
            yield from self._groups()
        yield from self._kernels()

    def _groups(self):
        queue = GaugeMetricFamily("openrl_group_queue_length", "Phases waiting for the group", labels=["group"])
        busy = GaugeMetricFamily("openrl_group_busy", "1 while a phase holds the group", labels=["group"])
        switching = GaugeMetricFamily(
            "openrl_group_switching", "1 while the group's resident state moves for a waiting job", labels=["group"]
        )
        duty = GaugeMetricFamily(
            "openrl_group_duty_cycle", f"Busy share of the last {DUTY_WINDOW_S:.0f} s", labels=["group"]
        )
        switch = GaugeMetricFamily(
            "openrl_group_switch_seconds",
            f"Time spent switching tenants in the last {DUTY_WINDOW_S:.0f} s",
            labels=["group"],
        )
        totals = {
            name: CounterMetricFamily(f"openrl_group_{name}", help_, labels=["group"])
            for name, help_ in (
                ("slices", "Slices granted"),
                ("evictions", "Evictions of resident state for a waiting job"),
                ("restores", "Restores of evicted state"),
                ("revocations", "Slices revoked (holder lost or overran)"),
            )
        }
        assert self.scheduler is not None  # collect() asks only with one
        for s in self.scheduler.status(None, window_s=DUTY_WINDOW_S):
            g = s.group.group_id
            queue.add_metric([g], len(s.queue))
            busy.add_metric([g], 1 if s.holder else 0)
            switching.add_metric([g], 1 if s.switching else 0)
            duty.add_metric([g], s.duty.duty_cycle)
            switch.add_metric([g], s.duty.switch_s)
            for name, family in totals.items():
                family.add_metric([g], getattr(s, name))
        yield from (queue, busy, switching, duty, switch, *totals.values())

    def _kernels(self):
        up = GaugeMetricFamily("openrl_kernel_up", "1 if the kernel answered this scrape", labels=["kernel"])
        gauges = {
            key: GaugeMetricFamily(f"openrl_kernel_{key}", help_, labels=["kernel"])
            for key, help_ in (
                ("jobs", "Training jobs resident on the kernel"),
                ("samplers", "Sampler snapshots held"),
                ("rss_bytes", "Kernel process resident memory"),
                ("device_bytes", "Accelerator memory allocated"),
            )
        }
        swaps = {
            key: CounterMetricFamily(f"openrl_kernel_swap_{key}", help_, labels=["kernel"])
            for key, help_ in (
                ("evictions", "State evictions to host memory"),
                ("restores", "State restores to the device"),
                ("bytes_evicted", "Bytes moved to host memory"),
                ("bytes_restored", "Bytes moved to the device"),
                ("bytes_retained", "Evicted bytes that stayed allocated: referenced from outside the job's state"),
                ("seconds", "Seconds spent moving state"),
            )
        }
        sampling = {
            key: CounterMetricFamily(f"openrl_kernel_sample_{key}", help_, labels=["kernel"])
            for key, help_ in (
                ("batches", "Torch sampler batches run (one phase each)"),
                ("calls", "Sample calls those batches served"),
                ("mixed", "Batches that ran calls on several samplers of one base model, each row through its own"),
            )
        }
        for name, client in self.kernels().items():
            try:
                m = client.api(timeout=KERNEL_METRICS_TIMEOUT_S).metrics()
            except Exception as e:  # noqa: BLE001 - a kernel that does not answer is reported as down
                log.debug("kernel %s: no metrics: %s", name, e)
                up.add_metric([name], 0)
                continue
            up.add_metric([name], 1)
            for key, family in gauges.items():
                family.add_metric([name], getattr(m, key))
            for key, family in swaps.items():
                family.add_metric([name], getattr(m.swap, key))
            for key, family in sampling.items():
                family.add_metric([name], getattr(m.sampling, key))
        yield from (up, *gauges.values(), *swaps.values(), *sampling.values())
