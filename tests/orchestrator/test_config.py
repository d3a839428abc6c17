"""Groups from a config file or from this machine's devices; bad configs are refused with the reason."""

from __future__ import annotations

import re

import pytest

from openrl_lab.orchestrator.config import discover_devices, discover_groups, load_config
from openrl_lab.orchestrator.errors import InvalidArgument


def test_groups_default_to_the_devices_found_here(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert discover_devices() == ["cpu"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("OPENRL_LAB_ORCHESTRATOR_CONFIG", raising=False)
    (g,) = discover_groups()
    assert g.id == "default" and g.aliases == ("trainer-group", "sampler-group") and g.devices
    assert all(d == "cpu" or d.startswith("cuda:") for d in g.devices)
    assert load_config(None).groups == discover_groups()


def test_a_toml_config_names_groups_and_settings(tmp_path, monkeypatch):
    path = tmp_path / "orchestrator.toml"
    path.write_text(
        'holder_timeout_s = 3\n[[groups]]\nid = "trainer-group"\ndevices = ["cuda:0", "cuda:1"]\n'
        '[[groups]]\nid = "sampler-group"\ndevices = ["cuda:2"]\npolicy = "fifo"\n'
    )
    monkeypatch.setenv("OPENRL_LAB_ORCHESTRATOR_CONFIG", str(path))
    cfg = load_config()
    assert cfg.holder_timeout_s == 3 and cfg.heartbeat_interval_s == 0.75
    assert [(g.id, g.devices, g.policy) for g in cfg.groups] == [
        ("trainer-group", ("cuda:0", "cuda:1"), "weighted"),
        ("sampler-group", ("cuda:2",), "fifo"),
    ]


def test_a_group_chooses_its_sampler_and_its_kernels_interpreter(tmp_path):
    """For the launchers (the orchestrator ignores them): torch by default, vllm where the config says so."""
    path = tmp_path / "orchestrator.toml"
    path.write_text(
        '[[groups]]\nid = "trainer-group"\ndevices = ["cuda:0"]\n'
        '[[groups]]\nid = "sampler-group"\ndevices = ["cuda:1"]\nsampler = "vllm"\nsampler_fallback = true\n'
        'kernel_python = "/opt/openrl/.venv-vllm/bin/python"\nsampler_models = ["openrl-lab/tiny-llama-1m"]\n'
    )
    trainer, sampler = load_config(path).groups
    assert (trainer.sampler, trainer.sampler_fallback, trainer.kernel_python) == ("torch", False, None)
    assert (sampler.sampler, sampler.sampler_fallback, sampler.kernel_python) == (
        "vllm",
        True,
        "/opt/openrl/.venv-vllm/bin/python",
    )
    assert (trainer.sampler_models, sampler.sampler_models) == ((), ("openrl-lab/tiny-llama-1m",))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"groups": [{"id": "a", "devices": ["cuda:0"]}, {"id": "b", "devices": ["cuda:0"]}]}, "in two groups"),
        ({"groups": [{"id": "a", "devices": ["cuda:0"], "policy": "random"}]}, "unknown policy 'random'"),
        ({"groups": [{"id": "a", "devices": []}]}, "group 'a'.devices: must have at least 1"),
        ({"groups": [{"id": "a", "devices": ["x"]}, {"id": "b", "devices": ["y"], "aliases": ["a"]}]}, "used twice"),
        ({"groups": [{"devices": ["x"]}]}, "group 1.id: missing"),
        ({"holder_timeout_s": -1}, "holder_timeout_s"),
        ({"holder_timeout_s": 0}, "holder_timeout_s: must be > 0"),
        ({"holdr_timeout_s": 1}, "holdr_timeout_s: unknown key \\(known: default_ttl_s, "),
        (
            {"groups": [{"id": "s", "devices": ["cpu"], "sampler": "vllm-cpu"}]},
            "group 's'.sampler: unknown sampler 'vllm-cpu' \\(one of torch, vllm\\)",
        ),
        (
            {"groups": [{"id": "s", "devices": ["cpu"], "sampler_fallback": "yes"}]},
            "group 's'.sampler_fallback: must be true or false, got 'yes'",
        ),
        ({"groups": [{"id": "s", "devices": ["cpu"], "sampler_fallback": True}]}, "sampler_fallback goes with sampler"),
        ({"groups": [{"id": "s", "devices": ["cpu"], "sampler_models": ["m"]}]}, "sampler_models goes with sampler"),
        (
            {"groups": [{"id": "s", "devices": ["cpu"], "kernel_python": ""}]},
            "group 's'.kernel_python: must not be empty",
        ),
        (
            {"groups": [{"id": "s", "devices": ["cpu"], "sampelr": "vllm"}]},
            "group 's'.sampelr: unknown key \\(known: aliases, devices, .*sampler, ",
        ),
    ],
)
def test_bad_configs_are_refused(bad, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        load_config(bad)
    assert str(e.value).startswith("orchestrator config: ") and "\n" not in str(e.value)


def test_an_unreadable_config_file_names_itself(tmp_path):
    with pytest.raises(InvalidArgument, match=re.escape("missing.toml")):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(InvalidArgument, match=re.escape("broken.json")):
        load_config(broken)
