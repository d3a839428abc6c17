"""Helpers for the fleet tests: the fleet's view over HTTP, a joined kernel as a real process, the kernels' pids."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types

from tests.gateway.helpers import MODEL, raw_info
from tests.processes import lab_kernels


def kernels(lab) -> dict[str, dict]:
    r = httpx.get(f"{lab.base_url}/api/v1/lab/kernels", headers={"X-API-Key": lab.api_key}, timeout=30)
    r.raise_for_status()
    return {k["name"]: k for k in r.json()["kernels"]}


def lost_within_s(lab) -> float:
    """How soon the lab must declare a killed kernel lost: the fleet's own rule (silent for
    $OPENRL_KERNEL_LOST_AFTER_S, checked every PING_EVERY_S, a ping waiting PING_TIMEOUT_S), plus a margin
    from this machine's speed now: 20 times a status round trip measured here, at least 3 s. A loaded machine
    widens the margin instead of failing the test; a fleet that never declares the kernel lost still fails it."""
    from openrl_lab.cluster import fleet
    from openrl_lab.settings import Settings

    t0 = time.monotonic()
    kernels(lab)
    kernels(lab)
    round_trip = (time.monotonic() - t0) / 2
    env = {**os.environ, **getattr(lab, "env", {})}  # what the lab's process reads
    default = Settings.model_fields["kernel_lost_after_s"].default
    lost_after = float(env.get("OPENRL_KERNEL_LOST_AFTER_S") or default)
    return lost_after + fleet.PING_EVERY_S + fleet.PING_TIMEOUT_S + 1 + max(3.0, 20 * round_trip)


def wait_for(predicate, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def joined(lab, name: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> dict:
    """The fleet's view of kernel `name` once it is up; fails at once, with its log, if the process exits."""

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"kernel join exited with {proc.returncode}: {log.read_text()[-2000:]}")
        k = kernels(lab).get(name)
        return k if k and k["state"] == "up" else None

    return wait_for(up, timeout, f"kernel {name} to join")


def placement(lab, key: str, model_id: str) -> dict:
    return raw_info(lab, model_id, key)["placement"]


def kernel_pid(lab, group: str) -> int:
    """The pid of the control plane's child kernel of `group`."""
    found = lab_kernels(lab, group)
    assert found, f"no kernel process of group {group}"
    return found[0].pid


def start_join(control_plane: str, token_file: Path, home: Path, *extra: str, log: Path) -> subprocess.Popen:
    """`openrl-lab kernel join` as its own process, with its own home (it never sees the control plane's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_"))}
    env["OPENRL_LAB_HOME"] = str(home)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "openrl_lab.cli",
                "kernel",
                "join",
                "--control-plane",
                control_plane,
                "--token-file",
                str(token_file),
                "--device",
                "cpu",
                "--home",
                str(home),
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def forward_logprobs(trainer, tokens: list[int]) -> np.ndarray:
    out = trainer.forward([datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def rl_steps(trainer, steps: int, seed: int = 0) -> list[float]:
    """A small RL loop on the four primitives: sample from the current weights, score, importance-sampling update."""
    tokenizer = trainer.get_tokenizer()
    prompt = tokenizer.encode("1+2=", add_special_tokens=False)
    rewards = []
    for step in range(steps):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        res = sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=4,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=seed + step),
        ).result()
        data, scores = [], []
        for seq in res.sequences:
            score = float(tokenizer.decode(seq.tokens).strip().startswith("3"))
            scores.append(score)
        mean = sum(scores) / len(scores)
        for seq, score in zip(res.sequences, scores):
            toks = prompt + list(seq.tokens)
            n = len(toks) - 1
            adv = [0.0] * (len(prompt) - 1) + [score - mean] * len(seq.tokens)
            lps = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "logprobs": lps[:n], "advantages": adv[:n]},
                )
            )
        trainer.forward_backward(data, "importance_sampling").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        rewards.append(mean)
    return rewards


def sdk(lab, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=lab.base_url, api_key=key)


def new_trainer(service: tinker.ServiceClient, group: str | None = None, seed: int = 0):
    metadata = {"openrl_group": group} if group else None
    return service.create_lora_training_client(base_model=MODEL, rank=8, seed=seed, user_metadata=metadata)
