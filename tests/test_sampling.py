"""Per-request sampling in the engine: mlx-lm's sampler and logits processors,
log probabilities, and what a chat request gives its template (tools, tool
turns, template arguments).

builtin:tiny has random weights, so these tests check the mechanics: a
setting changes the tokens as mlx-lm's own ``generate`` with the same
sampler and processors changes them, alone, in a batch beside requests with
other settings, and after moving from alone into a batch.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors

from ipc.messages import (
    ChatMessage,
    ChatOptions,
    EngineSettings,
    Generate,
    GenerationFailed,
    ResponseFormat,
    TextChunk,
    TokenLogprob,
    ToolCall,
)
from runner.engine import build_prompt_tokens, contained
from runner.loading import LoadedModel, load_model
from runner.next_turn import next_turn_prefix
from runner.sampling import MAX_TOP_LOGPROBS, TokenTexts
from test_engine import PROMPTS, Harness, alone

GREEDY: dict[str, Any] = {}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", lambda phase, done, total: None)


def prompt_ids(model: LoadedModel, prompt: str) -> list[int]:
    return build_prompt_tokens(model.tokenizer, Generate(0, prompt=prompt))


def reference(model: LoadedModel, prompt: str, max_tokens: int, **processors: Any) -> str:
    """mlx-lm's own greedy text with ``make_logits_processors(**processors)``:
    ``generate`` shows the processors the whole prompt, as the engine does."""
    return str(mlx_lm.generate(model.model, model.tokenizer, prompt=prompt_ids(model, prompt),
                               max_tokens=max_tokens,
                               logits_processors=make_logits_processors(**processors)))  # fmt: skip


def logprobs_of(h: Harness, request_id: int) -> list[TokenLogprob]:
    return [entry for f in h.frames if isinstance(f, TextChunk) and f.request_id == request_id
            for entry in f.logprobs or []]  # fmt: skip


def failure(h: Harness, request_id: int) -> GenerationFailed:
    (failed,) = [f for f in h.frames
                 if isinstance(f, GenerationFailed) and f.request_id == request_id]  # fmt: skip
    return failed


# --- the sampler -------------------------------------------------------------------


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_at_temperature_1_sample_the_greedy_tokens(
    tiny: LoadedModel, knob: dict[str, Any]
) -> None:
    greedy = alone(tiny, PROMPTS[0], 24)[0]
    hot = {"temperature": 1.0, "seed": 3}
    assert alone(tiny, PROMPTS[0], 24, sampling=hot)[0] != greedy  # without it, it samples
    assert alone(tiny, PROMPTS[0], 24, sampling={**hot, **knob})[0] == greedy
    # In a batch beside a greedy request (no seed: a seed keeps a request out).
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    ids = [h.submit(PROMPTS[0], 24, sampling={"temperature": 1.0, **knob}),
           h.submit(PROMPTS[1], 24)]  # fmt: skip
    h.run()
    assert h.done(ids[0]).batched
    assert h.text(ids[0]) == greedy
    assert h.text(ids[1]) == alone(tiny, PROMPTS[1], 24)[0]


def test_xtc_changes_what_is_sampled_and_runs_in_a_batch(tiny: LoadedModel) -> None:
    # Threshold 0 and probability 1: every token but the least likely (and the
    # newline and end tokens, which XTC spares) is cut, at every step.
    hot = {"temperature": 1.0, "seed": 5}
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.0}
    plain = alone(tiny, PROMPTS[2], 24, sampling=hot)[0]
    cut = alone(tiny, PROMPTS[2], 24, sampling={**hot, **xtc})[0]
    assert cut != plain
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    ids = [h.submit(PROMPTS[2], 24, sampling={"temperature": 1.0, **xtc}),
           h.submit(PROMPTS[1], 24)]  # fmt: skip
    h.run()
    assert h.done(ids[0]).batched and h.done(ids[0]).finish_reason in ("stop", "length")
    assert h.text(ids[1]) == alone(tiny, PROMPTS[1], 24)[0]


# --- the logits processors -------------------------------------------------------


def test_a_logit_bias_of_100_forces_its_token(tiny: LoadedModel) -> None:
    (token,) = tiny.tokenizer.encode(" the", add_special_tokens=False)
    text, done = alone(tiny, PROMPTS[0], 12, sampling={"logit_bias": {token: 100.0}})
    assert text.split() == ["the"] * 12
    assert done.generation_tokens == 12
    assert alone(tiny, PROMPTS[0], 12)[0] != text


PENALTIES = [  # a penalty, and the settings whose tokens it changes
    ({"repetition_penalty": 1.5}, {}),
    ({"repetition_penalty": 1.5, "repetition_context_size": 3}, {"repetition_penalty": 1.5}),
    ({"presence_penalty": 2.0}, {}),
    ({"frequency_penalty": 3.0}, {}),
]


@pytest.mark.parametrize(("penalty", "without"), PENALTIES)
def test_a_penalty_gives_mlx_lms_own_tokens_and_changes_them(
    tiny: LoadedModel, penalty: dict[str, Any], without: dict[str, Any]
) -> None:
    expected = reference(tiny, PROMPTS[3], 30, **penalty)
    assert expected != reference(tiny, PROMPTS[3], 30, **without)
    assert alone(tiny, PROMPTS[3], 30, sampling=penalty)[0] == expected


def test_requests_in_a_batch_keep_their_own_processors(tiny: LoadedModel) -> None:
    (token,) = tiny.tokenizer.encode(" model", add_special_tokens=False)
    settings: list[dict[str, Any]] = [
        {"presence_penalty": 2.0},
        {"logit_bias": {token: 100.0}},
        {},
        {"repetition_penalty": 1.5, "logprobs": True, "top_logprobs": 3},
    ]
    expected = [reference(tiny, PROMPTS[3], 30, presence_penalty=2.0),
                tiny.tokenizer.decode([token] * 30).lstrip(),  # the first space trimmed
                reference(tiny, PROMPTS[3], 30),
                reference(tiny, PROMPTS[3], 30, repetition_penalty=1.5)]  # fmt: skip
    h = Harness(tiny, EngineSettings(prefix_cache=False, max_concurrent=4))
    ids = [h.submit(PROMPTS[3], 30, sampling=s) for s in settings]
    h.run()
    for request_id, text in zip(ids, expected, strict=True):
        assert h.done(request_id).batched
        assert h.text(request_id) == text, request_id
    assert len(logprobs_of(h, ids[3])) == 30
    assert all(not logprobs_of(h, i) for i in ids[:3])


LOOK_BACK = "Say the word" + " the" * 5 + " again."


def test_a_penalty_looks_back_into_the_prompt_alone_in_a_batch_and_across_a_move(
    tiny: LoadedModel,
) -> None:
    # " the" is favoured by a bias, and stands in the prompt: a penalty that
    # sees the prompt (as mlx-lm's does) keeps it out. The lone path shows its
    # processors the whole prompt too, not just the token generate_step is given.
    (the,) = tiny.tokenizer.encode(" the", add_special_tokens=False)
    sampling: dict[str, Any] = {"presence_penalty": 50.0, "logit_bias": {the: 20.0}}
    expected = reference(tiny, LOOK_BACK, 12, **sampling)
    assert "the" not in expected.split()
    assert reference(tiny, LOOK_BACK, 12, logit_bias={the: 20.0}).split() == ["the"] * 12
    assert alone(tiny, LOOK_BACK, 12, sampling=sampling)[0] == expected
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    ids = [h.submit(LOOK_BACK, 12, sampling=sampling), h.submit(PROMPTS[1], 12)]
    h.run()
    assert h.done(ids[0]).batched and h.text(ids[0]) == expected
    first = h.submit(LOOK_BACK, 12, sampling=sampling)
    h.run(until=lambda: h.made(first) >= 3)
    assert h.engine.solo is not None
    second = h.submit(PROMPTS[1], 20, sampling={"frequency_penalty": 3.0})
    h.run()
    assert h.done(first).batched and h.done(second).batched
    assert h.text(first) == expected
    assert h.text(second) == reference(tiny, PROMPTS[1], 20, frequency_penalty=3.0)


def test_a_processor_that_raises_fails_its_request_not_the_batch(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def broken(chat: ChatOptions, tokenizer: Any, vocab_size: int, prompt: Any) -> Any:
        if chat.response_format is None:
            return None

        def processor(tokens: mx.array, logits: mx.array) -> mx.array:
            calls.append(tokens.size)
            if len(calls) > 4:
                raise RuntimeError("grammar broke")
            return logits

        return processor

    monkeypatch.setattr("runner.engine.constraint_processor", broken)
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    chat = ChatOptions(response_format=ResponseFormat("json_object"))
    message = [ChatMessage("user", PROMPTS[0])]
    ids = [h.submit(PROMPTS[1], 30), h.submit(message, 30, chat=chat), h.submit(PROMPTS[2], 30)]
    h.run()
    failed = failure(h, ids[1])
    assert "grammar broke" in failed.error and not failed.invalid_request
    for request_id, prompt in ((ids[0], PROMPTS[1]), (ids[2], PROMPTS[2])):
        assert h.done(request_id).generation_tokens == 30
        assert h.text(request_id) == alone(tiny, prompt, 30)[0]


# --- log probabilities -----------------------------------------------------------


def _check_logprobs(model: LoadedModel, entries: list[TokenLogprob], text: str, top: int) -> None:
    # The tokens' bytes make the text, but for its first space (the stream
    # trims it) and bytes that are no character (a random model writes them).
    def bare(t: str) -> str:
        return t.replace("\ufffd", "").lstrip()

    whole = b"".join(bytes(e.bytes) if e.bytes is not None else e.token.encode() for e in entries)
    assert bare(whole.decode("utf-8", "replace")) == bare(text)
    for entry in entries:
        assert len(entry.top) == top
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        # Greedy: the token is the most likely one.
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob))


@pytest.mark.parametrize("top", [0, 1, 5, MAX_TOP_LOGPROBS])
def test_logprobs_one_per_token_with_the_top_asked_for(tiny: LoadedModel, top: int) -> None:
    sampling = {"logprobs": True, "top_logprobs": top}
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    solo = h.submit(PROMPTS[0], 20, sampling=sampling)
    h.run()
    ids = [h.submit(PROMPTS[0], 20, sampling=sampling), h.submit(PROMPTS[1], 20)]
    h.run()
    assert h.done(ids[0]).batched
    for request_id in (solo, ids[0]):
        entries = logprobs_of(h, request_id)
        assert len(entries) == h.done(request_id).generation_tokens == 20
        if top:
            _check_logprobs(tiny, entries, h.text(request_id), top)
        else:
            assert all(not e.top for e in entries)
    assert [e.logprob for e in logprobs_of(h, solo)] == pytest.approx(
        [e.logprob for e in logprobs_of(h, ids[0])], abs=1e-4)  # fmt: skip
    assert not logprobs_of(h, ids[1])


def test_the_first_tokens_logprob_is_the_models_log_softmax(tiny: LoadedModel) -> None:
    prompt = prompt_ids(tiny, PROMPTS[4])
    logits = tiny.model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    direct = logits - mx.logsumexp(logits)
    best = mx.argsort(-direct)[:3].tolist()
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    request_id = h.submit(PROMPTS[4], 1, sampling={"logprobs": True, "top_logprobs": 3})
    h.run()
    (entry,) = logprobs_of(h, request_id)
    texts = TokenTexts(tiny.tokenizer)
    assert entry.token == texts(best[0])[0]
    assert entry.logprob == pytest.approx(direct[best[0]].item(), abs=1e-4)
    assert [v for _, v in entry.top] == pytest.approx([direct[t].item() for t in best], abs=1e-4)
    assert [t for t, _ in entry.top] == [texts(t)[0] for t in best]


def test_logprobs_are_those_after_the_processors(tiny: LoadedModel) -> None:
    # The distribution the token was drawn from: a bias of 100 makes it certain.
    (token,) = tiny.tokenizer.encode(" the", add_special_tokens=False)
    sampling = {"logit_bias": {token: 100.0}, "logprobs": True, "top_logprobs": 2}
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    request_id = h.submit(PROMPTS[0], 4, sampling=sampling)
    h.run()
    for entry in logprobs_of(h, request_id):
        assert entry.token == " the" and entry.logprob == pytest.approx(0.0, abs=1e-3)
        assert entry.top[1][1] < -50


def test_a_token_that_holds_part_of_a_character_keeps_its_bytes(tiny: LoadedModel) -> None:
    # builtin:tiny's BPE cuts 日 into two tokens (its bytes E6 97, then A5).
    first, second, *_ = tiny.tokenizer.encode("日本", add_special_tokens=False)
    assert tiny.tokenizer.decode([first]) == "\ufffd"  # decoded alone, its bytes are lost
    sampling = {"logit_bias": {first: 100.0}, "logprobs": True, "top_logprobs": 2}
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    request_id = h.submit(PROMPTS[0], 2, sampling=sampling)
    h.run()
    for entry in logprobs_of(h, request_id):
        assert (entry.token, entry.bytes) == ("\\xe6\\x97", [0xE6, 0x97])
        assert entry.top[0][0] == entry.token
        assert entry.top_bytes is not None and entry.top_bytes[0] == entry.bytes
    # A whole character's token is its text, its bytes that text's UTF-8 (left out).
    texts = TokenTexts(tiny.tokenizer)
    (whole,) = tiny.tokenizer.encode("é", add_special_tokens=False)
    assert texts(whole) == ("é", None) and texts(second) == ("\\xa5", [0xA5])
    tokens = tiny.tokenizer.encode(" 日本語 and 😀!", add_special_tokens=False)
    assert b"".join(bytes(raw) if raw is not None else text.encode()
                    for text, raw in map(texts, tokens)) == " 日本語 and 😀!".encode()  # fmt: skip


def test_logprobs_ride_on_the_frames_of_their_tokens(tiny: LoadedModel) -> None:
    h = Harness(tiny, EngineSettings(prefix_cache=False, stream_interval_s=3600.0))
    h.submit(PROMPTS[0], 12, sampling={"logprobs": True})
    h.run()
    frames = [f for f in h.frames if isinstance(f, TextChunk)]
    assert [len(f.logprobs or []) for f in frames] == [1, 11]  # the first at once, then the rest
    assert [f.generation_tokens for f in frames] == [1, 12]


# --- settings a request cannot run with ------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ({"top_logprobs": MAX_TOP_LOGPROBS + 1, "logprobs": True}, "top_logprobs"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"xtc_threshold": 0.7}, "xtc_threshold"),
        ({"xtc_probability": 2.0}, "xtc_probability"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_context_size": 0}, "repetition_context_size"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_a_setting_out_of_range_fails_the_request_as_invalid_naming_it(
    tiny: LoadedModel, sampling: dict[str, Any], named: str
) -> None:
    h = Harness(tiny)
    request_id = h.submit(PROMPTS[0], 8, sampling=sampling)
    h.run()
    failed = failure(h, request_id)
    assert failed.invalid_request and named in failed.error


def test_top_k_past_the_vocabulary_keeps_every_token(tiny: LoadedModel) -> None:
    hot = {"temperature": 1.0, "seed": 3}
    plain = alone(tiny, PROMPTS[0], 16, sampling=hot)[0]
    assert alone(tiny, PROMPTS[0], 16, sampling={**hot, "top_k": 10**6})[0] == plain


# --- the chat template -----------------------------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
    "{% if flavour is defined %}FLAVOUR:{{ flavour }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.id }} {{ c.function.name }}({% for k, v in c.function.arguments.items() %}"
    "{{ k }}={{ v }}{% endfor %}){% endfor %}{% endif %}"
    "{% if m.tool_call_id %}RESULT {{ m.tool_call_id }} of {{ m.name }}:{% endif %}"
    "{% if m.reasoning_content %}THOUGHT:{{ m.reasoning_content }}|{% endif %}"
    "{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class TemplateTokenizer:
    """builtin:tiny's tokenizer rendering chats with ``template``."""

    def __init__(self, inner: Any, template: str) -> None:
        self.inner = inner
        self.template = template

    def apply_chat_template(self, turns: Any, **kwargs: Any) -> Any:
        return self.inner.apply_chat_template(turns, chat_template=self.template, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}  # fmt: skip
PARIS = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
HISTORY = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=[PARIS], reasoning="Ask the tool."),
    ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
]
BROKEN = ChatMessage("assistant", "", tool_calls=[ToolCall("call_9", "get_weather", "{not json")])


def render(tokenizer: Any, messages: list[ChatMessage], chat: ChatOptions) -> str:
    return str(tokenizer.decode(build_prompt_tokens(tokenizer, Generate(0, messages=messages,
                                                                        chat=chat))))  # fmt: skip


def test_tools_tool_calls_and_tool_turns_reach_the_chat_template(tiny: LoadedModel) -> None:
    tokenizer = TemplateTokenizer(tiny.tokenizer, TOOLS_TEMPLATE)
    chat = ChatOptions(tools=[WEATHER], chat_template_kwargs={"flavour": "dry"})
    text = render(tokenizer, HISTORY, chat)
    assert "TOOLS:[get_weather]" in text and "FLAVOUR:dry" in text
    # The arguments reach the template as a dict, not as JSON text.
    assert "<assistant>CALL call_1 get_weather(city=Paris)THOUGHT:Ask the tool.|" in text
    assert "<tool>RESULT call_1 of get_weather:sunny</tool>" in text
    assert text.endswith("<assistant>")
    assert "TOOLS" not in render(tokenizer, HISTORY, ChatOptions())


def test_the_next_turn_after_tool_calls_is_rendered_as_the_client_sends_it_back(
    tiny: LoadedModel,
) -> None:
    tokenizer = TemplateTokenizer(tiny.tokenizer, TOOLS_TEMPLATE)
    chat = ChatOptions(tools=[WEATHER])
    answer = HISTORY[1]
    ahead = next_turn_prefix(tokenizer, HISTORY[:1], answer, chat)
    following = build_prompt_tokens(tokenizer, Generate(0, messages=HISTORY, chat=chat))
    shared = 0
    while shared < len(ahead) and ahead[shared] == following[shared]:
        shared += 1
    # The next request is the tool's answer, not a user line: what the prefill
    # gives it is all up to the assistant's turn with its call, as it renders it.
    assert "<assistant>CALL call_1 get_weather(city=Paris)" in tokenizer.decode(
        following[:shared])  # fmt: skip


@pytest.mark.parametrize(
    ("chat", "messages", "named"),
    [
        (ChatOptions(chat_template_kwargs={"tools": []}), HISTORY[:1], "tools"),
        (ChatOptions(chat_template_kwargs={"chat_template": "x"}), HISTORY[:1], "chat_template"),
        (ChatOptions(), [HISTORY[0], BROKEN], "call_9"),
    ],
)
def test_a_chat_the_template_cannot_take_fails_the_request_as_invalid(
    tiny: LoadedModel, chat: ChatOptions, messages: list[ChatMessage], named: str
) -> None:
    h = Harness(tiny)
    request_id = h.submit(messages, 8, chat=chat)
    h.run()
    failed = failure(h, request_id)
    assert failed.invalid_request and named in failed.error


# --- processors that keep state -------------------------------------------------

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


def test_processors_are_called_once_per_position_across_a_move(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # generate_step computes a position ahead; the batch the request moves
    # into computes it again: the processors must not see it twice.
    seen: list[int] = []

    def counting(chat: ChatOptions, tokenizer: Any, vocab_size: int, prompt: Any) -> Any:
        if chat.response_format is None:
            return None

        def processor(tokens: mx.array, logits: mx.array) -> mx.array:
            seen.append(tokens.size)
            return logits

        return processor

    monkeypatch.setattr("runner.engine.constraint_processor", counting)
    chat = ChatOptions(response_format=ResponseFormat("json_object"))
    h = Harness(tiny, EngineSettings(prefix_cache=False))
    first = h.submit([ChatMessage("user", PROMPTS[0])], 30, chat=chat)
    h.run(until=lambda: h.made(first) >= 5)
    assert h.engine.solo is not None
    second = h.submit(PROMPTS[1], 10)
    h.run()
    assert h.done(first).batched and h.done(second).batched
    prompt = h.done(first).prompt_tokens
    # Each position once, in order, from the prompt's end (the batch, like
    # generate_step, computes one past the last token).
    assert seen == list(range(prompt, prompt + len(seen))) and len(seen) >= 30
    assert h.text(first) == alone(tiny, [ChatMessage("user", PROMPTS[0])], 30)[0]


def test_a_json_schema_answer_keeps_its_grammar_alone_in_a_batch_and_across_a_move(
    tiny: LoadedModel,
) -> None:
    chat = ChatOptions(response_format=ResponseFormat("json_schema", ANSWER_SCHEMA, "answer"))
    message = [ChatMessage("user", PROMPTS[0])]
    hot = {"temperature": 1.0}

    def check(h: Harness, request_id: int) -> None:
        done = h.done(request_id)
        assert done.finish_reason == "stop", done
        answer = json.loads(h.text(request_id))
        assert set(answer) == {"ok", "level"} and answer["level"] in ("low", "high")

    h = Harness(tiny, EngineSettings(prefix_cache=False))
    lone = h.submit(message, 200, chat=chat, sampling=hot)
    h.run()
    check(h, lone)
    ids = [h.submit(message, 200, chat=chat, sampling=hot), h.submit(PROMPTS[1], 30),
           h.submit(message, 200, chat=chat)]  # fmt: skip
    h.run()
    for request_id in (ids[0], ids[2]):
        assert h.done(request_id).batched
        check(h, request_id)
    moved = h.submit(message, 200, chat=chat, sampling=hot)
    h.run(until=lambda: h.made(moved) >= 3)
    assert h.engine.solo is not None
    other = h.submit(PROMPTS[2], 30)
    h.run()
    assert h.done(moved).batched and h.done(other).generation_tokens == 30
    check(h, moved)


def test_a_position_computed_again_gets_the_same_change_without_a_second_call(
    tiny: LoadedModel,
) -> None:
    # mlx-lm's repetition penalty writes into the logits it is given: what is
    # replayed must be its change, not a change the write erased.
    job = Harness(tiny).engine._make_job(Generate(1, prompt=PROMPTS[0]), 0.0)
    calls: list[int] = []

    def stateful(tokens: mx.array, logits: mx.array) -> mx.array:
        calls.append(tokens.size)
        return logits

    (penalty,) = make_logits_processors(repetition_penalty=2.0)
    run = contained(job, [penalty, stateful])
    context = mx.array([5, 7, 9])
    logits = mx.random.normal((1, tiny.model.args.vocab_size))
    first = run(context, logits)
    expected = penalty(context, mx.array(logits))
    assert mx.allclose(first, expected).item() and not mx.allclose(first, logits).item()
    again = logits * 1  # the batch's logits for the same position, computed again
    assert mx.allclose(run(context, again), expected).item()
    assert calls == [3]
    run(mx.array([5, 7, 9, 11]), logits)
    assert calls == [3, 4]
