"""The one request path of every generating route (OpenAI's chat and text
completions, Anthropic's Messages, OpenAI's Responses, Ollama's chat and
generate): a request translated by its API's
:class:`~supervisor.fronts.http.dialect.Dialect` into the one generate
request, its model found or loaded on demand, and the generation written
back as one JSON body or as a stream, in that API's shapes. Each request is
a fault boundary, and a client that leaves cancels its generation in the
runner.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Literal

import anyio
import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from ipc.messages import ChatMessage, GenerateRequest, GenerationDone, LoadProgress, TextChunk
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.dialect import CompletionCall, Dialect
from supervisor.fronts.http.errors import ApiError, internal_error
from supervisor.fronts.http.images import RemoteImage, ready_images
from supervisor.fronts.http.openai_api import OpenAIChat, OpenAIText
from supervisor.fronts.http.openai_replies import broken_tool_call
from supervisor.fronts.http.requests import ApiKey
from supervisor.fronts.http.streaming import ResponseWriter, watch_disconnect
from supervisor.fronts.mailbox import ClientGone, Mailbox
from supervisor.registry.registry import ModelEntry, Registry, RequestError
from supervisor.waiting import beside, wait_unless

log = structlog.get_logger("supervisor.http")

NOT_SERVING = ("crashed", "failed", "restarting")  # no runner to wait for: unloaded at once
EXPIRED_S = 1e-3  # a keep-alive of 0 (unload now) for a model in use: expired once it is idle


class Completions:
    """The request path over ``registry``, for every API's dialect.

    Args:
        registry: the models.
        config: the daemon config (load_on_demand, limits).
        key: the API key each request must carry.
    """

    def __init__(self, registry: Registry, config: SupervisorConfig, key: ApiKey) -> None:
        self.registry = registry
        self.config = config
        self.key = key
        self.chat = OpenAIChat(config)
        self.text = OpenAIText(config)

    def route(self, *, chat: bool) -> CompletionRoute:
        """The ASGI app of OpenAI's chat (``chat``) or text completion route."""
        dialect: Dialect = self.chat if chat else self.text
        return CompletionRoute(self, dialect)

    def route_for(self, dialect: Dialect) -> CompletionRoute:
        """The ASGI app of a route that speaks ``dialect``."""
        return CompletionRoute(self, dialect)

    async def serve(self, scope: Scope, receive: Receive, send: Send, dialect: Dialect) -> None:
        """One request, from its first byte to its last, so that a client
        leaving cancels the work. A fault boundary: never raises."""
        writer = ResponseWriter(send, self.config.client_write_timeout_s, dialect.framing)
        request = Request(scope, receive)
        try:
            self.key.check(request)
            call = writer.call = await dialect.parse(request)
            await self.complete(call, dialect, receive, writer)
        except ApiError as err:
            await writer.fail(err)
        except RequestError as exc:
            await writer.fail(ApiError.from_request_error(exc))
        except (ClientDisconnect, ClientGone):
            pass
        except Exception as exc:  # a fault boundary: the daemon outlives any request
            log.exception("http_request_failed", path=scope["path"])
            await writer.fail(internal_error(exc))
        if writer.streaming:
            with contextlib.suppress(ClientGone):
                await writer.end()

    async def complete(
        self, call: CompletionCall, dialect: Dialect, receive: Receive, writer: ResponseWriter
    ) -> None:
        """Find or load the model, generate, and write the answer; a client
        that disconnects cancels it. Raises ApiError or RequestError."""
        cancel = anyio.Event()

        async def work() -> None:
            entry = await self.model_for(call.model, cancel, writer if call.stream else None)
            if entry is not None:
                await self.ready_images(call.messages, call.remote_images, entry)
                await self._generate(call, dialect, entry, writer, cancel)
                await self.keep_alive(entry, call.keep_alive_s)

        await beside(functools.partial(watch_disconnect, receive, cancel, writer), work)

    async def ready_images(
        self, messages: list[ChatMessage] | None, remote: list[RemoteImage], entry: ModelEntry
    ) -> None:
        """A call's images for ``entry``'s model: refused if it is known to be
        text-only, its http(s) ones fetched (see
        :func:`~supervisor.fronts.http.images.ready_images`). Raises ApiError."""
        if not remote and not any(message.images for message in messages or ()):
            return
        vision = entry.estimate.vision if entry.estimate is not None else None
        await ready_images(messages, remote, self.config, entry.name, vision)

    async def keep_alive(
        self, entry: ModelEntry, keep_alive_s: float | Literal["default"] | None
    ) -> None:
        """Apply a request's keep-alive to its model (see
        :class:`~supervisor.fronts.http.dialect.CompletionCall`). 0 unloads
        it now if nothing else holds it (no request in flight or in line), or
        if it has no runner to serve (crashed, failed, restarting); otherwise
        keep-alive expiry takes it once it is idle. A pinned model stays."""
        if keep_alive_s is None:
            return
        entry.touch()  # the idle timer starts again, as in Ollama
        if keep_alive_s == 0 and entry.spec.pinned:
            return  # pinned: only an unload unloads it
        if keep_alive_s == "default":
            configured = entry.spec.keep_alive_s
            entry.keep_alive_s = self.config.keep_alive_s if configured is None else configured
        elif keep_alive_s != 0:
            entry.keep_alive_s = max(0.0, keep_alive_s)  # negative: never (ours is 0)
        else:
            entry.keep_alive_s = EXPIRED_S
        self.registry.idle_changed()
        if keep_alive_s == 0 and (entry.evictable or entry.state in NOT_SERVING):
            with contextlib.suppress(RequestError):
                await self.registry.unload(entry.name, "keep_alive 0")

    async def model_for(
        self, model: str, cancel: anyio.Event, progress_to: ResponseWriter | None = None
    ) -> ModelEntry | None:
        """The model named ``model``, loaded (on demand: a stream given as
        ``progress_to`` hears the load's progress as keep-alive comments). A
        model being stopped (keep-alive ran out, or admission evicted it) is
        waited for, up to queue_timeout_s, and then found or loaded again.
        None if ``cancel`` was set meanwhile (the client left). Raises
        RequestError (unavailable, or the load failed)."""
        progress: Mailbox[LoadProgress] = Mailbox()
        found: list[ModelEntry] = []

        async def keep_alive(p: LoadProgress) -> None:
            if progress_to is not None:
                await progress_to.comment(f"loading {p.name} {p.phase} {p.done}/{p.total}")

        async def load() -> None:
            listener = progress.put if progress_to is not None else None
            deadline = anyio.current_time() + self.config.queue_timeout_s
            while True:
                entry = await self.registry.ensure_loaded(model, listener)
                if entry.state != "stopping":
                    break
                with anyio.move_on_after(deadline - anyio.current_time()):
                    await entry.forgotten.wait()
                    continue  # stopped and gone: find or load it again
                break  # still stopping: check_available says so
            found.append(entry)

        await beside(functools.partial(progress.forward, keep_alive),
                     functools.partial(wait_unless, cancel, load))  # fmt: skip
        if not found:
            return None
        entry = found[0]
        check_available(entry)
        return entry

    async def _generate(
        self,
        call: CompletionCall,
        dialect: Dialect,
        entry: ModelEntry,
        writer: ResponseWriter,
        cancel: anyio.Event,
    ) -> None:
        """Run the generation and write it: as events while it streams, or
        whole at the end. A client that leaves cancels it in the runner; so
        does the model's first tool call when the request allows only one
        (``parallel_tool_calls`` false): the answer ends there."""
        # Unasked, up to the cap its runner was loaded with (a reload's waits for its next load).
        cap = entry.max_tokens_cap or entry.spec.max_tokens or self.config.max_tokens
        max_tokens = call.max_tokens or cap
        length_given = ("max_tokens",) if call.max_tokens is not None else ()
        request = GenerateRequest(
            name=entry.name, prompt=call.prompt, messages=call.messages,
            sampling=msgspec.structs.replace(call.sampling, max_tokens=max_tokens),
            chat=call.options, sampling_given=(*call.sampling_given, *length_given),
            adapter=call.adapter,
        )  # fmt: skip
        answer = dialect.answer(call, entry.name)
        limit_calls = 1 if call.single_tool_call else None
        dones: list[GenerationDone] = []
        queued: Mailbox[int] = Mailbox()
        cut = False  # ended at its first tool call: what follows is not the answer

        async def emit(event: TextChunk | GenerationDone, body: bytes | None) -> None:
            nonlocal cut
            queued.close()  # no place in line after the first word
            if cancel.is_set() and not cut:  # the client left: take the rest quietly
                return
            if isinstance(event, GenerationDone):
                dones.append(event)
                return
            if cut:
                return
            framed = answer.add(event, limit_calls)
            if limit_calls is not None and answer.tool_call_count >= limit_calls:
                cut = True
                cancel.set()
            if framed:
                await writer.stream(*framed)

        async def tell_place() -> None:
            if call.stream:
                await queued.forward(lambda position: writer.comment(f"queued {position}"))

        await beside(tell_place, functools.partial(
            self.registry.generate, request, emit, cancel, on_queued=queued.put,
            front=dialect.front,
        ))  # fmt: skip
        if writer.gone or (cancel.is_set() and not cut):
            return  # the client left: nothing to write
        if not dones:
            raise RequestError("internal", "the generation ended without its last frame")
        done = dones[0]
        if cut:  # a call the runner wrote before the cancel reached it is past the answer
            done = msgspec.structs.replace(done, invalid_tool_call=None)
        if (broken := broken_tool_call(done)) is not None:
            raise broken  # a stream's last event, or the response
        if not call.stream:
            await writer.whole(200, answer.whole(done))
            return
        await writer.stream(*answer.end(done))
        await writer.end()


class CompletionRoute:
    """The ASGI app of a generating route (an object, not a function, so
    that Starlette hands it the raw ASGI messages)."""

    def __init__(self, completions: Completions, dialect: Dialect) -> None:
        self.completions = completions
        self.dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.completions.serve(scope, receive, send, self.dialect)


def check_available(entry: ModelEntry) -> None:
    """Refuse at once a model that cannot serve soon: restarting (in
    backoff), crashed, failed, or still stopping (``_model_for`` waits for a
    stop up to queue_timeout_s first). A load in progress is waited for.

    Raises:
        RequestError: not_ready (503, with Retry-After while restarting), or
            insufficient_memory (507) when admission left it failed.
    """
    state = entry.state
    if state in ("ready", "busy", "starting", "loading"):
        return
    cause = entry.failure or (entry.last_exit.cause if entry.last_exit else None)
    detail = f": {cause}" if cause else ""
    if state == "failed" and entry.load_error_code == "insufficient_memory":
        raise RequestError("insufficient_memory", f"{entry.name} is failed{detail}")
    hint = "; load it again to retry" if state in ("failed", "crashed") else ""
    error = RequestError("not_ready", f"{entry.name} is {state}{detail}{hint}")
    if state == "restarting" and entry.next_restart_at is not None:
        raise ApiError.from_request_error(error, entry.next_restart_at - time.time())
    raise error
