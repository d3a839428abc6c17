"""Fixtures for the training layer: every file it writes goes under pytest's tmp dirs."""

from __future__ import annotations

import numpy as np
import pytest

TINY = "openrl-lab/tiny-llama-1m"


@pytest.fixture(scope="session", autouse=True)
def lab_home(tmp_path_factory):
    """OPENRL_LAB_HOME and the Hugging Face cache in tmp, and no hub traffic, for the whole session."""
    home = tmp_path_factory.mktemp("openrl-lab-home")
    hf_home = tmp_path_factory.mktemp("hf-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENRL_LAB_HOME", str(home))
    mp.setenv("HF_HOME", str(hf_home))
    mp.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these once at import; tests may run after something imported it.
    from huggingface_hub import constants

    mp.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    yield home
    mp.undo()


@pytest.fixture(scope="session")
def tiny_dir(lab_home):
    from openrl_lab.train.models import resolve_model_dir

    return resolve_model_dir(TINY)


@pytest.fixture
def host(tiny_dir):
    from openrl_lab.train.trainer import BaseModelHost

    return BaseModelHost(tiny_dir)


@pytest.fixture
def sft_data(host):
    """Two fixed supervised examples (different lengths), shifted into (tokens, target_tokens)."""
    from openrl_lab.train.trainer import Datum

    data = []
    for text in ["what is 12 + 7? the answer is 19.", "3*4=12"]:
        ids = np.array(host.tokenizer.encode(text), dtype=np.int64)
        data.append(Datum(tokens=ids[:-1], inputs={"target_tokens": ids[1:]}))
    return data
