"""A request's generated text split into what it is: the answer's content, the
model's reasoning, and its tool calls.

mlx-lm knows each model family's markers: its ``TokenizerWrapper`` finds the
thinking tags in the vocabulary (``has_thinking``, ``think_start``/``think_end``)
and the tool-call tags and parser from the chat template (``tool_call_start``,
``tool_call_end``, ``tool_parser``, one of ``mlx_lm.tool_parsers``), and
``mlx_lm.generate.make_text_state_machine`` builds the text state machine that
``mlx_lm.server`` runs over the decoded text (states ``normal``, ``reasoning``,
``tool``; the markers stripped; text that might be the start of a marker held
back). :class:`OutputSplitter` runs that same machine, one per request, and
adds what the server leaves out: a tool-call block is parsed the moment it
closes (with a JSON fallback when the family's parser cannot read it), and a
block the model broke or never closed is reported as invalid, never dropped
and never passed off as content.

Where the splitter differs from ``mlx_lm.server``: with no tools in the request,
or ``tool_choice`` "none", tool-call text is content, tags and all (the server
strips it and parses it anyway); and for a model whose template has no
tool-call syntax, ``tool_choice`` "required" or a named function reads the
whole answer as the call, in JSON (``{"name": ..., "arguments": {...}}``, or a
list of them), which is what constrained decoding makes such a model write.

Such a model may also call under ``tool_choice`` "auto", as Llama 3.x does:
its answer is then the call, in the same JSON with no tags (``"parameters"``
or ``"arguments"``). An answer whose first non-space character is ``{`` or
``[`` is held back to its end and read then: the calls if it is calls of the
request's tools, otherwise the content, unchanged. Such an answer streams in
one piece at its end (a stop string in it cuts it only then, and does not end
the generation early); any other answer streams as it comes. With a JSON
``response_format`` the answer is the format's JSON, never read as a call.

:func:`reasoning_budget_processor` ends a model's thinking after a number of
tokens by forcing ``think_end``: a logits processor, which is the one place in
this module that touches mlx (lazily, inside it).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from ipc.messages import ChatOptions, ToolCall

__all__ = [
    "OutputSplitter",
    "Parts",
    "ReasoningBudget",
    "prompt_ends_in_reasoning",
    "reasoning_budget_processor",
]

# The states of mlx-lm's text state machine that carry the answer's parts; text
# in any other state (the headers of some response formats) is markup, dropped.
NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"


@dataclass
class Parts:
    """What one piece of generated text turned out to be. ``content`` goes on
    to the stop-string logic; ``tool_calls`` are whole calls, each released
    the moment its block closed."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class _ToolCallsOff:
    """The tokenizer as ``make_text_state_machine`` should see it when the
    request's tool calls are off: no tool-call transitions, so tool-call text
    stays in the state it was written in (content, or reasoning)."""

    has_tool_calling = False

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def prompt_ends_in_reasoning(tokenizer: Any, prompt_tokens: list[int]) -> bool:
    """Whether the prompt leaves the model inside a think block (a template
    that opens ``<think>`` in the generation prompt), decided as
    ``mlx_lm.server`` does: the last think start comes after the last end."""
    if not tokenizer.has_thinking:
        return False
    return bool(
        tokenizer.rfind_think_start(prompt_tokens) > tokenizer.rfind_think_end(prompt_tokens)
    )


class OutputSplitter:
    """Splits one request's generated text into content, reasoning and tool
    calls, as it streams.

    ``tokenizer`` is mlx-lm's ``TokenizerWrapper`` (its thinking and tool-call
    markers and parser); ``chat`` the request's tools and ``tool_choice``;
    ``prompt_tokens`` the prompt, which may leave the model inside a think
    block. Feed it each detokenizer segment with its token (:meth:`feed`),
    then :meth:`finish`. No text that might be the start of a marker is
    released as content until the next text tells; the answer of a model
    with no tool-call syntax, free to call, is held to its end when it starts
    as JSON (it may be the call: see the module's notes).
    """

    def __init__(self, tokenizer: Any, chat: ChatOptions, prompt_tokens: list[int]) -> None:
        self._tools = chat.tools
        self._tools_on = bool(chat.tools) and chat.tool_choice != "none"
        tagged = bool(tokenizer.has_tool_calling)
        # A model with no tool-call syntax that must call: the answer is the call.
        self._answer_is_call = self._tools_on and not tagged and chat.tool_choice != "auto"
        # One that may call: an answer that starts as JSON may be the call.
        json_format = chat.response_format is not None and chat.response_format.type != "text"
        self._answer_may_be_call = (
            self._tools_on and not tagged and chat.tool_choice == "auto" and not json_format
        )
        self._tool_names = _tool_names(chat.tools or [])
        self._parser: Callable[..., Any] | None = tokenizer.tool_parser if tagged else None
        self._call_start: str = (tokenizer.tool_call_start or "") if tagged else ""
        self._call_end: str = (tokenizer.tool_call_end or "") if tagged else ""

        machine = make_text_state_machine(  # type: ignore[no-untyped-call]
            tokenizer if self._tools_on and tagged else _ToolCallsOff(tokenizer)
        )
        self._starts_in_reasoning = prompt_ends_in_reasoning(tokenizer, prompt_tokens)
        initial = tokenizer.response_initial_state or (
            REASONING if self._starts_in_reasoning else NORMAL
        )
        self._machine = machine.make_state(initial)
        self._state: str = initial
        self._block = ""  # the open tool-call block's text, markers stripped
        self._answer = ""  # the answer held back while it is, or may be, the call
        self._broken: list[str] = []  # blocks that closed broken, and a broken answer-call
        self._unfinished: str | None = None  # the block still open at the end

        # Thinking as the tokens tell it (the text lags them by the detokenizer's hold-back).
        self._think_start: tuple[int, ...] = tuple(tokenizer.think_start_tokens or ())
        self._think_end: tuple[int, ...] = tuple(tokenizer.think_end_tokens or ())
        self._thinking = self._starts_in_reasoning
        self._recent: list[int] = []
        self._reasoning_tokens = 0

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the prompt left the model inside a think block."""
        return self._starts_in_reasoning

    @property
    def in_reasoning(self) -> bool:
        """Whether the model is thinking after the last token fed (by its
        tokens: the released text may lag a token behind)."""
        return self._thinking

    @property
    def broken(self) -> str | None:
        """The tool-call text the model broke so far: the blocks that closed
        and do not parse (not a block still open, which may yet close or, once
        a stop string has ended the answer, came after its end)."""
        return "\n".join(self._broken) if self._broken else None

    @property
    def reasoning_tokens(self) -> int:
        """Tokens fed so far that belong to the model's thinking, its think
        tags included."""
        return self._reasoning_tokens

    def feed(self, segment: str, token: int) -> Parts:
        """Take the detokenizer's ``segment`` for ``token``; what of the text
        so far is now known to be content, reasoning or whole tool calls."""
        self._count(token)
        if not segment:
            return Parts()
        self._machine, segments = TextStateMachine.split(self._machine, segment)  # type: ignore[no-untyped-call]
        return self._route(segments)

    def finish(self) -> tuple[Parts, str | None]:
        """The end of the answer: the text still held back, and the tool-call
        text the model broke or left unfinished (None if there was none).

        A block still open is unfinished (``max_tokens`` came first), unless
        the family's calls have no end marker (Mistral's run to the end of the
        answer): that block is parsed now. Either way it is the last of the
        invalid text, and not :attr:`broken`: it came after any stop string."""
        self._machine, rest, state = TextStateMachine.flush(self._machine)  # type: ignore[no-untyped-call]
        parts = self._route([(state, rest)])
        if self._state == TOOL:
            text, self._block = self._block, ""
            calls = None if self._call_end else self._parse(text)
            if calls is None:
                self._unfinished = self._call_start + text
            else:
                parts.tool_calls.extend(calls)
        answer, self._answer = self._answer, ""
        if self._answer_is_call:
            calls = _calls_in_json(answer)
            if calls is not None:
                parts.tool_calls.extend(calls)
            elif answer.strip():
                self._broken.append(answer)
        elif self._answer_may_be_call:
            calls = _calls_in_json(answer)
            if calls is not None and all(call.name in self._tool_names for call in calls):
                parts.tool_calls.extend(calls)
            else:
                parts.content += answer
        invalid = [*self._broken, *([self._unfinished] if self._unfinished is not None else [])]
        return parts, ("\n".join(invalid) if invalid else None)

    def _route(self, segments: list[tuple[str | None, str]]) -> Parts:
        """Send each piece of text to its part; a tool-call block that closed
        (its state left) is parsed at once."""
        parts = Parts()
        for state, text in segments:
            if state != self._state:
                if self._state == TOOL:
                    self._close_block(parts)
                self._state = state if state is not None else NORMAL
            if self._state == NORMAL:
                if self._answer_is_call:
                    self._answer += text
                elif self._answer_may_be_call:
                    parts.content += self._hold_if_json(text)
                else:
                    parts.content += text
            elif self._state == REASONING:
                parts.reasoning += text
            elif self._state == TOOL:
                if self._tools_on:
                    self._block += text
                else:  # a response format's tool state, with the request's tools off
                    parts.content += text
        return parts

    def _hold_if_json(self, text: str) -> str:
        """The answer's ``text`` for a model that may call in plain JSON: held
        while the answer is only spaces or starts as JSON; once it starts as
        anything else, the content, what was held first."""
        self._answer += text
        head = self._answer.lstrip()
        if not head or head[0] in "{[":
            return ""
        self._answer_may_be_call = False  # prose: no call, and no more holding
        text, self._answer = self._answer, ""
        return text

    def _close_block(self, parts: Parts) -> None:
        """Parse the block just closed into calls, or record it as broken."""
        text, self._block = self._block, ""
        calls = self._parse(text)
        if calls is None:
            self._broken.append(self._call_start + text + self._call_end)
        else:
            parts.tool_calls.extend(calls)

    def _parse(self, text: str) -> list[ToolCall] | None:
        """The calls in one block: the family's parser first, then JSON."""
        if self._parser is not None:
            try:
                calls = _calls_from(self._parser(text, self._tools))
            except Exception:  # a third-party parser on text the model broke: any error
                calls = None
            if calls is not None:
                return calls
        return _calls_in_json(text)

    def _count(self, token: int) -> None:
        """Follow the think tags through the tokens, and count the thinking ones."""
        was = self._thinking
        if self._think_start:
            self._recent.append(token)
            del self._recent[: -max(len(self._think_start), len(self._think_end))]
            if not was and _ends_with(self._recent, self._think_start):
                self._thinking = True
            elif was and _ends_with(self._recent, self._think_end):
                self._thinking = False
        if was or self._thinking:
            self._reasoning_tokens += 1


def _tool_names(tools: list[dict[str, Any]]) -> frozenset[str]:
    """The names of the request's function tools."""
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)


def _ends_with(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    return len(tokens) >= len(sequence) and tuple(tokens[-len(sequence) :]) == sequence


def _tool_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall | None:
    """One call as the wire carries it, or None if it is not one: a name, and
    arguments that are a JSON object (given as one, or as its text)."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(decoded, dict):
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    # The model's own id where its format has one (Kimi's name the call they answer).
    if not isinstance(call_id, str) or not call_id:
        call_id = "call_" + secrets.token_hex(12)
    return ToolCall(id=call_id, name=name, arguments=text)


def _calls_from(parsed: Any) -> list[ToolCall] | None:
    """The calls a parser returned (one dict, or a list of them), or None if
    any of them is not a call."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        arguments = item.get("arguments", item.get("parameters"))
        call = _tool_call(item.get("name"), arguments, item.get("id"))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _calls_in_json(text: str) -> list[ToolCall] | None:
    """The JSON fallback: ``{"name": ..., "arguments": {...}}`` objects (or
    lists of them), one after another, with nothing else in ``text``."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        found = _calls_from(value)
        if found is None:
            return None
        calls.extend(found)


# --- the reasoning budget -------------------------------------------------------------


_THOUGHT, _ANSWER = "Thought ANCHOR.", "Answer ANCHOR."
"""A dummy turn's thinking and answer, rendered to see what the chat template
writes between them."""


def _newlines_after(tokenizer: Any, marker: str) -> str:
    """The newlines the chat template writes after ``marker`` (the thinking's
    end), as a model trained on it writes them: ``\\n\\n`` after Qwen3's
    ``</think>``.

    Read from the template's rendering of an answer with its thinking (the
    ``reasoning_content`` of an assistant turn, as the prompt's history is
    given); for a template that drops the thinking of its turns, from its
    source: the first ``marker`` followed by newlines (those a string literal
    writes, not a test such as ``'</think>' in content``)."""
    if not marker:
        return ""
    turns = [{"role": "user", "content": "Hi."},
             {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT}]  # fmt: skip
    try:
        rendered = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template that refuses the dummy turns: its source tells
        rendered = None
    if isinstance(rendered, str):
        thought = rendered.find(_THOUGHT)
        at = rendered.find(marker, thought) if thought >= 0 else -1
        if at >= 0:
            return _newlines_at(rendered, at + len(marker), escaped=False)
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return ""
    at = template.find(marker)
    while at >= 0:
        newlines = _newlines_at(template, at + len(marker), escaped=True)
        if newlines:
            return newlines
        at = template.find(marker, at + 1)
    return ""


def _newlines_at(text: str, at: int, *, escaped: bool) -> str:
    """The newlines that start at ``at`` in ``text``: written as they are, or
    (``escaped``) also as ``\\n``, the escape inside a Jinja string literal."""
    count = 0
    while True:
        if text.startswith("\n", at):
            at += 1
        elif escaped and text.startswith("\\n", at):
            at += 2
        else:
            return "\n" * count
        count += 1


class ReasoningBudget:
    """A logits processor that ends the model's thinking once it has spent
    ``budget`` tokens in it: then only ``forced`` (``think_end``'s tokens,
    and the newlines the template writes after it) may come, one by one.

    It keeps no Python state that needs the tokens' values: everything about
    them is computed on the device, lazily, so it never stalls the pipeline
    of ``generate_step`` or a batch. Before ``budget`` tokens have been
    generated it does nothing at all; at that point it reads where the think
    tags stand once, then follows the newest token each step.
    """

    def __init__(
        self,
        think_start: tuple[int, ...],
        think_end: tuple[int, ...],
        forced: tuple[int, ...],
        budget: int,
        starts_in_reasoning: bool,
    ) -> None:
        self.think_start = think_start
        self.think_end = think_end
        self.forced = forced
        self.budget = max(0, budget)
        self.starts_in_reasoning = starts_in_reasoning
        self._prompt_len: int | None = None
        self._seen = 0  # generated tokens whose tags are in the state below
        # Lazy scalars: where the last think start and end end (generated
        # token positions), and the position where forcing began.
        self._last_start: Any = None
        self._last_end: Any = None
        self._forced_at: Any = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        if self._prompt_len is None:  # the first call: the prompt (as far as this run sees it)
            self._prompt_len = tokens.size
        generated = tokens.size - self._prompt_len
        if self._last_start is None:
            if generated < self.budget:
                return logits  # the thinking cannot have reached the budget yet
            self._last_start = mx.array(-1 if self.starts_in_reasoning else -3)
            self._last_end = mx.array(-2)
            self._forced_at = mx.array(-(2**30))
        new = tokens[self._prompt_len :]
        self._last_start = mx.maximum(
            self._last_start, _last_match(new, self.think_start, self._seen)
        )
        self._last_end = mx.maximum(self._last_end, _last_match(new, self.think_end, self._seen))
        self._seen = generated

        thinking = self._last_start > self._last_end
        spent = generated - 1 - self._last_start
        offset = generated - self._forced_at
        forcing = (offset > 0) & (offset < len(self.forced))
        start = thinking & (spent >= self.budget) & ~forcing
        self._forced_at = mx.where(start, generated, self._forced_at)
        step = mx.clip(generated - self._forced_at, 0, len(self.forced) - 1)
        target = mx.array(self.forced)[step]
        only = mx.where(
            mx.arange(logits.shape[-1]) == target,
            mx.array(0.0, dtype=logits.dtype),
            mx.array(-float("inf"), dtype=logits.dtype),
        )
        return mx.where(start | forcing, only, logits)


def _last_match(tokens: Any, sequence: tuple[int, ...], since: int) -> Any:
    """The position of the last token of the last ``sequence`` in ``tokens``
    that ends at ``since`` or later (a lazy scalar; very negative if none)."""
    import mlx.core as mx

    none = mx.array(-(2**30))
    length, total = len(sequence), tokens.size
    first = max(since - length + 1, 0)
    count = total - first - length + 1
    if not sequence or count <= 0:
        return none
    match = tokens[first : first + count] == sequence[0]
    for k in range(1, length):
        match = match & (tokens[first + k : first + k + count] == sequence[k])
    ends = mx.arange(first + length - 1, first + length - 1 + count)
    return mx.max(mx.where(match, ends, none))


def reasoning_budget_processor(
    splitter: OutputSplitter, tokenizer: Any, max_reasoning_tokens: int | None
) -> ReasoningBudget | None:
    """A logits processor that forces ``think_end`` once the model has
    thought ``max_reasoning_tokens`` tokens (followed by the newlines its
    chat template writes after it), or None when there is no budget or the
    model has no thinking tags. ``splitter`` tells whether the prompt left the
    model thinking. One per request: it keeps the request's state."""
    if max_reasoning_tokens is None or not tokenizer.has_thinking:
        return None
    think_end = tuple(tokenizer.think_end_tokens or ())
    if not think_end:
        return None
    newlines = _newlines_after(tokenizer, tokenizer.think_end)
    forced = think_end + (
        tuple(tokenizer.encode(newlines, add_special_tokens=False)) if newlines else ()
    )
    return ReasoningBudget(
        think_start=tuple(tokenizer.think_start_tokens or ()),
        think_end=think_end,
        forced=forced,
        budget=max_reasoning_tokens,
        starts_in_reasoning=splitter.starts_in_reasoning,
    )
