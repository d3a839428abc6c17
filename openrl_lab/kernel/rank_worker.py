"""A kernel's side of a gang job: one rank of a sharded job (`train/distributed.py`) in a worker process.

Each gang job a kernel hosts a rank of gets its own worker, `python -m openrl_lab.kernel.rank_worker`, so each
gang has its own torch.distributed world: the workers' default process group (gloo on the CPU, NCCL on CUDA),
met through a TCPStore that rank 0's worker serves (`open`: port 0 -> its real port, which the control plane
hands to the other ranks: a two-step rendezvous). The kernel talks to its worker over a socketpair it made
(`multiprocessing.connection`: pickles between a kernel and its own child; nothing from the network is
unpickled), one request at a time: (op, kwargs) -> ("ok", value) | ("user", message) | ("gang", message).

Failure: a collective waits at most the gang's timeout (`$OPENRL_KERNEL_GANG_TIMEOUT_S`, `timeout_s`); a peer that dies
resets its connections, so the others' next collective fails at once. A worker whose collective failed (or
that failed in any way but a user error, which every rank meets alike before any collective) answers "gang"
and exits: its process group is broken. The kernel raises `GangLost` for that call and every later one.
A worker exits with its kernel: the parent watch (`kernel/parent.py`) and the end of its socket. Not
PR_SET_PDEATHSIG: it fires when the *thread* that started the child ends, and the kernel starts workers from
its gRPC pool's threads.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from openrl_lab.sockets import is_loopback_host

DEFAULT_TIMEOUT_S = 60.0  # train/distributed.py's; repeated here so the kernel need not import torch.distributed
STOP_WAIT_S = 10.0


class GangLost(RuntimeError):
    """A rank of a gang job is gone (its worker or kernel died, or a collective timed out): the job cannot go on
    and must be made again from its last checkpoint."""


class GangUserError(ValueError):
    """A request every rank refused alike (bad data, a checkpoint that does not fit): the gang goes on."""


@dataclass
class Created:
    """What a worker reports once its rank of the job is sharded."""

    state_bytes: int  # this rank's share: weights, gradients, AdamW moments
    trained: Any  # the job's TrainedWeights (the whole job's)
    seed: int | None  # the LoRA seed all ranks used


class RankWorker:
    """The kernel's handle on one rank's worker process."""

    def __init__(
        self,
        job_id: str,
        rank: int,
        world_size: int,
        device: str,
        timeout_s: float,
        threads: int | None,
        host: str = "127.0.0.1",
    ):
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.lock = threading.Lock()  # one request at a time
        self.lost: str | None = None
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "openrl_lab.kernel.rank_worker", str(theirs.fileno())]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        if is_loopback_host(host):  # a kernel served on loopback: its gang's gloo sockets stay there too
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdout=2, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.call("init", rank=rank, world_size=world_size, device=device, timeout_s=timeout_s, threads=threads)

    def _name(self) -> str:
        return f"gang job {self.job_id} (rank {self.rank} of {self.world_size})"

    def call(self, op: str, **kwargs) -> Any:
        with self.lock:
            if self.lost is not None:
                raise GangLost(self.lost)
            try:
                self.conn.send((op, kwargs))
                while not self.conn.poll(0.2):
                    if self.proc.poll() is not None:
                        raise EOFError
                reply = self.conn.recv()
            except (EOFError, OSError):
                self.proc.poll()
                self.lost = f"{self._name()}: its worker is gone (exit code {self.proc.returncode})"
                raise GangLost(self.lost) from None
            if reply[0] == "ok":
                return reply[1]
            if reply[0] == "user":
                raise GangUserError(reply[1])
            self.lost = f"{self._name()}: {reply[1]}"
            self._reap()
            raise GangLost(self.lost)

    def _reap(self) -> None:
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    def stop(self) -> None:
        """Ends the worker (its rank's memory goes with it); the other ranks' next collective fails."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.conn.send(("stop", {}))
        self._reap()
        self.lost = self.lost or f"{self._name()}: dropped"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


# --------------------------------------------------------------------------------- the worker process


class _Worker:
    def __init__(self) -> None:
        self.store = None
        self.job = None
        self.rank = self.world_size = 0
        self.device = "cpu"
        self.timeout_s = DEFAULT_TIMEOUT_S

    def init(self, rank: int, world_size: int, device: str, timeout_s: float, threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s

    def open(self, host: str = "127.0.0.1") -> int:
        """Rank 0: the gang's TCPStore, listening on `host` only (the address the kernel serves others at:
        loopback for the control plane's own kernels); its port. The socket is bound here and handed to the
        store, since the store itself would listen on every interface."""
        from datetime import timedelta

        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(max(8, 2 * self.world_size))
        port = self._listener.getsockname()[1]
        self.store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            host,
            port,
            self.world_size,
            True,
            timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
            master_listen_fd=self._listener.fileno(),
        )
        return port

    def create(
        self, model_dir: str, name: str, job_id: str, lora, seed: int | None, master: str, tokens_per_microbatch: int
    ) -> Created:
        from datetime import timedelta

        import torch.distributed as dist

        from openrl_lab.train.distributed import ShardedJob, init_gang

        if self.store is None:
            host, _, port = master.rpartition(":")
            self.store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                host.strip("[]"), int(port), self.world_size, False, timedelta(seconds=self.timeout_s)
            )
        init_gang(self.store, self.rank, self.world_size, self.device, self.timeout_s)
        self.job = ShardedJob(model_dir, job_id, lora, seed, self.device, name, tokens_per_microbatch)
        return Created(self.job.state_bytes, self.job.trained, self.job.lora.seed if self.job.lora else None)

    def _ready(self):
        if self.job is None:
            raise RuntimeError("no job: create it first")
        if not self.job.resident:
            self.job.restore()
        return self.job

    def forward_backward(self, data, loss_fn: str, loss_fn_config, backward: bool):
        from openrl_lab.train.trainer import Datum

        out = self._ready().forward_backward([Datum(t, i) for t, i in data], loss_fn, loss_fn_config, backward)
        return out.logprobs, out.metrics

    def optim_step(self, adam):
        return self._ready().optim_step(adam)

    def save(self, path: str, include_optimizer: bool, overwrite: bool, meta: dict):
        return self._ready().save(path, include_optimizer=include_optimizer, overwrite=overwrite, extra_meta=meta)

    def load(self, path: str, include_optimizer: bool) -> None:
        self._ready().load(path, include_optimizer)

    def save_sampler(self, path: str, overwrite: bool) -> int:
        job = self._ready()
        return job.save_snapshot(job.snapshot(), path, overwrite=overwrite)

    def evict(self) -> int:
        return self.job.evict() if self.job is not None else 0

    def restore(self) -> int:
        return self.job.restore() if self.job is not None else 0


def _serve(conn: Connection) -> None:
    worker = _Worker()
    while True:
        try:
            op, kwargs = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the kernel is gone
        if op == "stop":
            os._exit(0)
        try:
            value = getattr(worker, op)(**kwargs)
        except ValueError as e:  # refused alike on every rank before any collective (DataError, CheckpointError...)
            conn.send(("user", str(e)))
            continue
        except BaseException as e:  # noqa: BLE001 - the process group is in an unknown state: report and go
            conn.send(("gang", _describe(e)))
            conn.close()
            time.sleep(0.1)
            os._exit(1)
        conn.send(("ok", value))


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    first = text[0] if text else type(e).__name__
    if "Dist" in type(e).__name__ or "Connection" in first or "Timed out" in first or "timeout" in first.lower():
        return f"a peer of the gang is gone or did not answer ({first[:300]})"
    return first[:500]


def main(argv: list[str]) -> None:
    from openrl_lab.kernel.parent import exit_with_parent

    exit_with_parent(0.2)  # before torch: a worker never outlives its kernel
    _serve(Connection(int(argv[0])))


if __name__ == "__main__":
    # Through the package's module, not this __main__ copy: what the worker pickles (Created) must unpickle in the
    # kernel as openrl_lab.kernel.rank_worker's.
    from openrl_lab.kernel.rank_worker import main as package_main

    package_main(sys.argv[1:])
