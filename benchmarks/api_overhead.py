"""API overhead: one supervised step through the tinker SDK over loopback vs the same step in-process.

    .venv/bin/python benchmarks/api_overhead.py [--steps 30] [--rounds 3]

It also reports the bare round trip of `GET /api/v1/healthz` on a keep-alive connection (what every request
pays before any work), which HTTP server implementation uvicorn picked, and the machine it ran on.

Both sides run the same LoRA job code on the same built-in model, batch and optimizer settings; the only
difference is the path (SDK -> HTTP -> gateway -> kernel process vs a direct call). A third column drives
the same HTTP requests from a minimal client, to tell the server's overhead from the SDK client's. Two sizes: a ~10 ms
step and a ~100 ms step (their names from the machine they were chosen on; the table gives the times here).

Pipelining (issue 27): the SDK columns run against two labs side by side, the default (a model's next call is
sent to its kernel while the previous one runs) and one with OPENRL_LAB_PIPELINE_DEPTH=1 (each call waits for
the previous one to finish), each both ways a loop can wait: for each step's results before the next step, and
with step k+1 submitted before step k's results are awaited ("queued").

The machine is shared and noisy, so every column is measured in each round, one after the other, and the
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
                got = self.http.post(
                    "/retrieve_future",
                    json={"request_id": r.json()["request_id"]},
                    headers={"Accept": "application/x-protobuf, application/json"},  # as the SDK asks
                )
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


def time_queued_steps(submit, n: int) -> float:
    """Steps as an RL or SL loop that keeps the server busy sends them: step k+1 is submitted before step k's
    results are awaited (the tinker docs' advice). `submit()` returns the step's futures."""
    for f in submit():
        f.result()  # warm-up
    t0 = time.perf_counter()
    previous: list = []
    for _ in range(n):
        current = submit()
        for f in previous:
            f.result()
        previous = current
    for f in previous:
        f.result()
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


COLUMNS = {
    "direct": "in-process job code",
    "raw": "raw HTTP, pipelined (default)",
    "sdk": "tinker SDK, pipelined (default)",
    "sdk_queued": "tinker SDK, next step queued, pipelined",
    "sdk_serial": "tinker SDK, OPENRL_LAB_PIPELINE_DEPTH=1",
    "sdk_queued_serial": "tinker SDK, next step queued, DEPTH=1",
}


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
    # Two labs side by side: the default, and one whose gateway waits for each call before sending the next
    # (no pipelining): the same code otherwise, measured in the same rounds.
    serial_home = Path(tempfile.mkdtemp(prefix="openrl-bench-serial-"))
    with LabServer(home) as lab, LabServer(serial_home, env={"OPENRL_LAB_PIPELINE_DEPTH": "1"}) as serial:
        rtt = healthz_round_trip_ms(lab.base_url)
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        serial_service = tinker.ServiceClient(base_url=serial.base_url, api_key=serial.api_key)
        rows = []
        for label, (batch, length) in SIZES.items():
            sdk_batch, direct_batch = make_batch(batch, length, vocab)
            job = host.create_job(f"bench-{batch}", LoraSettings(rank=16, seed=0))
            trainers = {
                name: svc.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result()
                for name, svc in (("lab", service), ("serial", serial_service))
            }

            def submit(trainer):
                return [trainer.forward_backward(sdk_batch, "cross_entropy"), trainer.optim_step(adam_sdk)]  # noqa: B023

            def direct_step():
                job.forward_backward(direct_batch, "cross_entropy")  # noqa: B023 - called within this iteration
                job.optim_step(adam)  # noqa: B023 - called within this iteration

            raw = RawHttpTrainer(
                lab.base_url,
                lab.api_key,
                service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result(),
            )
            runs = {
                "direct": lambda: time_steps(direct_step, args.steps),
                "raw": lambda: time_steps(lambda: raw.step(sdk_batch), args.steps),  # noqa: B023
                "sdk": lambda: time_steps(lambda: [f.result() for f in submit(trainers["lab"])], args.steps),  # noqa: B023
                "sdk_queued": lambda: time_queued_steps(lambda: submit(trainers["lab"]), args.steps),  # noqa: B023
                "sdk_serial": lambda: time_steps(lambda: [f.result() for f in submit(trainers["serial"])], args.steps),  # noqa: B023
                "sdk_queued_serial": lambda: time_queued_steps(lambda: submit(trainers["serial"]), args.steps),  # noqa: B023
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in tqdm(range(args.rounds), desc=label, unit="round"):
                for name, run in runs.items():
                    times[name].append(run())
            medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            rows.append((label, batch, length, medians))
        service.close("success").result()
        serial_service.close("success").result()
    print(f"\nGET /api/v1/healthz on a keep-alive connection: median {rtt[0]:.2f} ms, p90 {rtt[1]:.2f} ms")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print("\nms per step (median of rounds), and efficiency = direct / that (1.0 = no overhead):\n")
    print("| step | batch x tokens | " + " | ".join(COLUMNS.values()) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for label, b, n, m in rows:
        cells = [f"{m['direct']:.1f}"] + [f"{m[c]:.1f} ({m['direct'] / m[c]:.3f})" for c in list(COLUMNS)[1:]]
        print(f"| {label} | {b} x {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
