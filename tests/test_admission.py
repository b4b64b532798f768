"""Admission: slots, the bounded priority queue, timeouts, cancellation, Retry-After, limits."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.errors import Overloaded
from gateway.policy.model import Queue
from gateway.resilience.admission import Admission, AdmissionConfig, Priority, Ticket
from gateway.testing import FakeClock


def make(
    max_concurrency: int = 1,
    capacity: int = 3,
    timeout_ms: int = 5000,
    clock: FakeClock | None = None,
) -> Admission:
    return Admission(
        "main",
        AdmissionConfig(max_concurrency, Queue(capacity, timeout_ms)),
        clock=clock or FakeClock(),
    )


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


async def queue_up(admission: Admission, *priorities: Priority) -> list[asyncio.Task[Ticket]]:
    tasks = []
    for p in priorities:
        tasks.append(asyncio.create_task(admission.acquire(p)))
        await settle()
    return tasks


async def test_calls_within_max_concurrency_get_a_slot_at_once() -> None:
    admission = make(max_concurrency=2)
    a, b = await admission.acquire(), await admission.acquire()
    assert admission.in_flight == 2
    a.release()
    b.release()
    b.release()  # twice does nothing
    assert admission.in_flight == 0


async def test_the_slot_context_manager_releases_on_error() -> None:
    admission = make()
    with pytest.raises(RuntimeError):
        async with admission.slot(Priority.HIGH):
            assert admission.in_flight == 1
            raise RuntimeError("upstream broke")
    assert admission.in_flight == 0


async def test_waiters_get_slots_by_priority_then_in_arrival_order() -> None:
    admission = make(capacity=10)
    holder = await admission.acquire()
    L, N, H = Priority.LOW, Priority.NORMAL, Priority.HIGH
    order = [L, N, H, N, H, L]
    tasks = await queue_up(admission, *order)
    assert admission.depth == 6
    assert (admission.depth_of(H), admission.depth_of(N), admission.depth_of(L)) == (2, 2, 2)
    served = []
    holder.release()
    for _ in order:
        await settle()
        done = next(i for i, t in enumerate(tasks) if t.done() and i not in served)
        served.append(done)
        tasks[done].result().release()
    assert served == [2, 4, 1, 3, 0, 5]


async def test_a_full_queue_rejects_at_once_with_retry_after() -> None:
    admission = make(capacity=2)
    await admission.acquire()
    await queue_up(admission, Priority.NORMAL, Priority.NORMAL)
    attempt = admission.acquire(Priority.NORMAL)
    with pytest.raises(Overloaded) as caught:
        attempt.send(None)  # raises on its first step: nothing is awaited
    assert caught.value.reason == "queue_full"
    assert caught.value.status == 503
    assert caught.value.retry_after_s is not None
    assert caught.value.retry_after_s >= 1
    assert caught.value.retry_after_s == int(caught.value.retry_after_s)
    assert admission.shed["queue_full"] == 1


async def test_a_higher_priority_arrival_sheds_the_newest_lowest_priority_waiter() -> None:
    admission = make(capacity=3)
    await admission.acquire()
    low_old, low_new, normal = await queue_up(
        admission, Priority.LOW, Priority.LOW, Priority.NORMAL
    )
    high = asyncio.create_task(admission.acquire(Priority.HIGH))
    await settle()
    assert low_new.done()
    with pytest.raises(Overloaded, match="higher-priority"):
        low_new.result()
    assert not low_old.done() and not normal.done() and not high.done()
    assert admission.depth == 3


async def test_an_arrival_no_higher_than_every_waiter_is_rejected_itself() -> None:
    admission = make(capacity=2)
    await admission.acquire()
    waiting = await queue_up(admission, Priority.NORMAL, Priority.NORMAL)
    with pytest.raises(Overloaded, match="queue is full"):
        await admission.acquire(Priority.NORMAL)
    with pytest.raises(Overloaded, match="queue is full"):
        await admission.acquire(Priority.LOW)
    assert not any(t.done() for t in waiting)


async def test_a_waiter_past_its_timeout_is_shed_with_queue_timeout() -> None:
    clock = FakeClock()
    admission = make(timeout_ms=2000, clock=clock)
    await admission.acquire()
    (early,) = await queue_up(admission, Priority.NORMAL)
    clock.advance(1.5)
    (late,) = await queue_up(admission, Priority.HIGH)
    clock.advance(0.5)
    assert admission.expire_due() == 1
    await settle()
    with pytest.raises(Overloaded) as caught:
        early.result()
    assert caught.value.reason == "queue_timeout"
    assert not late.done()
    assert admission.depth == 1
    assert admission.shed["queue_timeout"] == 1


async def test_the_waiters_own_timer_expires_it_without_outside_help() -> None:
    clock = FakeClock()
    admission = make(timeout_ms=1, clock=clock)
    await admission.acquire()
    (waiter,) = await queue_up(admission, Priority.NORMAL)
    clock.advance(1)
    with pytest.raises(Overloaded, match="timed out"):
        await asyncio.wait_for(waiter, timeout=5)


async def test_a_cancelled_waiter_leaves_the_queue_at_once() -> None:
    admission = make()
    holder = await admission.acquire()
    gone, stays = await queue_up(admission, Priority.HIGH, Priority.NORMAL)
    gone.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    assert admission.depth == 1
    holder.release()
    await settle()
    assert stays.done()
    assert admission.in_flight == 1


async def test_a_waiter_cancelled_just_as_it_was_granted_passes_the_slot_on() -> None:
    admission = make()
    holder = await admission.acquire()
    first, second = await queue_up(admission, Priority.NORMAL, Priority.NORMAL)
    holder.release()  # grants `first`, which has not resumed yet
    first.cancel()
    await settle()
    assert first.cancelled()
    assert second.done()
    assert admission.in_flight == 1
    assert admission.depth == 0


async def test_retry_after_grows_with_queue_length_and_recent_service_time() -> None:
    clock = FakeClock()
    admission = make(capacity=3, clock=clock)
    ticket = await admission.acquire()
    clock.advance(6)
    ticket.release()  # service estimate: 1.0 + 0.2 * (6 - 1) = 2.0 s
    assert admission.service_s == pytest.approx(2.0)
    await admission.acquire()
    await queue_up(admission, Priority.NORMAL, Priority.NORMAL, Priority.NORMAL)
    with pytest.raises(Overloaded) as caught:
        await admission.acquire()
    assert caught.value.retry_after_s == 8.0  # (3 waiting + 1) * 2.0 s / 1 slot


async def test_raising_the_limit_admits_waiters_and_lowering_it_lets_in_flight_finish() -> None:
    admission = make(max_concurrency=2, capacity=5)
    held = [await admission.acquire(), await admission.acquire()]
    waiting = await queue_up(admission, Priority.NORMAL, Priority.NORMAL)
    admission.configure(AdmissionConfig(4, Queue(5, 5000)))
    await settle()
    assert all(t.done() for t in waiting)
    admission.configure(AdmissionConfig(1, Queue(5, 5000)))
    assert admission.in_flight == 4  # nobody is evicted
    (late,) = await queue_up(admission, Priority.HIGH)
    for ticket in [*held, waiting[0].result()]:
        ticket.release()
        await settle()
        assert not late.done()
    waiting[1].result().release()
    await settle()
    assert late.done()


async def test_a_limit_throttle_caps_concurrency_below_the_config() -> None:
    admission = make(max_concurrency=4)
    admission.set_throttle_limit(1)
    assert admission.limit == 1
    await admission.acquire()
    (waiter,) = await queue_up(admission, Priority.NORMAL)
    assert not waiter.done()
    admission.set_throttle_limit(None)
    await settle()
    assert waiter.done()
    admission.set_throttle_limit(8)
    assert admission.limit == 4


async def test_queue_wait_and_sheds_are_reported() -> None:
    waits: list[float] = []
    sheds: list[str] = []
    clock = FakeClock()
    admission = Admission(
        "main",
        AdmissionConfig(1, Queue(capacity=1)),
        clock=clock,
        on_wait=waits.append,
        on_shed=sheds.append,
    )
    holder = await admission.acquire()
    (waiter,) = await queue_up(admission, Priority.NORMAL)
    with pytest.raises(Overloaded):
        await admission.acquire()
    clock.advance(0.25)
    holder.release()
    await settle()
    assert waits == [0.0, 0.25]
    assert sheds == ["queue_full"]
    assert repr(admission) == "<Admission main in_flight=1/1 queued=0/1 service=0.85s>"
    waiter.result().release()


async def test_throttle_shedding_drops_queued_waiters_below_a_priority() -> None:
    admission = make(capacity=5)
    await admission.acquire()
    low, normal, high = await queue_up(admission, Priority.LOW, Priority.NORMAL, Priority.HIGH)
    assert admission.shed_waiting(below=Priority.HIGH) == 2
    await settle()
    for task in (low, normal):
        with pytest.raises(Overloaded) as caught:
            task.result()
        assert caught.value.reason == "throttle"
    assert not high.done()


# -- fair queuing between tenants (``queue.fairness: tenant``) ----------------------------


async def queue_flows(admission: Admission, *flows: str) -> list[asyncio.Task[Ticket]]:
    tasks = []
    for flow in flows:
        tasks.append(asyncio.create_task(admission.acquire(Priority.NORMAL, flow)))
        await settle()
    return tasks


async def cancel(*tasks: asyncio.Task[Ticket]) -> None:
    """End waiters a test leaves queued (a task destroyed pending is logged at exit)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def served_order(holder: Ticket, tasks: list[asyncio.Task[Ticket]]) -> list[int]:
    """The order in which the queued ``tasks`` got the one slot, each released at once."""
    served: list[int] = []
    holder.release()
    for _ in tasks:
        await settle()
        done = next(i for i, t in enumerate(tasks) if t.done() and i not in served)
        served.append(done)
        tasks[done].result().release()
    return served


async def test_a_freed_slot_goes_to_each_waiting_tenant_in_turn() -> None:
    admission = make(capacity=10)
    holder = await admission.acquire()
    tasks = await queue_flows(admission, "acme", "acme", "acme", "acme", "globex", "initech")
    assert admission.waiting_of("acme") == 4 and admission.waiting_of("globex") == 1
    # acme came first and keeps its turn; globex and initech wait for one call of it, not four
    assert await served_order(holder, tasks) == [0, 4, 5, 1, 2, 3]
    assert admission.depth == 0 and admission.waiting_of("acme") == 0


async def test_priorities_come_before_turns() -> None:
    admission = make(capacity=10)
    holder = await admission.acquire()
    tasks = [asyncio.create_task(admission.acquire(Priority.LOW, "globex"))]
    tasks += await queue_flows(admission, "acme", "acme", "globex")
    tasks.append(asyncio.create_task(admission.acquire(Priority.HIGH, "acme")))
    await settle()
    assert await served_order(holder, tasks) == [4, 1, 3, 2, 0]


async def test_one_flow_is_first_come_first_served() -> None:
    admission = make(capacity=10)
    holder = await admission.acquire()
    tasks = await queue_flows(admission, "", "", "", "")
    assert await served_order(holder, tasks) == [0, 1, 2, 3]


async def test_a_full_queue_sheds_the_flooding_tenants_newest_for_another() -> None:
    admission = make(capacity=4)
    await admission.acquire()
    acme = await queue_flows(admission, "acme", "acme", "acme", "acme")
    globex = await queue_flows(admission, "globex", "globex")  # acme 4 -> 3 -> 2
    for task in acme[2:]:
        with pytest.raises(Overloaded, match="share it between tenants") as caught:
            task.result()
        assert caught.value.reason == "queue_share" and caught.value.retry_after_s
    assert (admission.waiting_of("acme"), admission.waiting_of("globex")) == (2, 2)
    assert admission.shed["queue_share"] == 2
    # Shared evenly now: neither takes a place from the other, nor does a flow from itself.
    for flow in ("globex", "acme"):
        with pytest.raises(Overloaded, match="queue is full"):
            await admission.acquire(Priority.NORMAL, flow)
    # A third tenant takes from the largest (the first in turn among equals): acme.
    (initech,) = await queue_flows(admission, "initech")
    assert (admission.waiting_of("acme"), admission.waiting_of("initech")) == (1, 1)
    with pytest.raises(Overloaded, match="share it between tenants"):
        acme[1].result()
    assert not any(t.done() for t in (*acme[:1], *globex, initech))
    assert admission.depth == 4
    await cancel(*acme[:1], *globex, initech)


async def test_a_flow_holding_one_more_than_the_newcomers_keeps_its_places() -> None:
    admission = make(capacity=3)
    await admission.acquire()
    waiting = await queue_flows(admission, "acme", "acme", "globex")
    with pytest.raises(Overloaded, match="queue is full"):
        await admission.acquire(Priority.NORMAL, "globex")  # 2 against 1 + 1: no gain
    assert admission.shed["queue_share"] == 0
    await cancel(*waiting)


async def test_a_lower_priority_is_shed_before_a_share_is_taken() -> None:
    admission = make(capacity=3)
    await admission.acquire()
    (low,) = [asyncio.create_task(admission.acquire(Priority.LOW, "acme"))]
    await settle()
    acme = await queue_flows(admission, "acme", "acme")
    (globex,) = await queue_flows(admission, "globex")
    with pytest.raises(Overloaded, match="higher-priority"):
        low.result()
    assert not any(t.done() for t in acme) and not globex.done()
    await cancel(*acme, globex)


async def test_a_weighted_tenant_takes_its_weight_of_calls_each_turn() -> None:
    admission = make(capacity=20)
    admission.weights = {"acme": 3}
    holder = await admission.acquire()
    tasks = await queue_flows(admission, *["acme"] * 6, *["globex"] * 3)
    # acme's turn is three calls, globex's one: 3, 1, 3 (acme has no more), then globex's.
    assert await served_order(holder, tasks) == [0, 1, 2, 6, 3, 4, 5, 7, 8]
    assert admission.depth == 0


async def test_a_full_queue_keeps_a_weighted_tenants_places_in_proportion() -> None:
    admission = make(capacity=8)
    admission.weights = {"acme": 3}
    await admission.acquire()
    acme = await queue_flows(admission, *["acme"] * 8)
    globex = await queue_flows(admission, *["globex"] * 3)  # acme 8 -> 6; the third refused
    assert (admission.waiting_of("acme"), admission.waiting_of("globex")) == (6, 2)
    with pytest.raises(Overloaded, match="queue is full"):  # 6/3 against 3/1: no place taken
        await admission.acquire(Priority.NORMAL, "globex")
    assert admission.shed["queue_share"] == 2
    await cancel(*acme, *globex)


async def test_expired_and_cancelled_waiters_leave_their_flow() -> None:
    clock = FakeClock()
    admission = make(capacity=5, timeout_ms=1000, clock=clock)
    holder = await admission.acquire()
    old = await queue_flows(admission, "acme", "acme")
    clock.advance(0.5)
    young = await queue_flows(admission, "globex", "acme")
    young[1].cancel()
    await settle()
    clock.advance(0.6)
    assert admission.expire_due() == 2
    assert (admission.waiting_of("acme"), admission.waiting_of("globex")) == (0, 1)
    await settle()
    assert all(t.done() for t in old)
    holder.release()
    await settle()
    young[0].result().release()
    assert admission.depth == 0 and admission.in_flight == 0


def test_priorities_parse_from_headers() -> None:
    assert Priority.parse("High") is Priority.HIGH
    assert Priority.parse(" low ") is Priority.LOW
    with pytest.raises(ValueError, match="high, normal or low"):
        Priority.parse("urgent")
