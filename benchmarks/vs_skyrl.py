"""This lab against SkyRL's open-source Tinker server: the same SDK loop, the same tiny random Qwen3, interleaved.

    benchmarks/skyrl_env.sh /tmp/skyrl                                   # once
    .venv/bin/python benchmarks/vs_skyrl.py --skyrl-env /tmp/skyrl [--rounds 5] [--serve-args "--cpu-kernels 2"]

Both servers run at once on this machine: `openrl-lab serve` (no flags unless --serve-args) and SkyRL 0.3.0's
`skyrl.tinker.api` with its JAX backend on CPU, each serving the same model directory (a Qwen3 config: 2 layers,
GQA, tied embeddings; random weights; this project's built-in tokenizer). Each is driven by `tinker_loop.py`
from its own environment: this lab by this project's tinker SDK, SkyRL by tinker 0.24.1 (the newest it
accepts). After each side's warm-up (SkyRL compiles per shape: its first step takes seconds), rounds alternate
the sides; a round is 10 supervised LoRA steps (4 x 24 tokens) and one RL step's sampling (a sampler snapshot,
8 concurrent requests of 8 samples x 32 tokens). Figures are medians over rounds; ratios are this lab's speed
over SkyRL's (> 1: this lab is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.server import LabServer
from openrl_lab.train.models import resolve_model_dir

HERE = Path(__file__).resolve().parent
SKYRL_READY_S = 300.0  # its engine loads and compiles before the first call is served
SKYRL_KEY = "tml-benchmark"  # tinker 0.24.1 wants the tml- prefix; SkyRL checks no key


def build_model(out: Path, home: Path) -> int:
    """A tiny random Qwen3 in `out` with the built-in model's tokenizer; returns its vocabulary size."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL, home))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return len(tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SkyRL:
    """SkyRL's API server (it starts its engine), from the environment skyrl_env.sh made."""

    def __init__(self, env: Path, model: Path, work: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = work / "skyrl.log"
        environ = {
            **os.environ,
            "PATH": f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "JAX_PLATFORMS": "cpu",
            "HF_HUB_OFFLINE": "1",
            "SKYRL_DATABASE_URL": f"sqlite:///{work / 'skyrl.db'}",
        }
        command = [
            *("uv", "run", "python", "-m", "skyrl.tinker.api", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--base-model", str(model), "--backend", "jax", "--checkpoints-base", str(work / "ckpts")),
            *("--backend-config", json.dumps({"max_lora_adapters": 4, "max_lora_rank": 16})),
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self) -> None:
        end = time.monotonic() + SKYRL_READY_S
        while b"Starting background engine" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > end:
                sys.exit(f"SkyRL's server did not start; its log:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        httpx.get(f"{self.base_url}/api/v1/healthz", timeout=30).raise_for_status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


class Driver:
    """tinker_loop.py in a Python of its own, one round per request."""

    def __init__(self, python: str, base_url: str, api_key: str, model: str, vocab: int):
        command = [python, str(HERE / "tinker_loop.py"), "--base-url", base_url, "--api-key", api_key]
        command += ["--base-model", model, "--vocab", str(vocab)]
        # PYTHONSAFEPATH: another environment's python must not import this checkout from the working directory
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"}
        )
        self.ready = self._answer()

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the SDK loop ({self.proc.args[0]}) ended: see its output above")
        return json.loads(line)

    def round(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skyrl-env", type=Path, required=True, help="the directory skyrl_env.sh made")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve-args", default="", help="flags for this lab's `openrl-lab serve`")
    args = ap.parse_args()
    env = args.skyrl_env.resolve()
    work = Path(tempfile.mkdtemp(prefix="openrl-vs-skyrl-"))
    model = work / "tiny-qwen3"
    vocab = build_model(model, work / "home")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; model {model} (vocab {vocab})")
    skyrl = SkyRL(env, model, work)
    lab = LabServer(work / "home", args=tuple(shlex.split(args.serve_args)))
    drivers: dict[str, Driver] = {}
    try:
        lab.start()
        skyrl.wait_ready()
        drivers["lab"] = Driver(sys.executable, lab.base_url, lab.api_key, str(model), vocab)
        drivers["skyrl"] = Driver(str(env / "venv" / "bin" / "python"), skyrl.base_url, SKYRL_KEY, str(model), vocab)
        for name, d in drivers.items():
            print(f"{name}: tinker {d.ready['sdk']}, warm-up {d.ready['ready_s']:.1f} s")
        rounds: dict[str, list[dict]] = {name: [] for name in drivers}
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for name in list(drivers)[:: 1 if r % 2 == 0 else -1]:
                rounds[name].append(drivers[name].round())
    finally:
        for d in drivers.values():
            d.stop()
        lab.stop()
        skyrl.stop()
    m = {
        name: {
            "step_ms": statistics.median(x["step_s"] for x in rs) * 1e3,
            "tokens_per_s": statistics.median(x["sample_tokens"] / x["sample_s"] for x in rs),
        }
        for name, rs in rounds.items()
    }
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    print("| server | supervised step ms (4 x 24) | sampling tokens/s (8 x 8 x 32, snapshot included) |")
    print("|---|---|---|")
    for name, v in m.items():
        print(f"| {name} | {v['step_ms']:.1f} | {v['tokens_per_s']:,.0f} |")
    print(
        f"\nthis lab / SkyRL: step speed {m['skyrl']['step_ms'] / m['lab']['step_ms']:.2f}x, "
        f"sampling {m['lab']['tokens_per_s'] / m['skyrl']['tokens_per_s']:.2f}x ({args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
