"""OpenAI's chat and text completions as dialects of the request path:
``POST /v1/chat/completions`` and ``POST /v1/completions``. The bodies are
:mod:`~supervisor.fronts.http.openai_requests`', the answers
:mod:`~supervisor.fronts.http.openai_replies`'."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from supervisor.config import SupervisorConfig
from supervisor.fronts.http.dialect import CompletionCall
from supervisor.fronts.http.images import check_images
from supervisor.fronts.http.openai_replies import OpenAIAnswer
from supervisor.fronts.http.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_call,
)
from supervisor.fronts.http.requests import read_json
from supervisor.fronts.http.streaming import OPENAI, Framing
from supervisor.metrics import Front


class OpenAIChat:
    """``POST /v1/chat/completions``."""

    framing: Framing = OPENAI
    front: Front = "openai"

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._decoder = msgspec.json.Decoder(ChatCompletionRequest)

    async def parse(self, request: Request) -> CompletionCall:
        body = await read_json(request, self._decoder, self.config)
        call = completion_call(body)
        check_images(call.messages, call.remote_images, self.config)
        return call

    def answer(self, call: CompletionCall, model: str) -> OpenAIAnswer:
        return OpenAIAnswer(call, model)


class OpenAIText:
    """``POST /v1/completions``."""

    framing: Framing = OPENAI
    front: Front = "openai"

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._decoder = msgspec.json.Decoder(CompletionRequest)

    async def parse(self, request: Request) -> CompletionCall:
        body = await read_json(request, self._decoder, self.config)
        return completion_call(body)

    def answer(self, call: CompletionCall, model: str) -> OpenAIAnswer:
        return OpenAIAnswer(call, model)
