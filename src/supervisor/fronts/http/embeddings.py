"""The embeddings routes: OpenAI's ``POST /v1/embeddings`` and Ollama's ``POST
/api/embed`` (and its older ``POST /api/embeddings``), each a translation of
its body onto the registry's one embed request (:meth:`Registry.embed`) and of
the vectors back into its own shape.

The model is loaded on demand, as for a chat. Whether it is an embedding model
is its runner's to say (sentence-transformers pooling in its directory): a
chat model answers 400 naming why, and so does an embedding model asked to
chat (on the chat routes). The runner sends each vector as float32 bytes;
OpenAI's ``encoding_format`` "base64" is their base64, "float" their values.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.messages import Embeddings
from supervisor.fronts.http.completions import Completions
from supervisor.fronts.http.errors import ENCODER
from supervisor.fronts.http.ollama_api import OLLAMA, check_model
from supervisor.fronts.http.ollama_chat import keep_alive_seconds, model_name
from supervisor.fronts.http.openai_requests import Strict, bad
from supervisor.fronts.http.requests import ApiKey, guarded, read_json
from supervisor.registry.entries import ModelEntry, RequestError
from supervisor.registry.requests import MAX_EMBED_DIMENSIONS, MAX_TOKEN_ID
from supervisor.waiting import beside, wait_unless

__all__ = ["MAX_INPUTS", "routes"]

MAX_INPUTS = 2048
"""Inputs one request may give (OpenAI's limit)."""

Dimensions = Annotated[int, msgspec.Meta(ge=1, le=MAX_EMBED_DIMENSIONS)]


class EmbeddingsBody(Strict, kw_only=True):
    """``POST /v1/embeddings``: ``input`` a text, a list of texts, a list of
    token ids or a list of such lists."""

    model: str
    input: str | list[Any]
    dimensions: Dimensions | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class OllamaEmbedBody(Strict, kw_only=True):
    """``POST /api/embed``: ``truncate`` (default true) cuts an input over
    the model's length instead of refusing it. ``options`` are accepted and
    ignored (they tune generation)."""

    model: str
    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: Dimensions | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsBody(Strict, kw_only=True):
    """``POST /api/embeddings``, Ollama's older route: one ``prompt``."""

    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


def openai_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's ``input`` as the runner takes it: texts, or lists of token ids.

    Raises:
        ApiError: an empty list, too many inputs, or a mix of kinds.
    """
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad("input", "input is an empty list: give a text, or a list of them")
    ids = [t for item in value for t in (item if isinstance(item, list) else [item])]
    if any(is_token_id(t) and not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise bad("input", f"input: token ids are 0 to {MAX_TOKEN_ID}")
    if all(isinstance(item, str) for item in value):
        inputs: list[str | list[int]] = list(value)
    elif all(is_token_id(item) for item in value):
        inputs = [list(value)]
    elif all(isinstance(item, list) and all(is_token_id(t) for t in item) for item in value):
        inputs = list(value)
    else:
        raise bad("input", "input must be a text, a list of texts, a list of token ids or a "
                  "list of lists of token ids")  # fmt: skip
    if len(inputs) > MAX_INPUTS:
        raise bad("input", f"input has {len(inputs)} items, over {MAX_INPUTS}")
    return inputs


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def client_gone() -> Response:
    """What an embed whose client left answers (no one reads it)."""
    return Response(status_code=204)


def json_response(body: Any) -> Response:
    return Response(ENCODER.encode(body), media_type="application/json")


class EmbeddingRoutes:
    """The embeddings routes over ``completions``' registry (and its
    loading on demand).

    Args:
        completions: the HTTP front's request path (model lookup and load, keep-alive).
    """

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.config = completions.config
        self._openai = msgspec.json.Decoder(EmbeddingsBody)
        self._embed = msgspec.json.Decoder(OllamaEmbedBody)
        self._legacy = msgspec.json.Decoder(OllamaEmbeddingsBody)

    async def _model(self, model: str) -> ModelEntry:
        """``model``, loaded. Raises RequestError."""
        entry = await self.completions.model_for(model, anyio.Event())
        if entry is None:  # only a cancel gives none, and nothing cancels this one
            raise RequestError("internal", f"{model} was not found or loaded")
        return entry

    async def _vectors(
        self,
        request: Request,
        entry: ModelEntry,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        truncate: bool = False,
    ) -> Embeddings | None:
        """The registry's embed of ``inputs``, or None when the client leaves
        first (the runner is then told to drop the request's rows)."""
        gone = anyio.Event()
        answer: list[Embeddings] = []

        async def watch() -> None:  # the body is read: the next message is the disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def embed() -> None:
            answer.append(await self.completions.registry.embed(entry, inputs, dimensions,
                                                                truncate))  # fmt: skip

        await beside(watch, lambda: wait_unless(gone, embed))
        return answer[0] if answer else None

    async def openai(self, request: Request) -> Response:
        """``POST /v1/embeddings``."""
        body = await read_json(request, self._openai, self.config)
        if not body.model:
            raise bad("model", "model is required")
        inputs = openai_inputs(body.input)
        entry = await self._model(body.model)
        answer = await self._vectors(request, entry, inputs, body.dimensions)
        if answer is None:
            return client_gone()
        base64_wanted = body.encoding_format == "base64"
        vectors: list[Any] = (
            [base64.b64encode(v).decode("ascii") for v in answer.vectors]
            if base64_wanted
            else answer.floats()
        )
        return json_response({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": vector}
                     for i, vector in enumerate(vectors)],
            "model": body.model,
            "usage": {"prompt_tokens": answer.prompt_tokens,
                      "total_tokens": answer.prompt_tokens},
        })  # fmt: skip

    async def ollama_embed(self, request: Request) -> Response:
        """``POST /api/embed``: no input loads the model (and embeds nothing)."""
        started = time.perf_counter()
        body = await read_json(request, self._embed, self.config)
        model = model_name(body.model)
        check_model(model)
        inputs: list[str | list[int]] = (
            [body.input] if isinstance(body.input, str) else list(body.input or [])
        )
        if len(inputs) > MAX_INPUTS:
            raise bad("input", f"input has {len(inputs)} items, over {MAX_INPUTS}")
        entry = await self._model(model)
        loaded = time.perf_counter()
        answer = Embeddings(0)
        if inputs:
            truncate = body.truncate is None or body.truncate
            answered = await self._vectors(request, entry, inputs, body.dimensions, truncate)
            if answered is None:
                return client_gone()
            answer = answered
        await self.completions.keep_alive(entry, keep_alive_seconds(body.keep_alive))
        return json_response({
            "model": body.model,
            "embeddings": answer.floats(),
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": int((loaded - started) * 1e9),
            "prompt_eval_count": answer.prompt_tokens,
        })  # fmt: skip

    async def ollama_embeddings(self, request: Request) -> Response:
        """``POST /api/embeddings``: one prompt's vector (none for no prompt,
        which only loads the model), cut to the model's length as Ollama does."""
        body = await read_json(request, self._legacy, self.config)
        model = model_name(body.model)
        check_model(model)
        entry = await self._model(model)
        vector: list[float] = []
        if body.prompt:
            answer = await self._vectors(request, entry, [body.prompt], truncate=True)
            if answer is None:
                return client_gone()
            vector = answer.floats()[0]
        await self.completions.keep_alive(entry, keep_alive_seconds(body.keep_alive))
        return json_response({"embedding": vector})


def routes(completions: Completions, key: ApiKey) -> list[Route]:
    """``/v1/embeddings`` (OpenAI's errors) and ``/api/embed``,
    ``/api/embeddings`` (Ollama's)."""
    api = EmbeddingRoutes(completions)
    return [
        Route("/v1/embeddings", guarded(api.openai, key), methods=["POST"]),
        Route("/api/embed", guarded(api.ollama_embed, key, OLLAMA), methods=["POST"]),
        Route("/api/embeddings", guarded(api.ollama_embeddings, key, OLLAMA), methods=["POST"]),
    ]
