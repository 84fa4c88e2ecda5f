"""The completion routes, ``POST /v1/chat/completions`` and ``POST
/v1/completions``: a request translated into the one generate request, its
model found or loaded on demand, and the generation written back as one JSON
body or as server-sent events (``stream``). Each request is a fault boundary,
and a client that leaves cancels its generation in the runner.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import anyio
import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from ipc.messages import GenerateRequest, GenerationDone, LoadProgress, TextChunk
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.errors import ApiError, internal_error
from supervisor.fronts.http.openai_replies import ENCODER, Reply, broken_tool_call
from supervisor.fronts.http.openai_requests import (
    ChatCompletionRequest,
    CompletionCall,
    CompletionRequest,
    completion_call,
)
from supervisor.fronts.http.requests import ApiKey, read_json
from supervisor.fronts.http.streaming import ResponseWriter, watch_disconnect
from supervisor.fronts.mailbox import ClientGone, Mailbox
from supervisor.registry.registry import ModelEntry, Registry, RequestError
from supervisor.waiting import beside, wait_unless

log = structlog.get_logger("supervisor.http")


class Completions:
    """Chat and text completions over ``registry``.

    Args:
        registry: the models.
        config: the daemon config (load_on_demand, limits).
        key: the API key each request must carry.
    """

    def __init__(self, registry: Registry, config: SupervisorConfig, key: ApiKey) -> None:
        self.registry = registry
        self.config = config
        self.key = key
        self._chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self._completion_decoder = msgspec.json.Decoder(CompletionRequest)

    def route(self, *, chat: bool) -> CompletionRoute:
        """The ASGI app of the chat (``chat``) or the text completion route."""
        return CompletionRoute(self, chat=chat)

    async def serve(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        """One completion request, from its first byte to its last, so that a
        client leaving cancels the work. A fault boundary: never raises."""
        writer = ResponseWriter(send, self.config.client_write_timeout_s)
        request = Request(scope, receive)
        try:
            self.key.check(request)
            call = await self._parse(request, chat=chat)
            await self._complete(call, receive, writer)
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

    async def _parse(self, request: Request, *, chat: bool) -> CompletionCall:
        """The checked request. Raises ApiError."""
        body: ChatCompletionRequest | CompletionRequest
        if chat:
            body = await read_json(request, self._chat_decoder, self.config)
        else:
            body = await read_json(request, self._completion_decoder, self.config)
        return completion_call(body)

    async def _complete(
        self, call: CompletionCall, receive: Receive, writer: ResponseWriter
    ) -> None:
        """Find or load the model, generate, and write the answer; a client
        that disconnects cancels it. Raises ApiError or RequestError."""
        cancel = anyio.Event()

        async def work() -> None:
            entry = await self._model_for(call, writer, cancel)
            if entry is not None:
                await self._generate(call, entry, writer, cancel)

        await beside(functools.partial(watch_disconnect, receive, cancel, writer), work)

    async def _model_for(
        self, call: CompletionCall, writer: ResponseWriter, cancel: anyio.Event
    ) -> ModelEntry | None:
        """The model the call names, loaded (on demand: a stream hears the
        load's progress as comments). A model being stopped (keep-alive ran
        out, or admission evicted it) is waited for, up to queue_timeout_s,
        and then found or loaded again. None if the client left meanwhile.
        Raises RequestError (unavailable, or the load failed)."""
        progress: Mailbox[LoadProgress] = Mailbox()
        found: list[ModelEntry] = []

        async def keep_alive(p: LoadProgress) -> None:
            await writer.comment(f"loading {p.name} {p.phase} {p.done}/{p.total}")

        async def load() -> None:
            listener = progress.put if call.stream else None
            deadline = anyio.current_time() + self.config.queue_timeout_s
            while True:
                entry = await self.registry.ensure_loaded(call.model, listener)
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
        self, call: CompletionCall, entry: ModelEntry, writer: ResponseWriter, cancel: anyio.Event
    ) -> None:
        """Run the generation and write it: as events while it streams, or
        whole at the end. A client that leaves cancels it in the runner; so
        does the model's first tool call when the request allows only one
        (``parallel_tool_calls`` false): the answer ends there."""
        max_tokens = call.max_tokens or entry.spec.max_tokens or self.config.max_tokens
        request = GenerateRequest(
            name=entry.name, prompt=call.prompt, messages=call.messages,
            sampling=msgspec.structs.replace(call.sampling, max_tokens=max_tokens),
            chat=call.options,
        )  # fmt: skip
        reply = Reply(call.chat, entry.name, call.include_usage, call.sampling.logprobs)
        limit_calls = 1 if call.single_tool_call else None
        dones: list[GenerationDone] = []
        queued: Mailbox[int] = Mailbox()
        cut = False  # ended at its first tool call: what follows is not the answer

        async def write(chunk: dict[str, Any] | None) -> None:
            if chunk is not None:
                await writer.event(ENCODER.encode(chunk))

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
            chunk = reply.add(event, limit_calls)
            if limit_calls is not None and len(reply.tool_calls) >= limit_calls:
                cut = True
                cancel.set()
            if call.stream and chunk is not None:
                await write(reply.role_chunk())  # the stream's first words: the role first
                await write(chunk)

        async def tell_place() -> None:
            if call.stream:
                await queued.forward(lambda position: writer.comment(f"queued {position}"))

        await beside(tell_place, functools.partial(
            self.registry.generate, request, emit, cancel, on_queued=queued.put
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
            await writer.whole(200, ENCODER.encode(reply.whole(done)))
            return
        await write(reply.role_chunk())
        await write(reply.end_chunk(done))
        if call.include_usage:
            await writer.event(ENCODER.encode(reply.usage_chunk(done)))
        await writer.event(b"[DONE]")
        await writer.end()


class CompletionRoute:
    """The ASGI app of a completion route (an object, not a function, so
    that Starlette hands it the raw ASGI messages)."""

    def __init__(self, completions: Completions, *, chat: bool) -> None:
        self.completions = completions
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.completions.serve(scope, receive, send, chat=self.chat)


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
