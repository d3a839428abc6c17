"""Kernel Pods end to end, with the Pods run as local processes: no cluster, no containers.

A real control plane (`openrl-lab serve --kernel-launcher kubernetes`, TLS, no kernels of its own) creates its
kernel Pod through the API emulator (tests/cluster/kube_emulator.py); a test "kubelet" runs the Pod's own command
(`openrl-lab kernel join ...` with the Pod's arguments) as a process on a loopback address standing for the Pod
IP, the mounted Secrets and volumes rewritten to temporary files. The kernel joins over TLS with the join token
the control plane took from --join-token-file, serves a training step; killed, its Pod is marked Failed,
the control plane declares it lost at once (the job's error names its checkpoint), a new Pod is created and its
kernel rejoins under the same name. Not proved: images, mounts, networking, scheduling, DRA: a cluster's part.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tinker
from tinker import types

from openrl_lab.server import LabServer
from tests.cluster.certs import make_ca, make_leaf
from tests.cluster.helpers import datum, kernels, new_trainer, placement, sdk, wait_for
from tests.cluster.kube_emulator import EmulatorThread, FakeKubelet

pytestmark = pytest.mark.server  # starts a Kubernetes API emulator and kernel processes

NS = "lab"
POD = "openrl-lab-kernel-cpu-0"
TOKEN = "orl-join-" + "k8s-secret-token-for-the-test-0123456789"


class ProcessKubelet(FakeKubelet):
    """Starts each new Pod's command as a local process and reports its phase: Running once started, Failed
    with the exit code when the process dies; a deleted Pod's process is terminated."""

    def __init__(self, emu: EmulatorThread, root: Path, mounts: dict[str, str]):
        super().__init__(emu, NS)
        self.root, self.mounts = root, mounts
        self.procs: dict[str, tuple[str, subprocess.Popen, Path]] = {}  # pod -> (uid, process, log)
        self.started = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="process-kubelet")

    def __enter__(self) -> ProcessKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for _, proc, _ in self.procs.values():
            self._end(proc)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            pods = self.pods()
            for name, (uid, proc, _log) in list(self.procs.items()):
                pod = pods.get(name)
                if pod is None or pod["metadata"]["uid"] != uid:  # deleted: the node stops its containers
                    self._end(proc)
                    del self.procs[name]
                elif proc.poll() is not None and pod["status"]["phase"] == "Running":
                    code = proc.returncode
                    self.fail(name, exit_code=128 - code if code < 0 else code, reason="Error")
            for name, pod in pods.items():
                if pod["status"].get("phase") == "Pending" and name not in self.procs:
                    self.started += 1
                    ip = f"127.0.0.{10 + self.started}"
                    log = self.root / f"{name}-{self.started}.log"
                    self.procs[name] = (pod["metadata"]["uid"], self._start(pod, ip, log), log)
                    self.run(name, ip)

    def _start(self, pod: dict, ip: str, log: Path) -> subprocess.Popen:
        (container,) = pod["spec"]["containers"]
        command = list(container["command"])
        assert command[:1] == ["openrl-lab"]
        home = self.root / f"home-{self.started}"
        args = []
        for i, given in enumerate(command[1:]):
            # after --listen: the Pod's port 7070 on its own IP; here any free port on the "Pod's" address
            arg = f"{ip}:0" if command[i] == "--listen" else given
            arg = arg.replace("$(POD_IP)", ip).replace("/var/lib/openrl", str(home))
            args.append(self.mounts.get(arg, arg))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_", "KUBE"))}
        env["OPENRL_LAB_HOME"] = str(home)
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "openrl_lab.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def kill(self, name: str) -> None:
        self.procs[name][1].send_signal(signal.SIGKILL)

    def logs(self) -> str:
        return "\n".join(f"--- {p[2].name}\n{p[2].read_text()[-1500:]}" for p in self.procs.values())

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_kernel_pod_joins_serves_and_is_replaced_after_a_kill(tmp_path, monkeypatch):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca, ca_key, ca_cert = make_ca(pki)
    cp_cert, cp_key = make_leaf(pki, "control-plane", "127.0.0.1", ca_key, ca_cert)
    k_cert, k_key = make_leaf(pki, "openrl-kernel", None, ca_key, ca_cert)  # one certificate for every kernel Pod
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    mounts = {
        "/var/run/openrl/join/token": str(token_file),
        "/var/run/openrl/tls/tls.crt": str(k_cert),
        "/var/run/openrl/tls/tls.key": str(k_key),
        "/var/run/openrl/tls/ca.crt": str(ca),
    }
    with EmulatorThread() as emu, ProcessKubelet(emu, tmp_path, mounts) as kubelet:
        lab = LabServer(
            tmp_path / "cp",
            grpc_port=_free_port(),  # known before the start: launcher.json names it for the Pods
            args=(
                "--cpu-kernels",
                "0",
                "--checkpoint-store",
                str(tmp_path / "checkpoints"),
                "--tls-cert",
                str(cp_cert),
                "--tls-key",
                str(cp_key),
                "--kernel-ca",
                str(ca),
                "--kernel-tls-name",
                "openrl-kernel",
                "--kernel-launcher",
                "kubernetes",
                "--launcher-config",
                str(tmp_path / "launcher.json"),
                "--join-token-file",
                str(tmp_path / "join-token"),
            ),
        )
        (tmp_path / "join-token").write_text(TOKEN)  # as the chart gives it the join-token Secret
        (tmp_path / "launcher.json").write_text(
            json.dumps(
                {
                    "namespace": NS,
                    "image": "openrl-lab:test",
                    "controlPlane": lab.grpc_target,
                    "joinTokenSecret": "openrl-lab-join-token",
                    "tlsSecret": "openrl-lab-kernel-tls",
                    "checkpointClaim": "openrl-lab-checkpoints",
                    "podLabels": {
                        "app.kubernetes.io/name": "openrl-lab",
                        "app.kubernetes.io/instance": "openrl-lab",
                        "app.kubernetes.io/component": "kernel",
                    },
                    "groups": [{"id": "cpu", "kernels": 1}],
                }
            )
        )
        emu.kubeconfig(tmp_path / "kubeconfig", NS)
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))  # the control plane's way to the "cluster"

        def up(incarnation: str | None = None):
            k = kernels(lab).get(POD)
            return k if k and k["state"] == "up" and k["incarnation"] != incarnation else None

        with lab:
            try:
                first = wait_for(up, 180, f"kernel Pod {POD} to join")
                assert first["group"] == "cpu" and first["tls"] and first["address"].startswith("127.0.0.11:")
                service = sdk(lab, lab.api_key)
                trainer = new_trainer(service).result()
                assert placement(lab, lab.api_key, trainer.model_id)["kernel"] == POD
                trainer.forward_backward([datum([1, 2, 3, 4])], "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                saved = trainer.save_state("before-the-kill").result().path

                kubelet.kill(POD)  # the Pod's process dies: the kubelet reports it Failed, exit code 137
                lost = wait_for(lambda: (k := kernels(lab)[POD])["state"] == "lost" and k, 10, "the kernel lost")
                assert "its Pod failed: Error (exit code 137)" in lost["lost_why"]
                with pytest.raises(tinker.NotFoundError, match=r"lost.*tinker://.*/weights/before-the-kill"):
                    trainer.forward_backward([datum([1, 2, 3])], "cross_entropy").result()

                again = wait_for(lambda: up(first["incarnation"]), 180, "the replacement Pod's kernel to rejoin")
                assert again["address"].startswith("127.0.0.12:") and kubelet.started == 2
                restored = service.create_training_client_from_state(saved).result()
                assert placement(lab, lab.api_key, restored.model_id)["kernel"] == POD
                restored.forward_backward([datum([1, 2, 3])], "cross_entropy").result()
                service.close("success").result()
            except BaseException:
                print((lab.home / "server.log").read_text()[-4000:], kubelet.logs(), sep="\n")
                raise
        # the control plane stopped: it deleted its Pod, and the kubelet stopped the process
        assert kubelet.pods() == {}
        wait_for(lambda: not kubelet.procs, 30, "the Pod's process to end")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
