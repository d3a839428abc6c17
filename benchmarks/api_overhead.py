"""API overhead: one supervised step through the tinker SDK over loopback vs the same step in-process.

    .venv/bin/python benchmarks/api_overhead.py [--steps 30] [--rounds 3]

It also reports the bare round trip of `GET /api/v1/healthz` on a keep-alive connection (what every request
pays before any work), which HTTP server implementation uvicorn picked, and the machine it ran on.

Both sides run the same LoRA job code on the same built-in model, batch and optimizer settings; the only
difference is the path (SDK -> HTTP -> gateway -> kernel process vs a direct call). A third column drives
the same HTTP requests from a minimal client, to tell the server's overhead from the SDK client's. Two sizes: a ~10 ms
step and a ~100 ms step. The machine is shared and noisy, so the two sides alternate in rounds and the
figure is the ratio of medians within one run: efficiency = direct time / API time (1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tqdm import tqdm

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.server import LabServer
from openrl_lab.sockets import http_client
from openrl_lab.train.models import resolve_model_dir
from openrl_lab.train.trainer import AdamSettings, BaseModelHost, Datum, LoraSettings

SIZES = {"~10 ms step": (4, 24), "~100 ms step": (32, 96)}  # (batch, tokens per datum)
if os.environ.get("BENCH_ONLY_SMALL"):
    SIZES = dict(list(SIZES.items())[:1])


def make_batch(batch: int, length: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, vocab, size=length + 1) for _ in range(batch)]
    sdk = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1].tolist()),
            loss_fn_inputs={"target_tokens": r[1:].tolist(), "weights": [1.0] * length},
        )
        for r in rows
    ]
    direct = [
        Datum(
            tokens=r[:-1].astype(np.int64),
            inputs={"target_tokens": r[1:].astype(np.int64), "weights": np.ones(length, np.float32)},
        )
        for r in rows
    ]
    return sdk, direct


class RawHttpTrainer:
    """The same step as the SDK sends it (protobuf forward_backward, JSON optim_step, long-polled futures),
    from a minimal httpx client: separates the server's overhead from the SDK's own client-side cost."""

    def __init__(self, base_url: str, api_key: str, trainer):
        self.http = http_client(base_url=base_url + "/api/v1", headers={"X-API-Key": api_key}, timeout=60)
        self.model_id = trainer.model_id
        self.seq = 0
        self.adam = {
            "learning_rate": 1e-3,
            "beta1": 0.9,
            "beta2": 0.95,
            "eps": 1e-12,
            "weight_decay": 0.0,
            "grad_clip_norm": 0.0,
        }

    def step(self, batch) -> None:
        self.seq += 1
        body = forward_backward_request_to_proto(
            types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=batch, loss_fn="cross_entropy"),
                model_id=self.model_id,
                seq_id=self.seq,
            )
        ).SerializeToString()
        fb = self.http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
        self.seq += 1
        opt = self.http.post(
            "/optim_step",
            json={"model_id": self.model_id, "seq_id": self.seq, "adam_params": self.adam, "type": "optim_step"},
        )
        for r in (fb, opt):
            while True:
                got = self.http.post("/retrieve_future", json={"request_id": r.json()["request_id"]})
                if not (
                    got.headers["content-type"].startswith("application/json") and got.json().get("type") == "try_again"
                ):
                    break


def time_steps(step, n: int) -> float:
    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def healthz_round_trip_ms(base_url: str, n: int = 200) -> tuple[float, float]:
    """(median, 90th percentile) of `GET /api/v1/healthz` on one keep-alive connection."""
    with http_client(base_url=base_url) as http:
        http.get("/api/v1/healthz")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            http.get("/api/v1/healthz").raise_for_status()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def machine() -> str:
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    loops = [name for name in ("uvloop", "httptools") if _importable(name)]
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}; uvicorn fast paths: {', '.join(loops) or 'none (asyncio + h11)'}"
    )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="openrl-bench-"))
    host = BaseModelHost(resolve_model_dir(DEFAULT_MODEL, home))
    vocab = host.card.vocab_size
    adam_sdk = types.AdamParams(learning_rate=1e-3)
    adam = AdamSettings(learning_rate=1e-3)
    print(f"machine: {machine()}")
    with LabServer(home) as lab:
        rtt = healthz_round_trip_ms(lab.base_url)
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        rows = []
        for label, (batch, length) in SIZES.items():
            sdk_batch, direct_batch = make_batch(batch, length, vocab)
            trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result()
            job = host.create_job(f"bench-{batch}", LoraSettings(rank=16, seed=0))

            def api_step():
                fb = trainer.forward_backward(sdk_batch, "cross_entropy")  # noqa: B023 - called within this iteration
                opt = trainer.optim_step(adam_sdk)  # noqa: B023 - called within this iteration
                fb.result(), opt.result()

            def direct_step():
                job.forward_backward(direct_batch, "cross_entropy")  # noqa: B023 - called within this iteration
                job.optim_step(adam)  # noqa: B023 - called within this iteration

            raw = RawHttpTrainer(
                lab.base_url,
                lab.api_key,
                service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result(),
            )

            api_t, raw_t, direct_t = [], [], []
            for _ in tqdm(range(args.rounds), desc=label, unit="round"):
                direct_t.append(time_steps(direct_step, args.steps))
                api_t.append(time_steps(api_step, args.steps))
                raw_t.append(time_steps(lambda: raw.step(sdk_batch), args.steps))  # noqa: B023 - called within this iteration
            d, a, r = (statistics.median(x) for x in (direct_t, api_t, raw_t))
            rows.append((label, batch, length, d * 1e3, r * 1e3, a * 1e3, d / r, d / a))
        service.close("success").result()
    print(f"\nGET /api/v1/healthz on a keep-alive connection: median {rtt[0]:.2f} ms, p90 {rtt[1]:.2f} ms")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(
        "\n| step | batch x tokens | direct ms | raw HTTP ms | tinker SDK ms | efficiency raw HTTP | efficiency SDK |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, b, n, d, r, a, er, ea in rows:
        print(f"| {label} | {b} x {n} | {d:.1f} | {r:.1f} | {a:.1f} | {er:.3f} | {ea:.3f} |")


if __name__ == "__main__":
    main()
