"""A gang job through the kernel's operations (`Engine.open_gang`, `create_gang_job` and the primitives with
`gang_phase`): two Engines, one per rank as two kernels would hold them, each starting its rank's real worker
process (`kernel/rank_worker.py`), gloo between the workers, the built-in tiny model, an OpenGate. A rank's worker
killed makes the other rank's next call fail at once with GangLost, and that rank's worker exits too; a worker
exits with its kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from openrl_lab.kernel.api import AdamSettings, LoraSettings
from openrl_lab.kernel.engine import Engine, UserError
from openrl_lab.kernel.rank_worker import GangLost
from openrl_lab.train import checkpoint

pytestmark = pytest.mark.server  # starts worker processes

MODEL = "openrl-lab/tiny-llama-1m"
ADAM = AdamSettings(learning_rate=1e-3)
WAIT_S = 30  # liveness bound for a process to go, not a performance figure


def _data(seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for n in (9, 14, 5):
        tokens = rng.integers(3, 200, size=n + 1).astype(np.int64)
        out.append((tokens[:-1], {"target_tokens": tokens[1:]}))
    return out


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def engines(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENRL_LAB_HOME", str(tmp_path / "home"))
    pair = [Engine(tmp_path / "home"), Engine(tmp_path / "home")]
    for e in pair:
        e.gang_timeout_s = 30.0
    pair[0].model_info(MODEL)  # builds the model once, before both ranks load it
    yield pair
    for e in pair:
        for job_id in list(e._gangs):
            e.drop_job(job_id)


def _both(fn0, fn1):
    """Both ranks' calls at once, as the gateway sends them; their answers."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(fn0), pool.submit(fn1)
        return a.result(timeout=120), b.result(timeout=120)


def _gang(engines, lora):
    e0, e1 = engines
    address = e0.open_gang("g", 2)
    assert address.host == "127.0.0.1" and address.port > 0
    master = f"{address.host}:{address.port}"
    cards = _both(
        lambda: e0.create_gang_job("g", MODEL, lora, 5, None, 0, 2, master, "g/0"),
        lambda: e1.create_gang_job("g", MODEL, lora, 5, None, 1, 2, master, "g/0"),
    )
    assert cards[0] == cards[1]


def test_a_gang_job_trains_like_a_single_device_job_through_the_engine(engines, tmp_path):
    e0, e1 = engines
    lora = LoraSettings(rank=4)
    _gang(engines, lora)
    assert e0.status().jobs == ["g"] and e1.trained_weights("g") == e0.trained_weights("g")
    single = Engine(tmp_path / "home")
    single.create_job("s", MODEL, lora, seed=5)
    for i in range(3):
        outs = _both(
            lambda i=i: e0.forward_backward("g", _data(i), "cross_entropy", None, True, gang_phase=f"g/{i}a"),
            lambda i=i: e1.forward_backward("g", _data(i), "cross_entropy", None, True, gang_phase=f"g/{i}a"),
        )
        want = single.forward_backward("s", _data(i), "cross_entropy", None, True)
        for out in outs:  # every rank answers the whole batch, in the datum order
            assert [lp.shape for lp in out.logprobs] == [lp.shape for lp in want.logprobs]
            np.testing.assert_allclose(out.metrics["loss:sum"], want.metrics["loss:sum"], rtol=1e-5)
        _both(
            lambda i=i: e0.optim_step("g", ADAM, gang_phase=f"g/{i}b"),
            lambda i=i: e1.optim_step("g", ADAM, gang_phase=f"g/{i}b"),
        )
        single.optim_step("s", ADAM)
    # the gate's eviction goes to the worker, and the next call finds the state back
    e1.evict_job("g")
    assert e1.swap_counters().jobs["g"].resident is False
    e1.restore_job("g")
    # a bad datum is refused alike on every rank, and the gang goes on
    bad = [(np.array([1, 2], np.int64), {"target_tokens": np.array([1], np.int64)})]
    for err in _both(
        lambda: _raises(lambda: e0.forward_backward("g", bad, "cross_entropy", None, True, gang_phase="g/x")),
        lambda: _raises(lambda: e1.forward_backward("g", bad, "cross_entropy", None, True, gang_phase="g/x")),
    ):
        assert isinstance(err, UserError), err
    # save from the gang (rank 0 writes), load on a single-device job
    path = str(tmp_path / "ckpt")
    sizes = _both(
        lambda: e0.save_state("g", path, True, {"run": "x"}, gang_phase="g/s"),
        lambda: e1.save_state("g", path, True, {"run": "x"}, gang_phase="g/s"),
    )
    assert sizes[0] == sizes[1] > 0 and checkpoint.read_meta(path)["run"] == "x"
    single.create_job_from_checkpoint("t", path, True)
    np.testing.assert_allclose(
        single.forward_backward("t", _data(9), "cross_entropy", None, False).metrics["loss:sum"],
        single.forward_backward("s", _data(9), "cross_entropy", None, False).metrics["loss:sum"],
        rtol=1e-5,
    )
    # sampler weights: the whole adapter, in the sampler snapshot format
    spath = str(tmp_path / "sampler")
    _both(
        lambda: e0.save_sampler_weights("g", spath, {}, gang_phase="g/w"),
        lambda: e1.save_sampler_weights("g", spath, {}, gang_phase="g/w"),
    )
    assert checkpoint.read_meta(spath)["kind"] == "sampler"
    single.open_sampler("smp", None, spath)
    # single-device operations a gang job does not support say so
    with pytest.raises(UserError, match="sharded over 2 devices"):
        e0.fork_job("g", "h")


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        return e
    raise AssertionError("no error")


def test_a_killed_rank_fails_the_other_ranks_next_call_and_its_worker_goes(engines):
    e0, e1 = engines
    _gang(engines, None)  # full fine-tuning
    _both(
        lambda: e0.forward_backward("g", _data(0), "cross_entropy", None, True, gang_phase="g/1"),
        lambda: e1.forward_backward("g", _data(0), "cross_entropy", None, True, gang_phase="g/1"),
    )
    victim = e1._gangs["g"].worker.proc
    survivor = e0._gangs["g"].worker.proc
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    with pytest.raises(GangLost, match="gang job g"):  # at once: gloo's connection to the dead peer is reset
        e0.optim_step("g", ADAM, gang_phase="g/2")
    assert _gone(survivor.pid), "the surviving rank's worker exits: its process group is broken"
    with pytest.raises(GangLost):  # and every later call says so too
        e0.forward_backward("g", _data(1), "cross_entropy", None, True, gang_phase="g/3")
    with pytest.raises(GangLost, match="worker is gone"):
        e1.optim_step("g", ADAM, gang_phase="g/2")
    e0.drop_job("g")
    e1.drop_job("g")
    assert e0.status().jobs == [] and e1.status().jobs == []


def test_a_rank_worker_exits_with_its_kernel(tmp_path):
    """A stand-in kernel (a process that starts a RankWorker, then is SIGKILLed) takes its worker with it."""
    script = textwrap.dedent(
        """
        import sys, time
        from openrl_lab.kernel.rank_worker import RankWorker
        w = RankWorker("j", 0, 2, "cpu", 30.0, 1)
        print(w.proc.pid, w.call("open"), flush=True)
        time.sleep(600)
        """
    )
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = kernel.stdout.readline() if kernel.stdout else ""
        pid, port = map(int, line.split())
        assert port > 0
        kernel.kill()
        kernel.wait()
        assert _gone(pid), "the worker outlived its kernel"
    finally:
        if kernel.poll() is None:
            kernel.kill()
