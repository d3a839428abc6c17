"""Your own model code as a time-sliced job (issue 15): what a phase costs when nobody waits, and what an eviction
and a restore of registered state cost against a plain copy of the same bytes.

    .venv/bin/python benchmarks/resident_phase.py [--mb 200] [--rounds 7] [--phases 300] \\
        [--device cpu|cuda] [--no-cells]

A real orchestrator (gRPC + its loopback hand-off lane) runs in this process; the job is a `ResidentState`.
1. Per-phase overhead with nobody waiting (lazy yield: nothing moves): `with state.phase(): pass`, against the
   bare client's `on_accelerators` (the orchestrator's floor); and per cell in a real IPython shell with
   autophase on (the cell names a registered variable), against the same cell with autophase off. Goal <= 2 ms.
2. Eviction and restore of a registered ~`--mb` MB state (an MLP's fp32 parameters plus AdamW's two moments),
   through the hooks the orchestrator calls, against a plain copy of the same bytes measured in alternating
   rounds (median of per-round ratios; the machine is shared and noisy):
   cpu:  plain copy = `torch.clone` of one tensor of that many bytes (it allocates, as a restore does);
   cuda: plain copy = a copy of that many bytes between the device and a pinned host buffer, each direction
         (the link's measured bandwidth); goal >= 0.9 of it. Not run on the project's CPU machines.
Prints a plain-text table, then one line of JSON with the key figures (benchmarks/gpu_check.py reads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from openrl_lab.lab.resident import ResidentState
from openrl_lab.orchestrator import TimeSliceOrchestratorClient, serve_orchestrator

KEYS = {"key-bench": "bench"}


def model_of(mb: float, device: str):
    """An MLP whose parameters plus AdamW's exp_avg and exp_avg_sq are ~`mb` MB (parameters a third of it)."""
    width = 1024
    layers = max(1, round(mb * 1e6 / 3 / 4 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are dropped between phases here: state = params + moments
    return model, opt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def phase_overhead(client, state, n: int) -> dict:
    def per(fn):
        for _ in range(20):
            fn()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e3, sorted(out)[int(0.9 * len(out))] * 1e3

    def bare():
        with client.on_accelerators("trainer-group", kind="bare", lease="bare"):
            pass

    def resident():
        with state.phase():
            pass

    return {"bare client phase": per(bare), "ResidentState.phase()": per(resident)}


def cell_overhead(state, n: int) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    from openrl_lab.lab.cells import CellHooks

    shell = InteractiveShell.instance()
    shell.user_ns["model"] = state.objects["model"]
    hooks = CellHooks(shell, state)
    hooks.install()
    cell = "y = model is None"  # names the registered model: a phase with autophase on

    def per(on: bool):
        hooks.autophase = on
        for _ in range(20):
            shell.run_cell(cell, store_history=False)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            shell.run_cell(cell, store_history=False)
            out.append(time.perf_counter() - t0)
        return statistics.median(out) * 1e3

    off, on = per(False), per(True)
    hooks.uninstall()
    return {"cell, autophase off": off, "cell, autophase on": on, "per-cell phase overhead": on - off}


def swap_vs_copy(state, device: str, rounds: int) -> dict:
    nbytes = state.nbytes
    if device.startswith("cuda"):  # the link: device <-> pinned host, each direction
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        plain_out = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
        plain_in = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        plain_out = plain_in = src.clone
    for _ in range(2):  # warm: arena allocated, state packed
        state._on_evict()
        state._on_restore()
    rows = {k: [] for k in ("plain_out", "evict", "plain_in", "restore")}
    for _ in range(rounds):
        rows["plain_out"].append(timed(plain_out, device))
        rows["evict"].append(timed(state._on_evict, device))
        rows["plain_in"].append(timed(plain_in, device))
        rows["restore"].append(timed(state._on_restore, device))
    med = statistics.median
    return {
        "bytes": nbytes,
        "plain_gbps": nbytes / med(rows["plain_out"] + rows["plain_in"]) / 1e9,
        "evict_ms": med(rows["evict"]) * 1e3,
        "restore_ms": med(rows["restore"]) * 1e3,
        "evict_share": med(p / s for p, s in zip(rows["plain_out"], rows["evict"])),
        "restore_share": med(p / s for p, s in zip(rows["plain_in"], rows["restore"])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="registered state size in MB (default 200)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--phases", type=int, default=300)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (the pinned-arena path)")
    ap.add_argument("--no-cells", action="store_true", help="skip the per-cell part (it needs IPython)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    torch.set_num_threads(1)  # two shared cores: a multi-threaded copy waits for a busy core (benchmarks/swap_cpu.py)
    with tempfile.TemporaryDirectory() as tmp:
        server = serve_orchestrator(
            Path(tmp) / "o.db",
            port=0,
            authenticate=KEYS.get,
            config={"groups": [{"id": "trainer-group", "devices": [args.device]}]},
        )
        client = TimeSliceOrchestratorClient(server.target, api_key="key-bench", job="bench")
        try:
            model, opt = model_of(args.mb, args.device)
            state = ResidentState(client, "trainer-group", "bench", announce=None)
            state.register(model, opt, names=["model", "optimizer"])
            phases = phase_overhead(client, state, args.phases)
            cells = {} if args.no_cells else cell_overhead(state, args.phases)
            assert not state.evictions, "nobody waited: nothing may have moved"
            swap = swap_vs_copy(state, args.device, args.rounds)
        finally:
            client.close()
            server.stop(grace=0)
    print(f"resident phase benchmark: device {args.device}, torch {torch.__version__}, 1 thread")
    print()
    print(f"{'per phase, nobody waiting':32s} {'median ms':>10s} {'p90 ms':>8s}")
    for name, (m, p90) in phases.items():
        print(f"{name:32s} {m:10.3f} {p90:8.3f}")
    for name, m in cells.items():
        print(f"{name:32s} {m:10.3f}")
    if cells:
        print(
            f"{'goal: per-cell phase overhead':32s} {'<= 2 ms':>10s}  "
            f"{'met' if cells['per-cell phase overhead'] <= 2.0 else 'NOT met'}"
        )
    else:
        print("(per-cell overhead not measured: --no-cells)")
    print()
    goal = 0.9 if args.device.startswith("cuda") else None
    plain = "pinned copy" if goal else "torch clone"
    print(
        f"registered state: {swap['bytes'] / 1e6:.0f} MB (MLP parameters + AdamW moments); plain copy "
        f"({plain}) {swap['plain_gbps']:.2f} GB/s"
    )
    print(f"{'':10s} {'ms':>8s} {'GB/s':>7s} {'share of plain copy':>20s}")
    for d in ("evict", "restore"):
        ms = swap[f"{d}_ms"]
        print(
            f"{d:10s} {ms:8.1f} {swap['bytes'] / ms / 1e6:7.2f} {swap[f'{d}_share']:20.2f}"
            + (f"   goal >= {goal}: {'met' if swap[f'{d}_share'] >= goal else 'NOT met'}" if goal else "")
        )
    summary = {
        "phase ms": round(phases["ResidentState.phase()"][0], 3),
        "cell overhead ms": round(cells["per-cell phase overhead"], 3) if cells else "not measured",
        "MB": round(swap["bytes"] / 1e6),
        "plain GB/s": round(swap["plain_gbps"], 2),
        "evict GB/s": round(swap["bytes"] / swap["evict_ms"] / 1e6, 2),
        "restore GB/s": round(swap["bytes"] / swap["restore_ms"] / 1e6, 2),
        "share out/in": f"{swap['evict_share']:.2f}/{swap['restore_share']:.2f}",
    }
    if goal:
        summary["goal >= 0.9"] = "met" if min(swap["evict_share"], swap["restore_share"]) >= goal else "NOT met"
    # the machine-readable last line (benchmarks/gpu_check.py reads it)
    line = {"benchmark": "resident_phase", "device": args.device, "ok": True, "summary": summary}
    print(json.dumps(line | {"phases": phases, "cells": cells, "swap": swap}))


if __name__ == "__main__":
    main()
