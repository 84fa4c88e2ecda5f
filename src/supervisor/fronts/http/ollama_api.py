"""Ollama's native API (``/api/...``), for the clients written for Ollama:
``/api/chat`` and ``/api/generate`` on the one request path, and what Ollama
says about its models (``/api/tags``, ``/api/ps``, ``/api/show``,
``/api/version``). Here are the routes and the two dialects (a body read into
a call, or into the load or unload an empty body asks for); the bodies'
translation and the answers' shapes are
:mod:`supervisor.fronts.http.ollama_chat`'s.

Models here are references in the daemon's config (or, with
``load_on_demand = "any"``, any reference), loaded on first use: ``/api/pull``
has nothing to fetch and says so; creating, copying, pushing or deleting a
model are a clear 501. Embeddings (``/api/embed``, ``/api/embeddings``) are
:mod:`supervisor.fronts.http.embeddings`'.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ipc.messages import RunnerInfo
from supervisor import __version__
from supervisor.config import SupervisorConfig
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.errors import ENCODER, ApiError, internal_error
from supervisor.fronts.http.images import check_images
from supervisor.fronts.http.ollama_chat import (
    MAX_KEEP_ALIVE_S,
    ChatBody,
    GenerateBody,
    KeepAlive,
    OllamaAnswer,
    OllamaCall,
    chat_call,
    generate_call,
    keep_alive_seconds,
    model_name,
    rfc3339,
)
from supervisor.fronts.http.openai_requests import Strict, bad
from supervisor.fronts.http.requests import ApiKey, Handler, guarded, read_json
from supervisor.fronts.http.routes import InfoRoutes
from supervisor.fronts.http.streaming import Framing, ndjson
from supervisor.fronts.model_facts import ModelFacts, model_facts
from supervisor.metrics import Front

log = structlog.get_logger("supervisor.http")

OLLAMA_API_VERSION = "0.12.11"
"""The Ollama release whose API we follow, as ``/api/version`` gives it:
clients turn features on by this number (tools, ``think``, structured
``format``, tool call ids and ``logprobs``, which came in 0.12.10 and
0.12.11), so it names the newest API we follow in full, not a later one."""

NEVER_S = (2**63 - 1) / 1e9
"""How far off a model that is never unloaded expires: Ollama's longest
duration (its ``keep_alive`` -1), about 292 years."""

RUNNING = frozenset({"starting", "loading", "ready", "busy", "stopping"})
"""The states ``/api/ps`` lists: a runner that holds (or is taking) memory."""

NOTHING_TO_PULL = "models load by reference on first use: there is nothing to pull"
NOT_BLOBS = "models are references in the daemon's config ([[models]]), not blobs stored here"
REFUSED: dict[str, str] = {
    "/api/create": f"{NOT_BLOBS}: add a [[models]] entry (name, model) instead",
    "/api/copy": f"{NOT_BLOBS}: for a second name, add a [[models]] entry with the same model",
    "/api/push": f"{NOT_BLOBS}: there is nothing to push",
    "/api/delete": f"{NOT_BLOBS}: there is nothing to delete (to free a model's memory, "
    "unload it: keep_alive 0, or mlx-supervisor unload NAME)",
    "/api/blobs/{digest}": f"{NOT_BLOBS}: there are none to upload",
}
METHODS = {"/api/delete": ["DELETE"], "/api/blobs/{digest}": ["HEAD", "POST"]}


def routes(completions: Completions, info: InfoRoutes, key: ApiKey) -> list[Route]:
    """The Ollama API's routes."""
    api = OllamaInfo(completions, info)

    def route(path: str, handler: Handler, methods: list[str]) -> Route:
        return Route(path, guarded(handler, key, OLLAMA), methods=methods)

    config = completions.config
    return [
        Route("/api/chat", OllamaRoute(api, OllamaChat(config)), methods=["POST"]),
        Route("/api/generate", OllamaRoute(api, OllamaGenerate(config)), methods=["POST"]),
        route("/api/version", api.version, ["GET"]),
        route("/api/tags", api.tags, ["GET"]),
        route("/api/ps", api.ps, ["GET"]),
        route("/api/show", api.show, ["POST"]),
        route("/api/pull", api.pull, ["POST"]),
        *(route(path, refusal(message), METHODS.get(path, ["POST"]))
          for path, message in REFUSED.items()),
    ]  # fmt: skip


def refusal(message: str) -> Handler:
    async def refuse(request: Request) -> Response:
        raise ApiError(501, message, type="not_implemented", code="not_implemented")

    return refuse


def json_response(body: Any, status: int = 200) -> Response:
    return Response(ENCODER.encode(body), status, media_type="application/json")


def not_found(model: str) -> ApiError:
    return ApiError(404, f"model '{model}' not found", type="not_found_error",
                    code="unknown_model", param="model")  # fmt: skip


# --- chat and generate -----------------------------------------------------------


class OllamaFraming:
    """Ollama's: JSON lines, no keep-alives (every line is an object its
    clients read), and errors as ``{"error": "message"}``, the message
    led by the field at fault when it does not name it (Ollama's errors have
    no ``param``)."""

    media_type = "application/x-ndjson"

    def comment(self, text: str) -> bytes | None:
        return None

    def error_body(self, error: ApiError) -> bytes:
        message = error.message
        if error.param and error.param not in message:
            message = f"{error.param}: {message}"
        return ENCODER.encode({"error": message})

    def error_event(self, error: ApiError, call: object = None) -> bytes:
        return ndjson(self.error_body(error))


OLLAMA = OllamaFraming()


class ModelOp(msgspec.Struct, frozen=True):
    """A body with no messages (no prompt): Ollama's way to load a model, or,
    with ``keep_alive`` 0, to unload it. ``generate``: it came to
    ``/api/generate`` (its answer has a ``response``, not a ``message``)."""

    model: str
    keep_alive_s: KeepAlive
    generate: bool

    @property
    def unload(self) -> bool:
        return self.keep_alive_s == 0


class OllamaRequests:
    """``POST /api/chat`` (and, as :class:`OllamaGenerate`, ``/api/generate``):
    :meth:`read` gives the call a body asks for, or the model operation of a
    body with nothing to answer (no messages, no prompt)."""

    generate = False

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._decoder: msgspec.json.Decoder[ChatBody | GenerateBody] = msgspec.json.Decoder(
            GenerateBody if self.generate else ChatBody
        )

    async def read(self, request: Request) -> OllamaCall | ModelOp:
        """Raises ApiError, ClientDisconnect."""
        received_at = time.perf_counter()
        body = await read_json(request, self._decoder, self.config)
        body.model = model_name(body.model)
        check_model(body.model)
        if isinstance(body, GenerateBody):
            if body.prompt or body.images:  # an image alone is a prompt too
                return with_images(generate_call(body, received_at), self.config)
        elif body.messages:
            return with_images(chat_call(body, received_at), self.config)
        return ModelOp(body.model, keep_alive_seconds(body.keep_alive), self.generate)

    def answer(self, call: CompletionCall, model: str) -> OllamaAnswer:
        return OllamaAnswer(call, model, self.generate)


def with_images(call: OllamaCall, config: SupervisorConfig) -> OllamaCall:
    """``call``, its images held to the limits (Ollama's are all inline).
    Raises ApiError."""
    check_images(call.messages, call.remote_images, config)
    return call


class OllamaChat(OllamaRequests):
    """``POST /api/chat``."""


class OllamaGenerate(OllamaRequests):
    """``POST /api/generate``."""

    generate = True


def check_model(model: str) -> None:
    if not model:
        raise bad("model", "model is required")


class OllamaRoute:
    """The ASGI app of ``/api/chat`` or ``/api/generate``. A body with
    messages (a prompt) goes the one request path, read once, here
    (:class:`ReadCall`); one without is Ollama's way to load the model, or
    with ``keep_alive`` 0 to unload it, and is answered here, as Ollama
    answers it (``done_reason`` "load" or "unload")."""

    def __init__(self, api: OllamaInfo, dialect: OllamaRequests) -> None:
        self.api = api
        self.completions = api.completions
        self.dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            self.completions.key.check(request)
            asked = await self.dialect.read(request)
        except ApiError as err:
            await error_response(err)(scope, receive, send)
            return
        except ClientDisconnect:
            return  # no one is left to answer
        except Exception as exc:  # a fault boundary: the daemon outlives any request
            log.exception("http_request_failed", path=scope["path"])
            await error_response(internal_error(exc))(scope, receive, send)
            return
        if isinstance(asked, OllamaCall):
            await self.completions.serve(scope, receive, send, ReadCall(self.dialect, asked))
            return
        model_op = guarded(functools.partial(self.api.model_op, asked), None, OLLAMA)
        await (await model_op(request))(scope, receive, send)


def error_response(error: ApiError) -> Response:
    return Response(OLLAMA.error_body(error), error.status, error.headers,
                    media_type="application/json")  # fmt: skip


class ReadCall:
    """The :class:`~supervisor.fronts.http.dialect.Dialect` of one request
    whose body :class:`OllamaRoute` has read: its call, answered in the
    dialect's shapes."""

    framing: Framing = OLLAMA
    front: Front = "ollama"

    def __init__(self, dialect: OllamaRequests, call: OllamaCall) -> None:
        self.dialect = dialect
        self.call = call

    async def parse(self, request: Request) -> CompletionCall:
        return self.call

    def answer(self, call: CompletionCall, model: str) -> OllamaAnswer:
        return self.dialect.answer(call, model)


# --- what Ollama says about its models -------------------------------------------


class ShowBody(Strict, kw_only=True):
    model: str = ""
    name: str = ""  # Ollama's older name for model
    verbose: bool | None = None  # tensors and the tokenizer's lists: there are none to show


class PullBody(Strict, kw_only=True):
    model: str = ""
    name: str = ""
    stream: bool | None = None
    insecure: Any = None  # Ollama ignores these three too
    username: Any = None
    password: Any = None


class Listed(msgspec.Struct, frozen=True):
    """A model ``/api/tags`` lists: its name, reference, when it appeared,
    and its runner when it is loaded."""

    name: str
    reference: str
    modified_at: float
    runner: RunnerInfo | None = None


class OllamaInfo:
    """Ollama's model endpoints and its load and unload by empty request,
    over the daemon's models: loaded ones, then configured ones."""

    def __init__(self, completions: Completions, info: InfoRoutes) -> None:
        self.completions = completions
        self.info = info
        self.config = completions.config
        self._show_decoder = msgspec.json.Decoder(ShowBody)
        self._pull_decoder = msgspec.json.Decoder(PullBody)

    async def version(self, request: Request) -> Response:
        return json_response({"version": OLLAMA_API_VERSION, "mlx_supervisor": __version__})

    def _listed(self) -> list[Listed]:
        status = self.info.status()
        started = time.time() - status.supervisor.uptime_s
        listed = [Listed(r.name, r.model, r.started_at or started, r) for r in status.runners]
        names = {model.name for model in listed}
        listed += [Listed(m.name, m.model, started) for m in self.config.models
                   if m.name not in names]  # fmt: skip
        return listed

    def _reference(self, name: str) -> str | None:
        """The reference a client's ``name`` stands for: a loaded or configured
        model's (by its name or reference), else, with ``load_on_demand =
        "any"``, the name itself; None when no such model may be served."""
        for model in self._listed():
            if name in (model.name, model.reference):
                return model.reference
        entry = self.completions.registry.find(name)  # an alias
        if entry is not None:
            return entry.spec.model
        configured = self.config.model_config(name)
        if configured is not None:
            return configured.model
        return name if self.config.load_on_demand == "any" else None

    async def _described(self, name: str, reference: str) -> dict[str, Any]:
        """What ``/api/tags`` and ``/api/ps`` say of every model. The digest is
        the SHA-256 of the reference (stable, but no digest of the weights:
        a model here is its reference)."""
        facts = await anyio.to_thread.run_sync(model_facts, reference)
        return {
            "name": name,
            "model": name,
            "size": facts.size_bytes or 0,
            "digest": hashlib.sha256(reference.encode()).hexdigest(),
            "details": details(reference, facts),
        }

    async def tags(self, request: Request) -> Response:
        """Every model, and each alias as a model of its own (as a copy made
        by ``ollama cp`` shows)."""
        models = [{**await self._described(name, m.reference),
                   "modified_at": rfc3339(m.modified_at)}
                  for m in self._listed() for name in (m.name, *self._aliases(m.name))]  # fmt: skip
        return json_response({"models": models})

    def _aliases(self, name: str) -> list[str]:
        """The aliases of the model ``name`` (a model's aliases are its config's)."""
        configured = self.config.model_config(name)
        return list(configured.aliases) if configured and configured.name == name else []

    async def ps(self, request: Request) -> Response:
        models = []
        for model in self._listed():
            runner = model.runner
            if runner is None or runner.state not in RUNNING:
                continue
            shown = await self._described(model.name, model.reference)
            facts = await anyio.to_thread.run_sync(model_facts, model.reference)
            # Unified memory: all of a runner's memory is the GPU's (Ollama: "100% GPU").
            memory = runner.mlx_active_bytes or runner.rss_bytes or shown["size"]
            shown.update(size=memory, size_vram=memory, expires_at=rfc3339(expires_at(runner)),
                         context_length=facts.context_length or 0)  # fmt: skip
            models.append(shown)
        return json_response({"models": models})

    async def show(self, request: Request) -> Response:
        body = await read_json(request, self._show_decoder, self.config)
        name = model_name(body.model or body.name)
        if not name:
            raise bad("model", "model is required")
        reference = self._reference(name)
        if reference is None:
            raise not_found(name)
        facts = await anyio.to_thread.run_sync(model_facts, reference)
        capabilities = await anyio.to_thread.run_sync(template_capabilities, facts.path)
        model_info: dict[str, Any] = {}
        if facts.architecture:
            model_info["general.architecture"] = facts.architecture
            if facts.context_length:
                model_info[f"{facts.architecture}.context_length"] = facts.context_length
        listed = next((m for m in self._listed() if m.reference == reference), None)
        return json_response({
            "modelfile": "", "parameters": "", "template": "",
            "details": details(reference, facts), "model_info": model_info,
            "capabilities": ["completion", *capabilities],
            "modified_at": rfc3339(listed.modified_at if listed else time.time()),
        })  # fmt: skip

    async def pull(self, request: Request) -> Response:
        """Nothing to fetch: a model that may be served loads by reference on
        first use. A stream (the default) says so before its "success"."""
        body = await read_json(request, self._pull_decoder, self.config)
        name = model_name(body.model or body.name)
        if not name:
            raise bad("model", "model is required")
        if self._reference(name) is None:
            raise not_found(name)
        if body.stream is False:
            return json_response({"status": "success"})
        lines = [{"status": NOTHING_TO_PULL}, {"status": "success"}]
        return Response(b"".join(ndjson(ENCODER.encode(line)) for line in lines),
                        media_type=OLLAMA.media_type)  # fmt: skip

    async def model_op(self, op: ModelOp, request: Request) -> Response:
        """Load ``op``'s model and apply its keep_alive (the idle timer starts
        again), or unload it (:meth:`_unload`). Raises RequestError (the
        load's), ApiError (404: no such model; 409: it is pinned)."""
        note = None
        if op.unload:
            note = await self._unload(op.model)
        else:
            entry = await self.completions.model_for(op.model, anyio.Event())
            if entry is not None:
                await self.completions.keep_alive(entry, op.keep_alive_s)
        words = {"response": ""} if op.generate else {"message": {"role": "assistant",
                                                                  "content": ""}}  # fmt: skip
        answer = {"model": op.model, "created_at": rfc3339(time.time()), **words, "done": True,
                  "done_reason": "unload" if op.unload else "load"}  # fmt: skip
        if note is not None:
            answer["supervisor"] = {"note": note}
        return json_response(answer)

    async def _unload(self, name: str) -> str | None:
        """Unload the model ``name`` now when nothing holds it; one in use (a
        request in flight or in line, or still loading) unloads once it is
        idle, as keep-alive expiry takes it, and the note returned says so.
        One not loaded has nothing to unload. Raises ApiError: 404 (no such
        model), 409 (pinned: keep_alive does not unload it)."""
        entry = self.completions.registry.find(name)
        if entry is None:
            if self._reference(name) is None:
                raise not_found(name)
            return None
        if entry.spec.pinned:
            raise ApiError(409, f"{entry.name} is pinned: keep_alive 0 does not unload it "
                           f"(mlx-supervisor unload {entry.name} does)",
                           code="pinned", param="keep_alive")  # fmt: skip
        in_use = not entry.evictable and entry.state != "stopping"
        await self.completions.keep_alive(entry, 0)
        return f"{entry.name} is in use: it unloads once its requests end" if in_use else None


def details(reference: str, facts: ModelFacts) -> dict[str, Any]:
    """Ollama's ``details`` of a model: ``parent_model`` is its reference,
    ``format`` "gguf" for a GGUF file, else "mlx"; the parameter count is
    not known (empty)."""
    gguf = any(p.lower().endswith(".gguf") for p in (reference, facts.path or ""))
    family = facts.architecture or ""
    return {
        "parent_model": reference,
        "format": "gguf" if gguf else "mlx",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": facts.quantization or "",
    }


def expires_at(runner: RunnerInfo) -> float:
    """When ``runner``'s model will be unloaded for want of use: keep-alive
    after its last use (from now while it is busy); never (``NEVER_S`` off)
    when it is pinned or has no keep-alive, or one longer than any the config
    takes (:data:`MAX_KEEP_ALIVE_S`), or not a finite one."""
    now = time.time()
    if runner.state == "stopping":
        return now
    keep_alive_s = runner.keep_alive_s
    if runner.pinned or not 0 < keep_alive_s <= MAX_KEEP_ALIVE_S:
        return now + NEVER_S
    busy = runner.active_requests > 0 or runner.last_used_at is None
    return (now if busy else runner.last_used_at or now) + keep_alive_s


@functools.lru_cache(maxsize=64)
def template_capabilities(path: str | None) -> tuple[str, ...]:
    """What a model's chat template says it can do beyond completion, read as
    Ollama reads its templates: "tools" when it renders ``tools``, "thinking"
    when it has a thinking switch or tags. () when there is no template."""
    template = chat_template(Path(path)) if path else ""
    found = []
    if "tools" in template:
        found.append("tools")
    if any(mark in template for mark in ("enable_thinking", "<think>", "reasoning_content")):
        found.append("thinking")
    return tuple(found)


def chat_template(directory: Path) -> str:
    """The chat template in a model's directory ("" when none can be read)."""
    try:
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""
