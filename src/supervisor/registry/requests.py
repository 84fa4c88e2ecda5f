"""Requests to the registry's models: each one waits its turn in its model's
line (a fair queue, bounded by ``max_queue`` and ``queue_timeout_s``), then is
relayed to the runner, its frames relayed back to the client, a cancel passed
on; a request the runner died before starting is retried once."""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import msgspec

from ipc import ChannelClosed, FrameTooLarge
from ipc.messages import (
    EMBED_CANCELLED,
    CacheCleared,
    ChatMessage,
    ChatOptions,
    ClearCache,
    CountTokens,
    Embed,
    Embeddings,
    Generate,
    GenerateRequest,
    GenerationDone,
    GenerationFailed,
    RunnerCommand,
    TextChunk,
    TokenCount,
)
from ipc.messages import NO_MODEL_LOADED as NO_MODEL
from ipc.messages import Cancel as CancelCommand
from supervisor.adapters import adapter_for
from supervisor.config import SupervisorConfig
from supervisor.metrics import Front, Metrics
from supervisor.registry.defaults import with_model_defaults, with_system_prompt
from supervisor.registry.entries import (
    ModelEntry,
    QueueListener,
    RequestError,
    Waiter,
    entry_named,
    find_entry,
    refuse_if_removed,
)
from supervisor.runners.exits import ended_by_failed_step
from supervisor.runners.protocol import Runner
from supervisor.runners.requests import RequestEvent, RunnerGone
from supervisor.waiting import wait_unless

Emit = Callable[[TextChunk | GenerationDone, bytes | None], Awaitable[None]]
"""Passes one frame of a generation to its client: the event, and the body
of the runner's frame when it can be written as it is (None: encode it)."""

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256


class RequestRelay:
    """Queues requests per model and relays them to its runner.

    Args:
        config: the daemon config.
        entries: the registry's models, by name (read, never changed here).
        counters: the registry's counters.
        metrics: where every request counts.
        idle_changed: called when a model becomes busy or idle (keep-alive).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        entries: dict[str, ModelEntry],
        counters: Counter[str],
        metrics: Metrics,
        idle_changed: Callable[[], None],
    ) -> None:
        self.config = config
        self.entries = entries
        self.counters = counters
        self.metrics = metrics
        self.idle_changed = idle_changed
        self._request_ids = itertools.count(1)
        self._counting: dict[str, anyio.Lock] = {}  # per model: one token count at a time
        self._embedding: Counter[str] = Counter()  # per model: embeds in flight

    async def clear_cache(self, name: str, disk_only: bool = False) -> CacheCleared:
        """Drop the named model's prefix cache, both tiers (``disk_only``: only
        the blocks on disk); its runner stays loaded.

        Raises:
            RequestError: unknown model, or no runner ready to ask.
        """
        entry = entry_named(self.entries, name)
        handle = entry.handle
        if handle is None or not handle.alive or entry.state not in ("ready", "busy"):
            raise RequestError("not_ready", f"{name} is {entry.state}: it holds no cache")
        waiter = handle.expect(CacheCleared)
        try:
            await handle.send(ClearCache(disk_only=disk_only))
            with anyio.fail_after(self.config.decode_stall_s):
                event = await waiter.wait()
        except TimeoutError:
            raise RequestError("not_ready", f"{name} did not answer in time") from None
        except RunnerGone as gone:
            raise RequestError("runner_died", f"runner of {name} died: {gone.exit.cause}") from None
        finally:
            waiter.cancel()
        assert isinstance(event, CacheCleared)
        entry.log.info("prefix_cache_cleared", disk_only=disk_only, entries=event.entries,
                       bytes=event.bytes, disk_entries=event.disk_entries,
                       disk_bytes=event.disk_bytes)  # fmt: skip
        return event

    async def count_tokens(
        self,
        entry: ModelEntry,
        messages: list[ChatMessage] | None,
        prompt: str | None = None,
        chat: ChatOptions = ChatOptions(),  # noqa: B008 - frozen
    ) -> int:
        """How many prompt tokens a generate with these fields would have on
        ``entry``'s model (its chat template, tools and all).

        The model's load or restart is waited for (up to queue_timeout_s),
        and a model's counts go to its runner one at a time: the runner takes
        a command between two steps of its generations, so a burst of counts
        must not hold those up.

        Raises:
            RequestError: the model is crashed, failed or stopping, or not
                ready in time; its runner died or did not answer; or its
                template could not render the messages (bad_request).
        """
        try:
            with anyio.fail_after(self.config.queue_timeout_s):
                handle = await entry.wait_ready()
        except TimeoutError:
            raise RequestError("not_ready", f"{entry.name} was not ready in time") from None
        messages = with_system_prompt(messages, entry.spec.system_prompt)  # as generate sends
        request_id = next(self._request_ids)
        waiter = handle.expect(TokenCount, request_id)
        try:
            async with self._counting.setdefault(entry.name, anyio.Lock()):
                await send_request(handle, CountTokens(request_id, prompt, messages, chat))
                with anyio.fail_after(self.config.decode_stall_s):
                    event = await waiter.wait()
        except TimeoutError:
            raise RequestError("not_ready", f"{entry.name} did not answer in time") from None
        except RunnerGone as gone:
            raise RequestError("runner_died", f"runner of {entry.name} died: "
                               f"{gone.exit.cause}") from None  # fmt: skip
        finally:
            waiter.cancel()
        assert isinstance(event, TokenCount)
        if event.error == NO_MODEL:
            raise RequestError("not_ready", f"{entry.name} has no model loaded")
        if event.error is not None:
            raise RequestError("bad_request", f"the chat template of {entry.name} failed: "
                               f"{event.error}")  # fmt: skip
        return event.tokens

    async def embed(
        self,
        entry: ModelEntry,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """The vectors of ``inputs`` from ``entry``'s embedding model (see
        :meth:`_embed`), once the fields are checked; at most ``max_queue``
        embeds per model at once (past it: error ``busy``).

        Raises:
            RequestError: as :meth:`_embed`; bad_request: a token id or
                ``dimensions`` out of range; busy: too many embeds.
        """
        check_embed_fields(inputs, dimensions)
        if self._embedding[entry.name] >= self.config.max_queue:
            self.counters["requests_refused_busy"] += 1
            raise RequestError("busy", f"{entry.name} has {self._embedding[entry.name]} embed "
                               "requests in flight (max_queue)")  # fmt: skip
        self._embedding[entry.name] += 1
        try:
            return await self._embed(entry, inputs, dimensions, truncate)
        finally:
            self._embedding[entry.name] -= 1

    async def _embed(
        self,
        entry: ModelEntry,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings:
        """The vectors of ``inputs`` from ``entry``'s embedding model.

        Waits through the model's load or restart (up to queue_timeout_s);
        takes no generation slot: the runner computes the vectors in batches,
        a batch per turn of its loop. The model is busy meanwhile
        (neither expired nor evicted). A wait that ends without an answer (a
        timeout, the caller cancelled) cancels the request in the runner.

        Raises:
            RequestError: the model is crashed, failed or stopping, or not
                ready in time; its runner died or did not answer in time;
                not_ready: the model unloaded before the vectors were done;
                bad_request: not an embedding model, or inputs it refused.
        """
        refuse_if_removed(entry)
        try:
            with anyio.fail_after(self.config.queue_timeout_s):
                handle = await entry.wait_ready()
        except TimeoutError:
            raise RequestError("not_ready", f"{entry.name} was not ready in time") from None
        request_id = next(self._request_ids)
        waiter = handle.expect(Embeddings, request_id)
        entry.request_started()
        entry.touch()
        self.idle_changed()
        answered = False
        try:
            await send_request(handle, Embed(request_id, inputs, dimensions, truncate))
            # Behind other requests' batches: as long as a queue wait, and a stall more.
            with anyio.fail_after(self.config.queue_timeout_s + self.config.decode_stall_s):
                event = await waiter.wait()
            answered = True
        except TimeoutError:
            raise RequestError("not_ready", f"{entry.name} did not answer in time") from None
        except RunnerGone as gone:
            answered = True  # no runner to cancel it in
            if entry.state == "stopping":
                raise RequestError("not_ready", unloaded_mid_embed(entry.name)) from None
            raise RequestError("runner_died", f"runner of {entry.name} died: "
                               f"{gone.exit.cause}") from None  # fmt: skip
        finally:
            if not answered:  # stop the runner computing vectors for no one
                with anyio.CancelScope(shield=True), contextlib.suppress(RunnerGone):
                    await handle.send(CancelCommand(request_id))
            waiter.cancel()
            entry.request_finished()
            entry.touch()
            self.idle_changed()
        assert isinstance(event, Embeddings)
        if event.error == NO_MODEL:
            raise RequestError("not_ready", f"{entry.name} has no model loaded")
        if event.error == EMBED_CANCELLED:  # only a runner shutting down cancels on its own
            raise RequestError("not_ready", unloaded_mid_embed(entry.name))
        if event.error is not None:
            bad = event.invalid_request  # the request could not run: the caller's fault
            raise RequestError("bad_request" if bad else "generation_failed", event.error)
        return event

    async def generate(
        self,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None = None,
        *,
        front: Front = "socket",
    ) -> None:
        """Run one generation on the named model (see :meth:`_generate`), and
        count it in ``metrics``: its outcome (under the ``front`` it came in
        by), tokens, time to first text and between tokens.

        Raises:
            RequestError: unknown model, timed out, runner died, or failed.
        """
        found = find_entry(self.entries, request.name)
        if found is not None and found.name != request.name:  # an alias: the model's own name
            request = msgspec.structs.replace(request, name=found.name)
        known = request.name if request.name in self.entries else None
        record = self.metrics.request(known, front)

        async def emit_recorded(event: TextChunk | GenerationDone, body: bytes | None) -> None:
            record.observe(event)
            await emit(event, body)

        try:
            await self._generate(request, emit_recorded, cancel, on_queued)
        except RequestError as exc:
            record.finish(exc.code)
            raise
        finally:
            record.close()  # no end seen: it was cancelled

    async def _generate(
        self,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None = None,
    ) -> None:
        """Run one generation on the named model, passing each frame to ``emit``.

        The model's configured defaults fill in what the request leaves
        unset (sampling, a chat's system prompt). Waits its turn behind
        earlier requests to the same model, and through
        a load or restart, up to ``queue_timeout_s``; ``on_queued`` hears its
        place in line while it waits. More than ``max_queue`` waiting: error
        ``busy`` at once. Setting ``cancel`` stops
        it within a few tokens. If the runner dies before the first token the
        request is retried once on the restarted runner (``retry_unstarted``);
        after that it fails with the cause. If ``emit`` fails (the client
        vanished) the generation is cancelled and drained.

        Raises:
            RequestError: unknown model, timed out, runner died, or failed.
        """
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("bad_request", "give exactly one of prompt and messages")
        if request.sampling.max_tokens < 1:
            raise RequestError("bad_request", "max_tokens must be at least 1")
        stop = request.sampling.stop
        if len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise RequestError("bad_request", f"stop takes up to {MAX_STOP_STRINGS} strings "
                               f"of 1 to {MAX_STOP_CHARS} characters")  # fmt: skip
        entry = entry_named(self.entries, request.name)
        refuse_if_removed(entry)
        request = with_model_defaults(request, entry.spec)  # the config's, as it is now
        try:  # an adapter the config lists, or the base model: never a path of the client's
            adapter = adapter_for(entry.spec.adapters, entry.name, request.adapter)
        except ValueError as exc:
            raise RequestError("bad_request", str(exc)) from None
        request = msgspec.structs.replace(request, adapter="" if adapter is None else adapter)
        try:
            await self._generate_with_retry(entry, request, emit, cancel, on_queued)
        finally:
            self.idle_changed()  # its turn and its place in line are given up

    async def _generate_with_retry(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        on_queued: QueueListener | None,
    ) -> None:
        streamed = [False]
        for attempt in (1, 2):
            try:
                await self._generate_once(entry, request, emit, cancel, streamed, on_queued)
                return
            except RunnerGone as gone:
                can_retry = (
                    attempt == 1
                    and self.config.retry_unstarted
                    and not streamed[0]
                    and not cancel.is_set()
                    # A group's step that raised ended the group: the same
                    # request would end it again (and spend its restarts).
                    and not ended_by_failed_step(gone.exit)
                )
                if not can_retry:
                    self.counters["requests_failed_runner_died"] += 1
                    raise RequestError(
                        "runner_died",
                        f"runner of {entry.name} died mid-request: {gone.exit.cause}",
                    ) from None
                self.counters["requests_retried"] += 1
                entry.log.warning("request_retried", cause=gone.exit.cause)

    async def _generate_once(
        self,
        entry: ModelEntry,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
        on_queued: QueueListener | None,
    ) -> None:
        deadline = anyio.current_time() + self.config.queue_timeout_s
        no_slot = entry.slots.borrowed_tokens >= entry.slots.total_tokens
        must_wait = no_slot or not entry.serving
        if must_wait and len(entry.waiters) >= self.config.max_queue:
            self.counters["requests_refused_busy"] += 1
            raise RequestError(
                "busy", f"{entry.name} has {len(entry.waiters)} requests waiting (max_queue)"
            )
        waiter = Waiter(on_queued)
        entry.waiters.append(waiter)
        if must_wait:
            entry.log.info("request_waiting", state=entry.state, position=len(entry.waiters))
            waiter.tell(len(entry.waiters))
        acquired = False

        async def take_turn() -> None:
            nonlocal acquired
            await entry.slots.acquire_on_behalf_of(waiter)
            acquired = True

        try:
            with anyio.move_on_at(deadline):
                await wait_unless(cancel, take_turn)
        except BaseException:
            if acquired:
                entry.slots.release_on_behalf_of(waiter)
            entry.leave_queue(waiter)
            raise
        if not acquired or cancel.is_set():
            if acquired:  # its turn came just as it was cancelled
                entry.slots.release_on_behalf_of(waiter)
            entry.leave_queue(waiter)
            if cancel.is_set():  # the client cancelled or left while in line
                entry.log.info("request_left_queue", waiting=len(entry.waiters))
                await self._end_cancelled_in_line(emit)
                return
            raise RequestError("not_ready", self._timeout_message(entry))
        try:
            ready: list[Runner] = []

            async def wait_ready() -> None:
                ready.append(await entry.wait_ready())

            try:
                with anyio.move_on_at(deadline):
                    while True:
                        ready.clear()
                        await wait_unless(cancel, wait_ready)
                        # Leaving wait_unless yields: an unload may have come in between.
                        if not ready or (entry.serving and entry.handle is ready[0]):
                            break
            finally:
                entry.leave_queue(waiter)
            if not ready:
                if cancel.is_set():  # the client cancelled or left while the model loads
                    await self._end_cancelled_in_line(emit)
                    return
                raise RequestError("not_ready", self._timeout_message(entry))
            handle = ready[0]
            await self._run_request(entry, handle, request, emit, cancel, streamed)
        finally:
            entry.slots.release_on_behalf_of(waiter)

    async def _end_cancelled_in_line(self, emit: Emit) -> None:
        with contextlib.suppress(ChannelClosed):
            await emit(GenerationDone(0, 0, 0, 0.0, 0.0, 0.0, 0, "cancelled"), None)

    def _timeout_message(self, entry: ModelEntry) -> str:
        return (
            f"timed out after {self.config.queue_timeout_s:g}s waiting for {entry.name} "
            f"({entry.state})"
        )

    async def _run_request(
        self,
        entry: ModelEntry,
        handle: Runner,
        request: GenerateRequest,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
    ) -> None:
        request_id = next(self._request_ids)
        entry.request_started()
        entry.touch()
        self.idle_changed()
        failure: RunnerGone | RequestError | None = None

        async def forward_cancel() -> None:
            await cancel.wait()
            with contextlib.suppress(RunnerGone):
                await handle.send(CancelCommand(request_id))

        ended = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(forward_cancel)
                try:
                    await self._stream(entry, handle, request, request_id, emit, cancel, streamed)
                    ended = True
                except (RunnerGone, RequestError) as exc:
                    ended, failure = True, exc
                finally:
                    tg.cancel_scope.cancel()
        finally:
            if not ended:  # we were cancelled mid-request: stop the runner working for no one
                with anyio.CancelScope(shield=True), contextlib.suppress(RunnerGone):
                    await handle.send(CancelCommand(request_id))
            entry.request_finished()
            entry.touch()
            self.idle_changed()
        if failure is not None:
            raise failure

    async def _stream(
        self,
        entry: ModelEntry,
        handle: Runner,
        request: GenerateRequest,
        request_id: int,
        emit: Emit,
        cancel: anyio.Event,
        streamed: list[bool],
    ) -> None:
        """Send the request and pass its frames on until it is done.

        Chunks go out as the runner framed them (no decoding and encoding
        again); when the client falls behind, the chunks that piled up go
        out as one.
        """
        stream = handle.open_request(request_id)
        try:
            command = Generate(
                request_id, request.prompt, request.messages, request.sampling, request.cache,
                request.chat, adapter=request.adapter or None,
            )  # fmt: skip
            await send_request(handle, command)
            client_gone = False
            held: tuple[RequestEvent, bytes] | None = None
            while True:
                event, body = held if held is not None else await stream.next()
                held = None
                if isinstance(event, GenerationFailed):
                    bad = event.invalid_request  # the request could not run: the caller's fault
                    error = event.error
                    if bad and any(m.images for m in request.messages or ()):
                        error = f"{entry.name}: {error}"  # which model refused the images
                    raise RequestError("bad_request" if bad else "generation_failed", error)
                streamed[0] = True
                relayed: bytes | None = body
                if isinstance(event, TextChunk):
                    chunks = [event]
                    while (item := stream.next_nowait()) is not None:
                        if not isinstance(item[0], TextChunk):
                            held = item
                            break
                        chunks.append(item[0])
                    if len(chunks) > 1:  # the client fell behind: one frame for them all
                        event = merged_chunks(request_id, chunks)
                        relayed = None
                if not client_gone:
                    try:
                        await emit(event, relayed)
                    except (ChannelClosed, anyio.BrokenResourceError, OSError):
                        client_gone = True
                        cancel.set()
                        entry.log.info("client_gone", request_id=request_id)
                if isinstance(event, GenerationDone):
                    return
        finally:
            stream.close()


async def send_request(handle: Runner, command: RunnerCommand) -> None:
    """Send a request's command to its runner; one over the frame limit
    (images, a long prompt) fails that request alone: nothing was sent.

    Raises:
        RequestError: too_large.
        RunnerGone: the runner has exited.
    """
    try:
        await handle.send(command)
    except FrameTooLarge as exc:
        raise RequestError("too_large", f"request too large: {exc.size} bytes, over the "
                           f"{exc.limit}-byte frame limit (max_frame_bytes)") from None  # fmt: skip


MAX_TOKEN_ID = 2**31 - 1
MAX_EMBED_DIMENSIONS = 65536


def check_embed_fields(inputs: list[str | list[int]], dimensions: int | None) -> None:
    """Refuse token ids and ``dimensions`` out of any model's range (before
    they reach a frame: a huge integer cannot be encoded).

    Raises:
        RequestError: bad_request, naming the field.
    """
    if dimensions is not None and not 1 <= dimensions <= MAX_EMBED_DIMENSIONS:
        raise RequestError("bad_request", f"dimensions must be 1 to {MAX_EMBED_DIMENSIONS}, "
                           f"not {dimensions}")  # fmt: skip
    for index, item in enumerate(inputs):
        if isinstance(item, list) and not all(0 <= t <= MAX_TOKEN_ID for t in item):
            raise RequestError("bad_request", f"input[{index}]: token ids are 0 to "
                               f"{MAX_TOKEN_ID}")  # fmt: skip


def unloaded_mid_embed(name: str) -> str:
    return f"{name} was unloaded (or restarted) before the embeddings were done; send it again"


def merged_chunks(request_id: int, chunks: list[TextChunk]) -> TextChunk:
    """One frame for the chunks a client fell behind on: every field of each,
    in order (text, reasoning, tool calls, logprobs), none dropped."""
    tool_calls = [call for chunk in chunks for call in chunk.tool_calls or []]
    logprobs = [entry for chunk in chunks for entry in chunk.logprobs or []]
    return TextChunk(
        request_id,
        "".join(chunk.text for chunk in chunks),
        chunks[-1].generation_tokens,
        reasoning="".join(chunk.reasoning for chunk in chunks),
        tool_calls=tool_calls or None,
        logprobs=logprobs or None,
        prompt_tokens=chunks[0].prompt_tokens,  # only a request's first frame has them
        cached_tokens=chunks[0].cached_tokens,
    )
