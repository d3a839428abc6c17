"""One run of the tinker SDK surface every supported SDK version shares, against a lab; run by
`test_sdk_versions.py` under each SDK version's own interpreter (`make sdk-envs`).

    python sdk_versions_driver.py --base-url URL --api-key KEY --base-model NAME

It imports only tinker (it runs where openrl_lab is not installed) and prints one JSON line: each step's name
with its figures, or the error that stopped it (every step runs even when an earlier one failed, where it can).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types

STEPS = 5


def resolved(value):
    """The value itself: since tinker 0.3x, create_* and save_weights_and_get_sampling_client answer futures."""
    return value.result() if callable(getattr(value, "result", None)) and not isinstance(value, type) else value


def datum(tokens: list[int], weights: list[float] | None = None, **extra: list[float]) -> types.Datum:
    n = len(tokens) - 1
    inputs = {
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": types.TensorData(data=weights or [1.0] * n, dtype="float32", shape=[n]),
    }
    for name, values in extra.items():
        inputs[name] = types.TensorData(data=values, dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--base-model", required=True)
    args = ap.parse_args()
    out: dict = {"sdk": tinker.__version__, "steps": {}, "errors": {}}
    ctx: dict = {}

    def step(name):
        def run(fn):
            try:
                out["steps"][name] = fn() or True
            except Exception as e:  # noqa: BLE001 - reported: the test names the step and the error
                out["errors"][name] = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:]
            return fn

        return run

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)

    @step("get_server_capabilities")
    def _():
        caps = service.get_server_capabilities()
        return {"models": sorted(m.model_name for m in caps.supported_models)}

    @step("create_lora_training_client")
    def _():
        ctx["trainer"] = resolved(service.create_lora_training_client(base_model=args.base_model, rank=4))
        return {"model_id": ctx["trainer"].model_id}

    trainer = ctx.get("trainer")
    if trainer is None:
        print(json.dumps(out), flush=True)
        os._exit(0)
    data = [datum([5, 9, 12, 7, 30, 41, 8, 3]), datum([6, 17, 22, 4, 9, 2])]

    @step("get_info")
    def _():
        info = trainer.get_info()
        return {"model_name": info.model_data.model_name, "lora_rank": info.lora_rank}

    @step("get_tokenizer")
    def _():
        tok = trainer.get_tokenizer()
        return {"round_trip": tok.decode(tok.encode("copy AB:", add_special_tokens=False))}

    @step("forward_backward+optim_step")
    def _():
        losses = []
        for _ in range(STEPS):
            fb = trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=2e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        return {"losses": losses}

    @step("forward")
    def _():
        res = trainer.forward(data, "cross_entropy").result()
        return {"logprobs": [o["logprobs"].tolist() for o in res.loss_fn_outputs], "loss": res.metrics["loss:sum"]}

    @step("forward_backward importance_sampling")
    def _():
        n = 7
        d = datum([5, 9, 12, 7, 30, 41, 8, 3], advantages=[1.0] * n, logprobs=[-1.0] * n)
        res = trainer.forward_backward([d], "importance_sampling").result()
        return {"loss": res.metrics["loss:sum"]}

    @step("save_state+load_state")
    def _():
        path = trainer.save_state("compat").result().path
        trainer.load_state(path).result()
        return {"path": path}

    @step("save_weights_and_get_sampling_client+sample")
    def _():
        sampler = resolved(trainer.save_weights_and_get_sampling_client(name="compat-sampler"))
        ctx["sampler"] = sampler
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
        prompt = types.ModelInput.from_ints([5, 9, 12])
        a = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        b = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        return {
            "tokens": [s.tokens for s in a.sequences],
            "again": [s.tokens for s in b.sequences],
            "logprobs": [s.logprobs for s in a.sequences],
        }

    @step("compute_logprobs")
    def _():
        seq = out["steps"]["save_weights_and_get_sampling_client+sample"]["tokens"][0]
        lp = ctx["sampler"].compute_logprobs(types.ModelInput.from_ints([5, 9, 12, *seq])).result()
        return {"logprobs": lp}

    @step("create_sampling_client(base_model)")
    def _():
        base = resolved(service.create_sampling_client(base_model=args.base_model))
        res = base.sample(
            types.ModelInput.from_ints([5, 9]), num_samples=2, sampling_params=types.SamplingParams(max_tokens=4)
        ).result()
        return {"lengths": [len(s.tokens) for s in res.sequences]}

    @step("rest list_user_checkpoints")
    def _():
        found = service.create_rest_client().list_user_checkpoints().result()
        return {"paths": sorted(c.tinker_path for c in found.checkpoints)}

    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the SDK's heartbeat threads would hold the exit


if __name__ == "__main__":
    main()
