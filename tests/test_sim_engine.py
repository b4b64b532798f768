"""The sim's scheduler and settings: FIFO slots, counters, fault injection, SimConfig."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.sim import SimConfig
from gateway.sim.config import apply_changes
from gateway.sim.engine import Engine, Slots
from gateway.testing import FakeClock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_slot_runs_calls_one_at_a_time_in_arrival_order() -> None:
    engine = Engine(SimConfig(slots=1), FakeClock())
    order: list[int] = []
    gates = [asyncio.Event() for _ in range(3)]

    async def run(i: int) -> None:
        async with engine.call(1):
            order.append(i)
            await gates[i].wait()

    tasks = [asyncio.create_task(run(i)) for i in range(3)]
    await settle()
    state = engine.state()
    assert (state["running"], state["waiting"]) == (1, 2)
    assert order == [0]
    for gate in gates:
        gate.set()
        await settle()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    state = engine.state()
    assert (state["running"], state["waiting"], state["calls"]) == (0, 0, 3)
    assert (state["peak_running"], state["peak_waiting"]) == (1, 2)


async def test_two_slots_run_two_calls_at_once() -> None:
    engine = Engine(SimConfig(slots=2), FakeClock())
    gate = asyncio.Event()

    async def run() -> None:
        async with engine.call(4):
            await gate.wait()

    tasks = [asyncio.create_task(run()) for _ in range(3)]
    await settle()
    state = engine.state()
    assert (state["running"], state["waiting"]) == (2, 1)
    assert (state["running_items"], state["waiting_items"]) == (8, 4)
    gate.set()
    await asyncio.gather(*tasks)


async def test_growing_the_slots_at_run_time_admits_waiting_calls() -> None:
    engine = Engine(SimConfig(slots=1), FakeClock())
    gate = asyncio.Event()

    async def run() -> None:
        async with engine.call(1):
            await gate.wait()

    tasks = [asyncio.create_task(run()) for _ in range(2)]
    await settle()
    assert engine.state()["waiting"] == 1
    engine.reconfigure({"slots": 2})
    await settle()
    assert (engine.state()["running"], engine.state()["waiting"]) == (2, 0)
    gate.set()
    await asyncio.gather(*tasks)


async def test_a_waiter_that_gives_up_leaves_the_queue_and_the_slot_free() -> None:
    slots = Slots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slots.release()
    assert repr(slots) == "<Slots in_use=0/1 waiting=0>"


async def test_counters_record_calls_items_tokens_and_modelled_time() -> None:
    engine = Engine(SimConfig(), FakeClock())
    async with engine.call(8) as cost_ms:
        assert cost_ms == pytest.approx(78.0)
    async with engine.call(1, tokens=10):
        pass
    state = engine.state()
    assert (state["calls"], state["items"], state["tokens"]) == (2, 9, 10)
    assert state["modelled_ms"] == pytest.approx(78.0 + 50.0 + 20.0)
    engine.reset()
    assert engine.state()["calls"] == 0


def test_error_rate_one_fails_every_request_with_the_configured_status() -> None:
    engine = Engine(SimConfig(error_rate=1.0, fail_status=503), FakeClock())
    faults = [engine.fault(1) for _ in range(5)]
    assert all(f is not None and f.status == 503 for f in faults)
    assert engine.counters.injected_errors == 5


def test_injected_errors_are_reproducible_from_the_seed() -> None:
    def pattern(seed: int) -> list[bool]:
        engine = Engine(SimConfig(error_rate=0.5, seed=seed), FakeClock())
        return [engine.fault(1) is None for _ in range(40)]

    assert pattern(7) == pattern(7)
    assert pattern(7) != pattern(8)
    assert 5 < sum(pattern(7)) < 35


def test_calls_over_oom_above_fail_with_cuda_out_of_memory() -> None:
    engine = Engine(SimConfig(oom_above=4), FakeClock())
    assert engine.fault(4) is None
    fault = engine.fault(5)
    assert fault is not None and fault.status == 500
    assert "CUDA out of memory" in fault.message
    assert engine.counters.ooms == 1


def test_every_config_field_has_help_a_default_and_a_simple_type() -> None:
    """The CLI derives `gateway sim` flags from these fields."""
    for f in dataclasses.fields(SimConfig):
        assert f.metadata.get("help"), f.name
        assert type(f.default) in (int, float, str, bool), f.name


def test_case_study_defaults() -> None:
    config = SimConfig()
    assert (config.host, config.port, config.slots) == ("127.0.0.1", 8000, 1)
    assert (config.base_ms, config.per_item_ms) == (46.0, 4.0)


@pytest.mark.parametrize(
    "changes",
    [{"slots": 0}, {"error_rate": 1.5}, {"ambient_c": 100.0}, {"fail_status": 200}],
)
def test_invalid_values_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        apply_changes(SimConfig(), changes)


def test_run_time_changes_check_names_types_and_the_address() -> None:
    config = SimConfig()
    assert apply_changes(config, {"added_latency_ms": 5}).added_latency_ms == 5.0
    for bad in ({"nope": 1}, {"slots": "2"}, {"slots": True}, {"port": 9000}):
        with pytest.raises(ValueError):
            apply_changes(config, bad)


async def test_cold_start_is_paid_after_start_and_after_idle_and_shared_while_warming() -> None:
    """`--cold-start-ms`: the first call waits for the model to warm; a call starting while
    it warms waits for the rest of it; a warm model costs nothing more; idle for
    `cold_idle_s`, it is cold again."""
    clock = FakeClock()
    config = SimConfig(slots=2, base_ms=10, per_item_ms=0, cold_start_ms=3000, cold_idle_s=60)
    engine = Engine(config, clock)
    async with engine.call(1) as first:
        clock.advance(1)  # one second into the warm-up, a second call starts
        async with engine.call(1) as second:
            pass
    assert (first, second) == (3010, 2010)
    clock.advance(5)
    async with engine.call(1) as warm:
        pass
    assert warm == 10
    clock.advance(60)
    async with engine.call(1) as cold_again:
        pass
    assert cold_again == 3010
    assert engine.state()["cold_starts"] == 2
    async with Engine(SimConfig(base_ms=10, per_item_ms=0), clock).call(1) as never_cold:
        pass
    assert never_cold == 10
