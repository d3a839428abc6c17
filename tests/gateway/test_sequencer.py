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
