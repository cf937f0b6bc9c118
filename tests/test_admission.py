"""Admission shared between tenants (serve/admission.py): turns handed round robin, and the
longest queue shedding when every place is held."""

from __future__ import annotations

import asyncio

import pytest

from agentcache.serve.admission import Admission
from agentcache.serve.api import ApiError


async def _waiter(admission: Admission, tenant: str):
    slot = admission.enter(tenant)
    task = asyncio.ensure_future(admission.turn(slot))
    await asyncio.sleep(0)
    return slot, task


def test_a_burst_waits_behind_itself_and_another_tenant_runs_next():
    async def main():
        admission = Admission(limit=16, running=1)
        first = admission.enter("heavy")
        await admission.turn(first)  # a free turn: at once
        heavy = [await _waiter(admission, "heavy") for _ in range(5)]
        light = await _waiter(admission, "light")
        assert admission.running == 1 and admission.waiting == 6
        order = []
        for _ in range(7):
            running = next(slot for slot, _ in [(first, None), *heavy, light] if slot.running)
            order.append(running.tenant)
            running.release()
            await asyncio.sleep(0)
        assert order == ["heavy", "heavy", "light", "heavy", "heavy", "heavy", "heavy"]
        assert admission.in_flight == 0 and admission.running == 0

    asyncio.run(main())


def test_a_full_server_sheds_the_busiest_tenants_newest_waiting_request():
    async def main():
        admission = Admission(limit=4, running=1)
        first = admission.enter("heavy")
        await admission.turn(first)
        waiting = [await _waiter(admission, "heavy") for _ in range(3)]
        light = admission.enter("light")  # full: the heavy tenant's newest waiting place is given up
        with pytest.raises(ApiError) as refused:
            await waiting[-1][1]
        assert refused.value.status == 429 and refused.value.headers["Retry-After"]
        assert admission.in_flight == 4
        admission.enter("light")  # heavy holds 3, light 1: one more is taken from heavy
        with pytest.raises(ApiError):
            await waiting[-2][1]
        with pytest.raises(ApiError) as full:  # now 2 and 2: the newcomer is the one refused
            admission.enter("light")
        assert full.value.code == "queue_full"
        assert first.running and admission.running == 1
        light.release()
        assert admission.in_flight == 3

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_leaves_the_queue():
    async def main():
        admission = Admission(limit=8, running=1)
        first = admission.enter("a")
        await admission.turn(first)
        slot, task = await _waiter(admission, "b")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        slot.release()
        assert admission.waiting == 0 and admission.in_flight == 1
        first.release()
        late = admission.enter("c")
        await asyncio.wait_for(admission.turn(late), 1)  # nobody left in front of it
        assert late.running

    asyncio.run(main())


def test_while_several_tenants_are_active_one_tenant_leaves_a_turn_for_another():
    async def main():
        admission = Admission(limit=8, running=3)
        alone = [admission.enter("heavy") for _ in range(3)]
        for slot in alone:
            await asyncio.wait_for(admission.turn(slot), 1)  # a tenant alone has every turn
        assert admission.spare == 0
        for slot in alone:
            slot.release()
        admission.enter("light").release()  # another tenant is active now
        assert admission.spare == 1
        heavy = [admission.enter("heavy") for _ in range(3)]
        turns = [asyncio.ensure_future(admission.turn(slot)) for slot in heavy]
        await asyncio.sleep(0)
        assert [slot.running for slot in heavy] == [True, True, False]  # all turns but one
        light = admission.enter("light")
        await asyncio.wait_for(admission.turn(light), 1)  # at once
        heavy[0].release()
        await asyncio.sleep(0)
        assert heavy[2].running and turns[2].done()

    asyncio.run(main())


def test_a_waiter_cancelled_before_its_turn_is_handed_is_skipped():
    async def main():
        admission = Admission(limit=8, running=1)
        first = admission.enter("a")
        await admission.turn(first)
        cancelled, cancelled_task = await _waiter(admission, "b")
        later, later_task = await _waiter(admission, "c")
        cancelled_task.cancel()  # its future is cancelled now; its task's cleanup has not run yet
        first.release()  # hands the turn on: the cancelled waiter is skipped, not set
        await asyncio.sleep(0)
        assert later.running and later_task.done() and not cancelled.running
        with pytest.raises(asyncio.CancelledError):
            await cancelled_task
        cancelled.release()
        later.release()
        assert admission.in_flight == 0 and admission.running == 0

    asyncio.run(main())
