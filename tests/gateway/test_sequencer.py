"""The per-model Sequencer (gateway/sequencer.py) without a server or a clock: seq_id order, and a refused seq_id
skipped at once. The event loop is only ever stepped (no sleeps): a request that had to wait out GAP_GRACE_S would
not have run."""

from __future__ import annotations

import asyncio

from openrl_lab.gateway.sequencer import Sequencer


async def _steps(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _work(ran: list, name: str):
    async def work():
        ran.append(name)

    return work


def test_requests_run_in_seq_order_whatever_order_they_arrive_in():
    async def main():
        seq, ran = Sequencer(), []
        seq.submit(3, _work(ran, "3"))
        seq.submit(2, _work(ran, "2"))
        await _steps()
        assert ran == []  # 1 has not arrived: 2 and 3 wait for it
        seq.submit(1, _work(ran, "1"))
        await _steps()
        assert ran == ["1", "2", "3"]

    asyncio.run(main())


def test_a_skipped_seq_id_lets_the_next_one_go_at_once():
    async def main():
        seq, ran = Sequencer(), []
        seq.submit(1, _work(ran, "1"))
        seq.submit(3, _work(ran, "3"))
        await _steps()
        assert ran == ["1"]  # 3 waits for 2
        seq.skip(2)  # 2 was refused
        await _steps()
        assert ran == ["1", "3"]  # without waiting GAP_GRACE_S (no time passed)
        seq.skip(4)
        seq.submit(5, _work(ran, "5"))  # skipped before its successor arrives: the same
        await _steps()
        assert ran == ["1", "3", "5"]

    asyncio.run(main())


class _Call:
    """Pipelined work whose kernel call the test sends and ends by hand."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.end = log, name, asyncio.Event()

    async def __call__(self, sent):
        self.log.append(f"sent {self.name}")
        sent()
        await self.end.wait()
        self.log.append(f"done {self.name}")


def test_pipelined_work_lets_the_next_go_once_sent_with_at_most_two_out():
    async def main():
        seq, log = Sequencer(), []
        calls = [_Call(log, str(i)) for i in range(1, 4)]
        for i, call in enumerate(calls, start=1):
            seq.submit(i, call, pipelined=True)
        await _steps()
        assert log == ["sent 1", "sent 2"]  # 2 is on its way while 1 runs; 3 waits: two are out (its depth)
        calls[0].end.set()
        await _steps()
        assert log == ["sent 1", "sent 2", "done 1", "sent 3"]
        calls[1].end.set(), calls[2].end.set()
        await _steps()
        assert log[-2:] == ["done 2", "done 3"]

    asyncio.run(main())


def test_other_work_waits_for_every_pipelined_call_before_it():
    async def main():
        seq, log = Sequencer(), []
        first, second = _Call(log, "fb"), _Call(log, "optim")
        seq.submit(1, first, pipelined=True)
        seq.submit(2, second, pipelined=True)
        seq.submit(3, _work(log, "save"))  # e.g. save_state: it must see both calls' results
        await _steps()
        assert log == ["sent fb", "sent optim"]
        first.end.set()
        await _steps()
        assert "save" not in log
        second.end.set()
        await _steps()
        assert log == ["sent fb", "sent optim", "done fb", "done optim", "save"]

    asyncio.run(main())


def test_pipelined_work_that_ends_before_sending_lets_the_next_go():
    async def main():
        seq, log = Sequencer(), []

        async def refused(sent):  # e.g. its kernel was lost: Gateway.run settles the future with the error
            log.append("refused")

        later = _Call(log, "2")
        seq.submit(1, refused, pipelined=True)
        seq.submit(2, later, pipelined=True)
        await _steps()
        assert log == ["refused", "sent 2"]
        assert [seq.ticket(), seq.ticket()] == [(seq.lane, 1), (seq.lane, 2)]  # tickets count calls sent, in order
        later.end.set()
        await _steps()

    asyncio.run(main())


def test_depth_one_is_no_pipelining():
    async def main():
        seq, log = Sequencer(depth=1), []
        first, second = _Call(log, "1"), _Call(log, "2")
        seq.submit(1, first, pipelined=True)
        seq.submit(2, second, pipelined=True)
        await _steps()
        assert log == ["sent 1"]
        first.end.set()
        await _steps()
        assert log == ["sent 1", "done 1", "sent 2"]
        second.end.set()
        await _steps()

    asyncio.run(main())
