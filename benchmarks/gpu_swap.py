"""Swap on one GPU: pinned host<->device bandwidth, evict/restore efficiency, tenant-switch time.

    python3 benchmarks/gpu_swap.py             # one H200: well under 5 minutes
    python3 benchmarks/gpu_swap.py --smoke     # small sizes; runs on a CPU too (checks the script)

Cases, each packed (one device buffer per set, the default) and per-tensor:
  (a) a 7B-shaped LoRA tenant: rank 16 on q,k,v,o,gate,up,down of 32 layers (hidden 4096, intermediate
      11008), bf16 adapters + fp32 Adam moments = 1,344 tensors, ~381 MiB;
  (b) a ~7 GB set of bf16 tensors shaped like a model (16 Llama-7B layers, embeddings, head).
efficiency = plain copy time / swap time, where the plain copy moves the same number of bytes as ONE buffer
between device memory and pinned host memory, on a side stream, in the same run (median of rounds).
Tenant switch: two (a) tenants; `switch(A, B)` evicts A and restores B at once (D2H and H2D on separate copy
engines); p50 over rounds, against the goal of 10 ms and the time of the two plain copies run together.
Every swapped state is checked bit for bit after the timed rounds, and the freed device memory is read from
torch.cuda.memory_allocated().

Writes gpu_swap.json and gpu_swap.md into $OUT if set, else ./gpu_swap_results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import torch
from torch import nn

from openrl_lab.swap import HostArena, SwapSet, switch

PROJ = {
    "q_proj": ("h", "h"),
    "k_proj": ("h", "h"),
    "v_proj": ("h", "h"),
    "o_proj": ("h", "h"),
    "gate_proj": ("h", "i"),
    "up_proj": ("h", "i"),
    "down_proj": ("i", "h"),
}  # (in, out)
FULL = {
    "hidden": 4096,
    "inter": 11008,
    "layers": 32,
    "rank": 16,
    "big_layers": 16,
    "vocab": 32000,
    "rounds": 10,
    "switch_rounds": 100,
}
SMOKE = {
    "hidden": 256,
    "inter": 688,
    "layers": 4,
    "rank": 16,
    "big_layers": 2,
    "vocab": 4000,
    "rounds": 3,
    "switch_rounds": 20,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


class PlainCopy:
    """The reference: one buffer of the same size, copied like the swap copies (side stream, non_blocking)."""

    def __init__(self, device: torch.device, nbytes: int, host: torch.Tensor):
        self.device = device
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = host[:nbytes]
        cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(2)] if cuda else None

    def _copy(self, pairs) -> None:
        if self.streams is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        for s, (dst, src) in zip(self.streams, pairs):
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
        for s in self.streams[: len(pairs)]:
            s.synchronize()

    def out(self) -> float:
        return timed(self.device, lambda: self._copy([(self.host, self.dev)]))

    def into(self) -> float:
        return timed(self.device, lambda: self._copy([(self.dev, self.host)]))

    def both(self, other_host: torch.Tensor) -> float:
        """D2H of this buffer and H2D into a second one, at the same time (what a switch does)."""
        pairs = [(self.host, self.dev), (torch.empty_like(self.dev), other_host[: self.dev.numel()])]
        return timed(self.device, lambda: self._copy(pairs))


def lora_tenants(cfg: dict, device: torch.device, names=("t0", "t1")) -> tuple[nn.Module, dict]:
    """A model-shaped tree of LoRA adapters (names like peft's: layers.3.q_proj.lora_A.t0) for several tenants,
    each with an AdamW whose fp32 moments are filled in (as after a step); the frozen base is not needed."""
    dims = {"h": cfg["hidden"], "i": cfg["inter"]}
    r = cfg["rank"]
    g = torch.Generator(device=device).manual_seed(0)
    root = nn.Module()
    root.layers = nn.ModuleList()
    for _ in range(cfg["layers"]):
        layer = nn.ModuleDict()
        for proj, (fan_in, fan_out) in PROJ.items():
            m = nn.Module()
            m.lora_A = nn.ParameterDict(
                {
                    t: nn.Parameter(torch.randn(r, dims[fan_in], generator=g, device=device, dtype=torch.bfloat16))
                    for t in names
                }
            )
            m.lora_B = nn.ParameterDict(
                {
                    t: nn.Parameter(torch.randn(dims[fan_out], r, generator=g, device=device, dtype=torch.bfloat16))
                    for t in names
                }
            )
            layer[proj] = m
        root.layers.append(layer)
    opts = {}
    for t in names:
        params = [p for n, p in root.named_parameters() if n.endswith(f".{t}")]
        opt = torch.optim.AdamW(params)
        for p in params:  # fp32 moments next to bf16 adapters; the step counter stays on the CPU, as in torch
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn(p.shape, generator=g, device=device, dtype=torch.float32),
                "exp_avg_sq": torch.rand(p.shape, generator=g, device=device, dtype=torch.float32),
            }
        opts[t] = opt
    return root, opts


def tenant_set(root, opts, t: str, device, packed: bool, arena=None) -> SwapSet:
    ss = SwapSet(f"lora-{t}-{'packed' if packed else 'per-tensor'}", device, packed=packed, arena=arena)
    ss.add_module(root, lambda n: n.endswith(f".{t}"))
    ss.add_optimizer(opts[t])
    return ss


def model_shaped(cfg: dict, device: torch.device) -> nn.Module:
    h, i, v = cfg["hidden"], cfg["inter"], cfg["vocab"]
    shapes = {"embed_tokens": (v, h), "norm": (h,), "lm_head": (v, h)}
    for n in range(cfg["big_layers"]):
        for proj, (fan_in, fan_out) in PROJ.items():
            shapes[f"layers_{n}_{proj}"] = ({"h": h, "i": i}[fan_out], {"h": h, "i": i}[fan_in])
        shapes[f"layers_{n}_input_norm"] = (h,)
        shapes[f"layers_{n}_post_norm"] = (h,)
    m = nn.Module()
    m.weights = nn.ParameterDict(
        {k: nn.Parameter(torch.empty(s, device=device, dtype=torch.bfloat16).normal_()) for k, s in shapes.items()}
    )
    return m


def snapshot(ss: SwapSet) -> dict:
    return {k: t.detach().clone() for k, t in ss.named_tensors().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def measure(ss: SwapSet, device, rounds: int, plain: PlainCopy) -> dict:
    for _ in range(2):  # warm: packs the set (packed mode), touches the arena
        ss.evict()
        ss.restore()
    before = snapshot(ss)
    rows = {k: [] for k in ("plain_out", "evict", "plain_in", "restore")}
    freed = []
    stats = {}
    for _ in range(rounds):
        rows["plain_out"].append(plain.out())
        sync(device)
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        e = ss.evict()
        rows["evict"].append(time.perf_counter() - t0)
        if device.type == "cuda":
            freed.append(allocated - torch.cuda.memory_allocated(device))
        rows["plain_in"].append(plain.into())
        t0 = time.perf_counter()
        r = ss.restore()
        rows["restore"].append(time.perf_counter() - t0)
        stats = {
            "bytes": e.bytes_moved,
            "tensors": e.tensors,
            "copies_out": e.copies,
            "copies_in": r.copies,
            "retained_bytes": e.retained_bytes,
        }
    med = statistics.median
    n = stats["bytes"]
    return {
        **stats,
        "plain_out_gbps": n / med(rows["plain_out"]) / 1e9,
        "plain_in_gbps": n / med(rows["plain_in"]) / 1e9,
        "evict_ms": med(rows["evict"]) * 1e3,
        "restore_ms": med(rows["restore"]) * 1e3,
        "evict_gbps": n / med(rows["evict"]) / 1e9,
        "restore_gbps": n / med(rows["restore"]) / 1e9,
        "evict_eff": med(p / s for p, s in zip(rows["plain_out"], rows["evict"])),
        "restore_eff": med(p / s for p, s in zip(rows["plain_in"], rows["restore"])),
        "freed_bytes_min": min(freed) if freed else None,
        "bit_exact": same(before, snapshot(ss)),
    }


def run(cfg: dict, device: torch.device, log) -> dict:
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": cfg,
        "cases": [],
        "switch": [],
    }
    t_start = time.perf_counter()

    # (a) LoRA tenants
    root, opts = lora_tenants(cfg, device)
    probe = tenant_set(root, opts, "t0", device, True)
    n_lora = probe.nbytes
    log(
        f"LoRA tenant: {len(probe.named_tensors())} tensors, {n_lora / 2**20:.1f} MiB "
        f"(built in {time.perf_counter() - t_start:.1f} s)"
    )
    probe.close()
    arena = HostArena(pin=device.type == "cuda", capacity=n_lora + (1 << 20))
    plain = PlainCopy(device, n_lora, arena.buffer)
    for packed in (False, True):
        ss = tenant_set(root, opts, "t0", device, packed, arena)
        res = measure(ss, device, cfg["rounds"] * 3, plain)
        out["cases"].append(
            {"case": "(a) 7B-shaped LoRA tenant r16", "mode": "packed" if packed else "per-tensor", **res}
        )
        log(
            f"(a) {out['cases'][-1]['mode']}: evict {res['evict_ms']:.2f} ms ({res['evict_eff']:.2f}), "
            f"restore {res['restore_ms']:.2f} ms ({res['restore_eff']:.2f}), bit-exact {res['bit_exact']}"
        )
        ss.close()

    # tenant switch: t0 <-> t1, each packed, each with its own arena
    for overlap in (True, False):
        sets = {t: tenant_set(root, opts, t, device, True) for t in ("t0", "t1")}
        before = {t: snapshot(s) for t, s in sets.items()}
        for s in sets.values():
            s.reserve()
            s.evict()
            s.restore()
        a, b = sets["t0"], sets["t1"]
        b.evict()
        times = []
        for i in range(cfg["switch_rounds"] + 3):
            if overlap:
                t = timed(device, lambda a=a, b=b: switch(a, b))
            else:
                t = timed(device, lambda a=a, b=b: (a.evict(), b.restore()))
            if i >= 3:
                times.append(t)
            a, b = b, a
        b.restore()
        times.sort()
        two = PlainCopy(device, n_lora, sets["t0"].arena.buffer)
        both = statistics.median(two.both(sets["t1"].arena.buffer) for _ in range(cfg["rounds"]))
        del two
        row = {
            "mode": "switch(A, B): D2H and H2D together" if overlap else "A.evict() then B.restore()",
            "bytes_each_way": n_lora,
            "p50_ms": times[len(times) // 2] * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            "plain_both_ms": both * 1e3,
            "bit_exact": all(same(before[t], snapshot(s)) for t, s in sets.items()),
        }
        out["switch"].append(row)
        log(
            f"switch {row['mode']}: p50 {row['p50_ms']:.2f} ms, p90 {row['p90_ms']:.2f} ms, "
            f"plain copies together {row['plain_both_ms']:.2f} ms"
        )
        for s in sets.values():
            s.close()
    del root, opts, plain
    arena.release()

    # (b) model-shaped set
    big = model_shaped(cfg, device)
    arena = HostArena(pin=device.type == "cuda")
    probe = SwapSet("probe", device)
    probe.add_module(big)
    n_big = probe.nbytes
    probe.close()
    arena.reserve(n_big + (1 << 20))  # + alignment padding
    log(
        f"model-shaped set: {len(list(big.parameters()))} tensors, {n_big / 1e9:.2f} GB "
        f"(t = {time.perf_counter() - t_start:.0f} s)"
    )
    plain = PlainCopy(device, n_big, arena.buffer)
    for packed in (False, True):
        ss = SwapSet(f"big-{'packed' if packed else 'per-tensor'}", device, packed=packed, arena=arena)
        ss.add_module(big)
        res = measure(ss, device, cfg["rounds"], plain)
        out["cases"].append({"case": "(b) model-shaped bf16 set", "mode": "packed" if packed else "per-tensor", **res})
        log(
            f"(b) {out['cases'][-1]['mode']}: evict {res['evict_ms']:.1f} ms ({res['evict_eff']:.2f}), "
            f"restore {res['restore_ms']:.1f} ms ({res['restore_eff']:.2f}), bit-exact {res['bit_exact']}"
        )
        ss.close()
    out["seconds"] = time.perf_counter() - t_start
    return out


def markdown(res: dict) -> str:
    lines = [
        f"Device: {res['device']}, torch {res['torch']}, {res['seconds']:.0f} s in all.",
        "",
        (
            "| case | mode | MB | tensors | copies out/in | plain out/in GB/s | evict ms | evict GB/s | evict eff "
            "| restore ms | restore GB/s | restore eff | freed MB | bit-exact |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        freed = "-" if c["freed_bytes_min"] is None else f"{c['freed_bytes_min'] / 1e6:.1f}"
        lines.append(
            f"| {c['case']} | {c['mode']} | {c['bytes'] / 1e6:.1f} | {c['tensors']} | "
            f"{c['copies_out']}/{c['copies_in']} | {c['plain_out_gbps']:.1f}/{c['plain_in_gbps']:.1f} | "
            f"{c['evict_ms']:.2f} | {c['evict_gbps']:.1f} | {c['evict_eff']:.2f} | {c['restore_ms']:.2f} | "
            f"{c['restore_gbps']:.1f} | {c['restore_eff']:.2f} | {freed} | {c['bit_exact']} |"
        )
    lines += [
        "",
        (
            "| tenant switch, two 7B-shaped LoRA tenants | MB each way | p50 ms | p90 ms | "
            "plain D2H+H2D together ms | bit-exact |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for s in res["switch"]:
        lines.append(
            f"| {s['mode']} | {s['bytes_each_way'] / 1e6:.1f} | {s['p50_ms']:.2f} | {s['p90_ms']:.2f} | "
            f"{s['plain_both_ms']:.2f} | {s['bit_exact']} |"
        )
    return "\n".join(lines) + "\n"


def last_line(res: dict, text: str) -> dict:
    """The key figures as one JSON object: packed-mode GB/s and efficiency per case, the overlapped switch's p50."""
    summary = {}
    for c in res["cases"]:
        if c["mode"] == "packed":
            tag = c["case"][:3]
            summary[f"{tag} evict GB/s"] = round(c["evict_gbps"], 1)
            summary[f"{tag} restore GB/s"] = round(c["restore_gbps"], 1)
            summary[f"{tag} eff out/in"] = f"{c['evict_eff']:.2f}/{c['restore_eff']:.2f}"
    for s in res["switch"][:1]:
        summary["switch p50 ms"] = round(s["p50_ms"], 2)
    exact = all(c["bit_exact"] for c in res["cases"] + res["switch"])
    summary["bit-exact"] = exact
    return {"benchmark": "gpu_swap", "ok": exact, "summary": summary, "markdown": text, "result": res}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes (also runs on a CPU)")
    parser.add_argument("--device", help="default: cuda if there is one, else cpu")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" and not args.smoke:
        parser.error("without a GPU only --smoke runs")
    cfg = SMOKE if args.smoke else FULL
    out_dir = Path(os.environ.get("OUT") or "gpu_swap_results")
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    res = run(cfg, device, log)
    text = markdown(res)
    (out_dir / "gpu_swap.json").write_text(json.dumps(res, indent=1))
    (out_dir / "gpu_swap.md").write_text(text)
    print()
    print(text)
    print(f"written to {out_dir}/gpu_swap.json and gpu_swap.md")
    print(json.dumps(last_line(res, text)))  # the machine-readable last line (benchmarks/gpu_check.py reads it)
    if not all(c["bit_exact"] for c in res["cases"] + res["switch"]):
        sys.exit("not bit-exact after the timed rounds")


if __name__ == "__main__":
    main()
