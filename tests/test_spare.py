"""The hot spare's own lifecycle, as a component: a real registry's spawner, real runners.

Held in the middle of a spawn by a gate around the real spawner, which a daemon test cannot
do without a timing race: the window between a runner's exec and its handshake is short.
"""

from __future__ import annotations

import anyio
import pytest

from supervisor.config import SupervisorConfig
from supervisor.registry.registry import Registry
from supervisor.runners.handle import RunnerHandle
from supervisor.runners.spare import HotSpare


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_stopping_the_spare_mid_spawn_waits_and_stops_it_through_the_ladder() -> None:
    config = SupervisorConfig(hot_spare=False)  # the registry keeps none of its own
    spawned: list[RunnerHandle] = []
    entered, opened = anyio.Event(), anyio.Event()
    with anyio.fail_after(120):  # a hang fails the test instead of the session
        async with anyio.create_task_group() as tg:
            registry = Registry(config, tg)

            async def held_spawn(handle: RunnerHandle) -> None:
                entered.set()
                await opened.wait()  # the spawn is in progress until the test opens the gate
                await registry.spawn(handle)
                spawned.append(handle)

            spare = HotSpare(config, held_spawn)
            tg.start_soon(spare.keep)
            await entered.wait()
            async with anyio.create_task_group() as stopping:
                stopping.start_soon(spare.stop)
                opened.set()
            # stop() has returned: the spare that was being spawned is gone, by the ladder.
            assert len(spawned) == 1
            handle = spawned[0]
            assert handle.exited.is_set()
            assert handle.stop_requested  # escalate() from its Shutdown rung
            assert handle.exit_info is not None
    assert spare.current is None
