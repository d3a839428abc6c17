"""`openrl-lab kernel join --devices N`: N kernels on one host, one per device (what a multi-device kernel Pod runs).

The splitting of the arguments (devices, names, groups, homes, ports, cores) is checked without processes; then a
real control plane with no kernel of its own, one `kernel join --devices 2 --device cpu --group pod` process whose
two kernels join as pod-0 (group pod) and pod-1 (group pod-1), a run on two devices through the tinker SDK placed
on both, and the kernels of that host ending together, with no process left behind."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from tinker import types

from openrl_lab.kernel.process import DeviceKernel, device_kernel_argv, device_kernels
from openrl_lab.server import LabServer
from tests.cluster.helpers import joined, kernels, sdk, start_join, wait_for
from tests.gateway.helpers import MODEL, TEXTS, raw_info, sft_batch
from tests.processes import live_children

HOME = Path("/h")


def test_each_device_gets_its_kernel_named_grouped_homed_and_addressed_by_its_index():
    ks = device_kernels(3, "cuda", "node", "trainer", HOME, "0.0.0.0", 7070, None)
    assert ks == [
        DeviceKernel(0, "cuda:0", "node-0", "trainer", HOME / "device-0", "0.0.0.0:7070", None),
        DeviceKernel(1, "cuda:1", "node-1", "trainer-1", HOME / "device-1", "0.0.0.0:7071", None),
        DeviceKernel(2, "cuda:2", "node-2", "trainer-2", HOME / "device-2", "0.0.0.0:7072", None),
    ]
    # from cuda:k the devices count on from k; cpu stays cpu; port 0 (any free one) stays 0; IPv6 in brackets
    assert [k.device for k in device_kernels(2, "cuda:2", "n", "g", HOME, "::1", 0, None)] == ["cuda:2", "cuda:3"]
    cpu = device_kernels(2, "cpu", "n", "g", HOME, "::1", 0, None)
    assert [(k.device, k.listen) for k in cpu] == [("cpu", "[::1]:0"), ("cpu", "[::1]:0")]


def test_the_default_name_is_the_hosts_and_devices_with_the_index():
    import socket

    host = socket.gethostname().split(".")[0]
    ks = device_kernels(2, "cuda", None, "default", HOME, "127.0.0.1", 0, None)
    assert [k.name for k in ks] == [f"{host}-cuda-0", f"{host}-cuda-1"]
    assert [k.group for k in ks] == ["default", "default-1"]


def test_cores_are_shared_out_contiguously_and_as_evenly_as_can_be():
    ks = device_kernels(3, "cpu", "n", "g", HOME, "127.0.0.1", 0, "0,1,2,3,4,5,6")
    assert [k.cores for k in ks] == ["0,1,2", "3,4", "5,6"]
    assert [k.cores for k in device_kernels(2, "cpu", "n", "g", HOME, "127.0.0.1", 0, "4,9")] == ["4", "9"]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, "cpu", 7070, None), "from 1 to 64"),
        ((65, "cpu", 7070, None), "from 1 to 64"),
        ((2, "mps", 7070, None), "cpu or cuda devices, not mps"),
        ((3, "cpu", 65534, None), "go past 65535"),
        ((3, "cpu", 0, "0,1"), "2 cores cannot be shared by 3 kernels"),
        ((2, "cpu", 0, "0,x"), "not a comma-separated list"),
    ],
)
def test_what_cannot_be_split_is_refused_with_the_reason(args, message):
    n, device, port, cores = args
    with pytest.raises(ValueError, match=message):
        device_kernels(n, device, "n", "g", HOME, "127.0.0.1", port, cores)


def test_a_device_kernels_arguments_are_the_parents_with_its_own_and_no_token():
    args = argparse.Namespace(
        control_plane="cp:50051",
        token="orl-join-secret",
        token_file=None,
        advertise="10.0.0.5",
        tls_cert=Path("/tls/tls.crt"),
        tls_key=Path("/tls/tls.key"),
        ca=Path("/tls/ca.crt"),
        sampler="torch",
        sampler_fallback=False,
        sampler_models="",
    )
    (_, k1) = device_kernels(2, "cuda:0", "pod", "trainer", HOME, "0.0.0.0", 7070, "0,1,2,3")
    argv = device_kernel_argv(k1, args)
    assert "orl-join-secret" not in argv  # it goes in the kernel's environment, not where ps shows it
    opts = dict(zip(argv[::2], argv[1::2]))
    assert opts == {
        "--control-plane": "cp:50051",
        "--device": "cuda:1",
        "--group": "trainer-1",
        "--name": "pod-1",
        "--home": "/h/device-1",
        "--listen": "0.0.0.0:7071",
        "--advertise": "10.0.0.5",
        "--tls-cert": "/tls/tls.crt",
        "--tls-key": "/tls/tls.key",
        "--ca": "/tls/ca.crt",
        "--cores": "2,3",
        "--sampler": "torch",
        "--devices": "1",
    }
    with_file = argparse.Namespace(**{**vars(args), "token_file": Path("/t/token"), "sampler_fallback": True})
    argv = device_kernel_argv(k1, with_file)
    assert argv[argv.index("--token-file") + 1] == "/t/token" and "--sampler-fallback" in argv


@pytest.mark.server  # runs `openrl-lab kernel join --devices N` processes
@pytest.mark.parametrize("bad", ["0", "65", "two"])
def test_a_bad_device_count_is_one_line(tmp_path, bad):
    cmd = [sys.executable, "-m", "openrl_lab.cli", "kernel", "join", "--control-plane", "127.0.0.1:1"]
    out = subprocess.run(
        [*cmd, "--token", "t", "--devices", bad],
        capture_output=True,
        text=True,
        env={**os.environ, "OPENRL_LAB_HOME": str(tmp_path)},
        timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"openrl-lab kernel join: --devices {bad!r} is not a number of devices from 1 to 64"
    ]


def _token(lab) -> str:
    return subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "tokens", "create", "--kernel", "--home", str(lab.home)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _all_gone(procs: list[psutil.Process]) -> bool:
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return not any(alive(p) for p in procs)


@pytest.mark.server  # a control plane and a `kernel join --devices 2` process with its two kernels
@pytest.mark.timeout(240)
def test_two_device_kernels_join_train_a_gang_and_end_together(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    share = ("--cores", ",".join(map(str, cores))) if len(cores) == 2 else ()
    with LabServer(tmp_path / "cp", args=("--cpu-kernels", "0", "--checkpoint-store", str(tmp_path / "store"))) as lab:
        token_file = tmp_path / "token"
        token_file.write_text(_token(lab))
        log = tmp_path / "join.log"
        args = ("--devices", "2", "--group", "pod", "--name", "pod", *share)
        proc = start_join(lab.grpc_target, token_file, tmp_path / "kernel-home", *args, log=log)
        try:
            k0, k1 = joined(lab, "pod-0", proc, log), joined(lab, "pod-1", proc, log)
            assert (k0["group"], k1["group"]) == ("pod", "pod-1")
            assert k0["device"] == k1["device"] == "cpu" and k0["host"] == k1["host"]
            assert k0["address"] != k1["address"]
            # each kernel is a child of the join process, on its own home and share of the cores
            children = {cmd[cmd.index("--name") + 1]: c for c, cmd in live_children(proc.pid) if "--name" in cmd}
            assert sorted(children) == ["pod-0", "pod-1"]
            assert (tmp_path / "kernel-home" / "device-0").is_dir() and (tmp_path / "kernel-home" / "device-1").is_dir()
            if share:
                assert [children[f"pod-{i}"].cpu_affinity() for i in (0, 1)] == [[cores[0]], [cores[1]]]

            service = sdk(lab, lab.api_key)
            trainer = service.create_lora_training_client(
                base_model=MODEL, rank=8, seed=0, user_metadata={"openrl_devices": "2"}
            ).result()
            info = raw_info(lab, trainer.model_id)
            assert info["devices"] == 2
            ranks = info["placement"]["ranks"]
            assert sorted(r["kernel"] for r in ranks) == ["pod-0", "pod-1"], ranks
            assert len({r["host"] for r in ranks}) == 1
            batch = sft_batch(trainer.get_tokenizer(), TEXTS[:4])
            losses = []
            for _ in range(2):
                losses.append(trainer.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
                trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert losses[1] < losses[0], losses

            # one device kernel dies: the join process stops the other (and its gang's rank worker) and exits non-zero
            tree = _tree(proc)
            assert len(tree) >= 4, tree  # two kernels and a rank worker each
            children["pod-1"].send_signal(signal.SIGKILL)
            assert proc.wait(60) != 0
            wait_for(lambda: _all_gone(tree), 30, "every process of the join to end")
            assert "kernel pod-1 exited with status -9: stopping the others" in log.read_text()

            # the join process itself killed (SIGKILL: no chance to pass anything on): its kernels go too
            proc = start_join(lab.grpc_target, token_file, tmp_path / "kernel-home", *args, log=log)
            wait_for(
                lambda: (
                    {n: k["state"] for n, k in kernels(lab).items() if n.startswith("pod-")}
                    == {"pod-0": "up", "pod-1": "up"}
                    and len(_tree(proc)) >= 2
                ),
                120,
                "the kernels to join again",
            )
            tree = _tree(proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(lambda: _all_gone(tree), 30, "the kernels of a killed join process to end")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
