"""The relay's per-request queue (supervisor.runners.requests.RequestStream):
frames in order, a waiting reader woken by the next frame, the end drained
before RunnerGone, nothing taken after the end."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from ipc.messages import ExitInfo, GenerationDone, TextChunk
from supervisor.runners.requests import RequestStream, RunnerGone


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeHandle:
    """What a RequestStream needs of its runner: its exit, and the close."""

    def __init__(self) -> None:
        self.exited = anyio.Event()
        self.exit_info: ExitInfo | None = None
        self.closed: list[int] = []

    def close_request(self, request_id: int) -> None:
        self.closed.append(request_id)

    def exit(self) -> None:
        self.exit_info = ExitInfo(code=None, signal="SIGKILL", cause="killed")
        self.exited.set()


def chunk(text: str, tokens: int) -> tuple[TextChunk, bytes]:
    return TextChunk(7, text, tokens), text.encode()


def make(handle: FakeHandle) -> RequestStream:
    return RequestStream(handle, 7)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_frames_come_out_in_order_and_a_waiting_reader_is_woken() -> None:
    handle = FakeHandle()
    stream = make(handle)
    got: list[Any] = []

    async def read(n: int) -> None:
        for _ in range(n):
            got.append(await stream.next())

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, 3)
            await anyio.wait_all_tasks_blocked()  # the reader waits on an empty queue
            stream.put(*chunk("a", 1))
            await anyio.wait_all_tasks_blocked()
            stream.put(*chunk("b", 2))
            stream.put(*chunk("c", 3))
    assert [event.text for event, _ in got] == ["a", "b", "c"]
    assert [body for _, body in got] == [b"a", b"b", b"c"]
    assert stream.next_nowait() is None


@pytest.mark.anyio
async def test_the_end_is_drained_first_then_runner_gone_once_the_runner_exited() -> None:
    handle = FakeHandle()
    stream = make(handle)
    stream.put(*chunk("a", 1))
    stream.end()
    stream.put(*chunk("late", 2))  # after the end: dropped
    outcome: list[Any] = []

    async def read() -> None:
        try:
            while True:
                outcome.append((await stream.next())[0].text)
        except RunnerGone as exc:
            outcome.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            assert outcome == ["a"]  # drained; now it waits for the runner's exit status
            handle.exit()
    assert outcome[0] == "a" and isinstance(outcome[1], RunnerGone)
    assert outcome[1].exit.signal == "SIGKILL"


@pytest.mark.anyio
async def test_a_reader_waiting_when_the_stream_ends_gets_runner_gone() -> None:
    handle = FakeHandle()
    stream = make(handle)
    outcome: list[BaseException] = []

    async def read() -> None:
        try:
            await stream.next()
        except RunnerGone as exc:
            outcome.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            handle.exit()
            stream.end()
    assert len(outcome) == 1


@pytest.mark.anyio
async def test_close_forgets_the_request_and_drops_what_was_queued() -> None:
    handle = FakeHandle()
    stream = make(handle)
    stream.put(*chunk("a", 1))
    stream.close()
    stream.put(GenerationDone(7, 1, 1, 0.0, 0.0, 0.0, 0, "stop"), b"")  # after the close
    assert handle.closed == [7]
    assert stream.next_nowait() is None


def test_chunks_merged_for_a_slow_client_keep_every_field() -> None:
    """A client that fell behind gets one frame for the chunks it missed: the
    reasoning, tool calls and logprobs of each are in it, in order."""
    from ipc.messages import TextChunk, TokenLogprob, ToolCall
    from supervisor.registry.requests import merged_chunks

    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    chunks = [
        TextChunk(7, "a", 1, "think ", None, [TokenLogprob("a", -0.5)], 12, 4),
        TextChunk(7, "", 2, tool_calls=[call], logprobs=[TokenLogprob("<tc>", -0.1)]),
        TextChunk(7, "b", 3, reasoning="more", logprobs=[TokenLogprob("b", -1.0, [("c", -2.0)])]),
    ]
    merged = merged_chunks(7, chunks)
    assert (merged.request_id, merged.text, merged.generation_tokens) == (7, "ab", 3)
    assert merged.reasoning == "think more"
    assert merged.tool_calls == [call]
    assert merged.logprobs is not None
    assert [e.token for e in merged.logprobs] == ["a", "<tc>", "b"]
    assert merged.logprobs[2].top == [("c", -2.0)]
    assert (merged.prompt_tokens, merged.cached_tokens) == (12, 4)  # the first frame's
    empty = TextChunk(0, "", 0)
    left = [f for f in TextChunk.__struct_fields__ if getattr(merged, f) == getattr(empty, f)]
    assert not left, f"fields the merge drops: {left}"
    plain = merged_chunks(7, [TextChunk(7, "x", 1), TextChunk(7, "y", 2)])
    assert plain.tool_calls is None and plain.logprobs is None and plain.reasoning == ""
