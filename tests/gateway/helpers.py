from __future__ import annotations

import httpx
import numpy as np
import tinker
from tinker import types

MODEL = "openrl-lab/tiny-llama-1m"


def sft_batch(tokenizer, texts: list[str]) -> list[types.Datum]:
    data = []
    for text in texts:
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data


TEXTS = ["1+2=3", "10+5=15", "7+7=14", "abc cba", "hello olleh", "33+4=37"]


def raw_info(lab, model_id: str, key: str | None = None) -> dict:
    """get_info's whole answer: the SDK's GetInfoResponse drops the fields it does not know (trained, placement)."""
    r = httpx.post(
        f"{lab.base_url}/api/v1/get_info",
        json={"model_id": model_id, "type": "get_info"},
        headers={"X-API-Key": key or lab.api_key},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()


def served_models(lab) -> dict[str, dict]:
    """get_server_capabilities' whole entry of each model, by name (the SDK's type drops the lab's own fields:
    family, architecture, validated, ...). The first answer loads the model cards on a kernel: minutes at most."""
    r = httpx.get(f"{lab.base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": lab.api_key}, timeout=180)
    r.raise_for_status()
    return {m["model_name"]: m for m in r.json()["supported_models"]}


def logprobs_of(result) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].tolist(), dtype=np.float32) for o in result.loss_fn_outputs]


def new_trainer(service: tinker.ServiceClient, rank: int = 8, seed: int = 0):
    return service.create_lora_training_client(base_model=MODEL, rank=rank, seed=seed).result()
