"""Kernels that join from "other hosts": separate processes on other loopback addresses (127.0.0.2, 127.0.0.3),
each with its own home and no access to the control plane's, sharing only the network and a checkpoint store."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
import tinker

from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.server import LabServer
from tests.cluster.certs import make_ca, make_leaf
from tests.cluster.helpers import (
    datum,
    joined,
    kernels,
    lost_within_s,
    new_trainer,
    placement,
    rl_steps,
    sdk,
    start_join,
    wait_for,
)

pytestmark = pytest.mark.server  # starts control planes and joined kernel processes


def _token(lab, label: str = "test") -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "tokens",
            "create",
            "--kernel",
            "--label",
            label,
            "--home",
            str(lab.home),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A control plane that runs one kernel of its own (group default) and takes joins; CA for kernels' TLS."""
    pki = tmp_path_factory.mktemp("pki")
    ca, ca_key, ca_cert = make_ca(pki)
    store = tmp_path_factory.mktemp("checkpoint-store")
    with LabServer(
        tmp_path_factory.mktemp("cp-home"), args=("--checkpoint-store", str(store), "--kernel-ca", str(ca))
    ) as server:
        server.pki = (pki, ca, ca_key, ca_cert)
        yield server


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_joined_kernel_serves_an_sdk_rl_loop_and_rejoins_after_a_kill(lab, procs, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(_token(lab))
    log = tmp_path / "join.log"
    procs.append(
        start_join(
            lab.grpc_target,
            token_file,
            tmp_path / "kernel-home",
            "--group",
            "remote",
            "--name",
            "far-kernel",
            "--listen",
            "127.0.0.2:0",
            log=log,
        )
    )
    k = joined(lab, "far-kernel", procs[-1], log)
    assert k["origin"] == "joined" and k["group"] == "remote" and k["address"].startswith("127.0.0.2:")
    service = sdk(lab, lab.api_key)
    trainer = new_trainer(service, group="remote").result()
    assert placement(lab, lab.api_key, trainer.model_id)["kernel"] == "far-kernel"
    rewards = rl_steps(trainer, 3)
    assert len(rewards) == 3
    saved = trainer.save_state("joined").result().path
    assert kernels(lab)["far-kernel"]["jobs"] >= 1
    # killed: lost within the fleet's bound (lost_within_s: its rule plus a measured margin), its job answers naming
    # the checkpoint; started again, it rejoins
    bound = lost_within_s(lab)
    procs[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: kernels(lab)["far-kernel"]["state"] == "lost", 2 * bound, "the kernel to be declared lost")
    assert time.monotonic() - killed < bound, bound
    with pytest.raises(tinker.NotFoundError, match=r"lost.*tinker://.*/weights/joined"):
        trainer.forward_backward([datum([1, 2, 3])], "cross_entropy").result()
    procs.append(
        start_join(
            lab.grpc_target,
            token_file,
            tmp_path / "kernel-home",
            "--group",
            "remote",
            "--name",
            "far-kernel",
            "--listen",
            "127.0.0.2:0",
            log=log,
        )
    )
    joined(lab, "far-kernel", procs[-1], log)
    restored = service.create_training_client_from_state(saved, user_metadata={"openrl_group": "remote"}).result()
    assert placement(lab, lab.api_key, restored.model_id)["kernel"] == "far-kernel"
    rl_steps(restored, 1)
    service.close("success").result()


def test_wrong_and_revoked_tokens_are_refused(lab, procs, tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("orl-join-not-a-real-token")
    p = start_join(lab.grpc_target, bad, tmp_path / "h1", "--name", "intruder", log=tmp_path / "bad.log")
    assert p.wait(120) != 0
    assert "join token refused" in (tmp_path / "bad.log").read_text()
    # an API key is not a join token either
    key_file = tmp_path / "key"
    key_file.write_text(lab.api_key)
    p = start_join(lab.grpc_target, key_file, tmp_path / "h1", "--name", "intruder", log=tmp_path / "key.log")
    assert p.wait(120) != 0 and "join token refused" in (tmp_path / "key.log").read_text()
    # a token revoked while its kernel runs: the kernel leaves the fleet, and cannot join again
    token_file = tmp_path / "token"
    token_file.write_text(_token(lab, "short-lived"))
    procs.append(
        start_join(lab.grpc_target, token_file, tmp_path / "h2", "--name", "revokee", log=tmp_path / "revokee.log")
    )
    joined(lab, "revokee", procs[-1], tmp_path / "revokee.log")
    listed = subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "tokens", "list", "--home", str(lab.home)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    token_id = next(line.split("\t")[0] for line in listed.splitlines() if line.endswith("\tshort-lived"))
    subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "tokens", "revoke", token_id, "--home", str(lab.home)],
        check=True,
        capture_output=True,
    )
    gone = wait_for(lambda: (k := kernels(lab)["revokee"])["state"] == "lost" and k, 10, "the revoked kernel to go")
    assert "revoked" in gone["lost_why"]
    # it notices nobody calls it any more, starts over, and is refused: it exits with the reason
    assert procs[-1].wait(60) != 0
    assert "join token refused" in (tmp_path / "revokee.log").read_text()


def test_tls_kernel_joins_and_refuses_plaintext(lab, procs, tmp_path):
    pki, _, ca_key, ca_cert = lab.pki
    cert, key = make_leaf(pki, "kernel-three", "127.0.0.3", ca_key, ca_cert)
    token_file = tmp_path / "token"
    token_file.write_text(_token(lab))
    procs.append(
        start_join(
            lab.grpc_target,
            token_file,
            tmp_path / "h3",
            "--name",
            "tls-kernel",
            "--group",
            "tls",
            "--listen",
            "127.0.0.3:0",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            log=tmp_path / "tls.log",
        )
    )
    k = joined(lab, "tls-kernel", procs[-1], tmp_path / "tls.log")
    assert k["tls"] is True
    host, port = k["address"].rsplit(":", 1)
    # plaintext to a TLS-only kernel: no answer
    with grpc.insecure_channel(f"{host}:{port}") as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KernelStub(channel).Run(pb.Call(op="ping", args=b"{}"), timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    service = sdk(lab, lab.api_key)
    trainer = new_trainer(service, group="tls").result()  # the control plane itself talks TLS to it
    assert placement(lab, lab.api_key, trainer.model_id)["kernel"] == "tls-kernel"
    rl_steps(trainer, 1)
    service.close("success").result()


def test_a_kernel_off_loopback_must_serve_tls(lab, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(_token(lab))
    p = start_join(lab.grpc_target, token_file, tmp_path / "h4", "--listen", "0.0.0.0:0", log=tmp_path / "open.log")
    assert p.wait(60) != 0
    assert "not loopback: serve TLS" in (tmp_path / "open.log").read_text()


def test_tls_control_plane_without_kernels_of_its_own(tmp_path):
    """The cluster shape: a control plane that serves TLS and runs no kernel; a kernel joins over TLS with the CA,
    serving a certificate for a name (not its address), which the control plane checks (--kernel-tls-name)."""
    pki = tmp_path / "pki"
    pki.mkdir()
    ca, ca_key, ca_cert = make_ca(pki)
    cp_cert, cp_key = make_leaf(pki, "control-plane", "127.0.0.1", ca_key, ca_cert)
    k_cert, k_key = make_leaf(pki, "openrl-kernel", None, ca_key, ca_cert)
    with LabServer(
        tmp_path / "cp",
        args=(
            "--cpu-kernels",
            "0",
            "--tls-cert",
            str(cp_cert),
            "--tls-key",
            str(cp_key),
            "--kernel-ca",
            str(ca),
            "--kernel-tls-name",
            "openrl-kernel",
        ),
    ) as lab:
        assert kernels(lab) == {}
        token_file = tmp_path / "token"
        token_file.write_text(_token(lab))
        # plaintext to a TLS control plane is no join (the kernel cannot tell it from a control plane that is down:
        # it keeps trying, and says so)
        plain = start_join(lab.grpc_target, token_file, tmp_path / "k0", "--name", "no-ca", log=tmp_path / "plain.log")
        wait_for(lambda: "cannot reach the control plane" in (tmp_path / "plain.log").read_text(), 60, "a retry")
        assert kernels(lab) == {}
        plain.kill()
        proc = start_join(
            lab.grpc_target,
            token_file,
            tmp_path / "k1",
            "--name",
            "pod-kernel",
            "--ca",
            str(ca),
            "--listen",
            "127.0.0.4:0",
            "--tls-cert",
            str(k_cert),
            "--tls-key",
            str(k_key),
            log=tmp_path / "k1.log",
        )
        try:
            joined(lab, "pod-kernel", proc, tmp_path / "k1.log")
            service = sdk(lab, lab.api_key)
            trainer = new_trainer(service).result()  # the only kernel: placed there
            assert placement(lab, lab.api_key, trainer.model_id)["kernel"] == "pod-kernel"
            rl_steps(trainer, 1)  # its phases acquire slices from the orchestrator over TLS
            service.close("success").result()
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("name", "../etc", "kernel name"),
        ("group", "", "kernel group"),
        ("device", "tpu:0; rm -rf", "is not a device"),
        ("key", "short", "32-256 printable"),
        ("incarnation", "x", "incarnation"),
        ("address", "no-port", "is not HOST:PORT"),
        ("address", "10.9.8.7:7000", "must serve TLS"),
        ("address", "127.0.0.9:1", "cannot reach this kernel"),
        ("name", "kernel-default", "one of the control plane's own kernels"),
    ],
)
def test_join_requests_with_bad_fields_are_refused_by_name(lab, tmp_path, field, value, message):
    good = dict(
        token=_token(lab),
        name="probe",
        group="default",
        device="cpu",
        address="127.0.0.1:1",
        key="k" * 40,
        incarnation="a" * 32,
        tls=False,
        host="probe-host",
    )
    good[field] = value
    with grpc.insecure_channel(lab.grpc_target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.FleetStub(channel).Join(pb.JoinRequest(**good), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and message in err.value.details(), (
        err.value.details()
    )
    assert "probe" not in kernels(lab) and kernels(lab)["kernel-default"]["state"] == "up"


def test_joined_kernel_rejoins_a_restarted_control_plane(tmp_path):
    token_file = tmp_path / "token"
    with LabServer(tmp_path / "cp", args=("--cpu-kernels", "0")) as lab:
        token_file.write_text(_token(lab))
        proc = start_join(lab.grpc_target, token_file, tmp_path / "k", "--name", "survivor", log=tmp_path / "k.log")
        try:
            first = joined(lab, "survivor", proc, tmp_path / "k.log")
            lab.stop()
            lab.start()  # same home, same ports: the token is still valid, the fleet is empty
            again = joined(lab, "survivor", proc, tmp_path / "k.log", timeout=90)
            assert again["incarnation"] != first["incarnation"]  # it started over as a new process
            service = sdk(lab, lab.api_key)
            rl_steps(new_trainer(service).result(), 1)
            service.close("success").result()
        finally:
            proc.terminate()
            proc.wait(30)
