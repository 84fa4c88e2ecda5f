"""Constrained decoding on its own: a random-weight model, sampled at
temperature 1, writes only answers that follow the request's JSON schema or
call its tools, because the grammar allows nothing else.

builtin:tiny runs through mlx-lm's own ``generate_step`` and ``BatchGenerator``
with the processor, as the engine runs it. Families with thinking or tool-call
tags have no model here, so their tokenizer (builtin:tiny's, given the tags a
checkpoint would carry, as in tests/test_output.py) is driven with random
logits instead: the grammar is the same, only the logits differ. The answers
are read back with the output splitter, as the runner reads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.tool_parsers import json_tools, qwen3_coder
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from ipc.messages import ChatOptions, NamedTool, ResponseFormat, ToolCall
from modelfiles.builtin import builtin_cache_dir
from runner.builtin import ensure_builtin_model
from runner.constrained import (
    GrammarConstraint,
    GrammarError,
    constraint_processor,
    grammar_for,
    grammar_tokenizer,
    think_mode,
)
from runner.output import OutputSplitter, reasoning_budget_processor

# Read at import, before the fixtures point XDG_CACHE_HOME at a test's own cache.
BUILTIN_CACHE = builtin_cache_dir()
SEEDS = range(6)
Processor = Callable[[mx.array, mx.array], mx.array]


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000)
    kind: Literal["town", "city"]
    districts: list[Annotated[int, Field(ge=0, le=99)]] = Field(max_length=3)


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=-9, le=9)
    y: int = Field(ge=-9, le=9)
    label: Literal["a", "b"]


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "additionalProperties": False,
            "$defs": {"City": {"type": "string", "maxLength": 12}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty list
TOOLS = [WEATHER, TIME]


def json_format(model: type[BaseModel]) -> ChatOptions:
    schema = model.model_json_schema()
    return ChatOptions(response_format=ResponseFormat(type="json_schema", schema=schema))


def check_call(call: Any) -> None:
    """One call, as the tool parsers read it: a tool of TOOLS with valid arguments."""
    assert isinstance(call, dict) and set(call) == {"name", "arguments"}, call
    if call["name"] == "get_weather":
        WeatherArgs.model_validate(call["arguments"])
    else:
        assert call == {"name": "get_time", "arguments": {}}


# --- fixtures: the model, and tokenizers with a family's tags --------------------


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ensure_builtin_model("builtin:tiny", BUILTIN_CACHE)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, TokenizerWrapper]:
    model, tokenizer = mlx_lm.load(str(tiny_dir))
    return model, tokenizer


def wrap(tiny_dir: Path, extra: Sequence[str], parser: Any) -> TokenizerWrapper:
    """builtin:tiny's tokenizer with ``extra`` special tokens and ``parser``'s tags."""
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    hf.add_special_tokens({"additional_special_tokens": list(extra)})
    return TokenizerWrapper(
        hf,
        BPEStreamingDetokenizer,
        tool_call_start=parser.tool_call_start,
        tool_call_end=parser.tool_call_end,
        tool_parser=parser.parse_tool_call,
    )


@pytest.fixture(scope="module")
def qwen(tiny_dir: Path) -> TokenizerWrapper:
    """Thinking tags, and Hermes/Qwen JSON tool calls in tags."""
    return wrap(tiny_dir, ["<think>", "</think>", "<tool_call>", "</tool_call>"], json_tools)


# --- driving a processor --------------------------------------------------------


def generate(
    tiny: tuple[Any, TokenizerWrapper],
    processor: Processor | None,
    seed: int,
    max_tokens: int = 300,
    before: Sequence[Processor] = (),
) -> list[int]:
    """builtin:tiny's tokens through mlx-lm's ``generate_step`` at temperature 1,
    up to and with its EOS; ``before`` act on the logits before ``processor``."""
    model, tokenizer = tiny
    processors = [*before, *([processor] if processor is not None else [])]
    mx.random.seed(seed)
    prompt = mx.array(tokenizer.encode("Describe a place."))
    out = []
    for token, _ in generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=1.0),
        logits_processors=processors or None,
    ):
        out.append(int(token))
        if token in tokenizer.eos_token_ids:
            break
    return out


def leaning_to_json(tokenizer: TokenizerWrapper, vocab: int) -> Processor:
    """A bias toward the tokens that close strings and objects: a random model
    that knows a little JSON, so that a free-length string ends (a constraint
    bounds nothing in "any JSON object")."""
    closing = [t for t in range(vocab) if set(tokenizer.decode([t])) & set('"}')]
    bias = mx.zeros((vocab,)).at[mx.array(closing)].add(4.0)
    return lambda tokens, logits: logits + bias


def drive(
    processors: Sequence[Processor], tokenizer: TokenizerWrapper, prompt: list[int], seed: int
) -> list[int]:
    """Sample from random logits (as wide as the tokenizer) through ``processors``
    at temperature 1, up to and with an EOS: a model that knows nothing."""
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < 400:
        logits = mx.array(rng.normal(0.0, 3.0, size=(1, len(tokenizer))).astype(np.float32))
        for processor in processors:
            logits = processor(mx.array(tokens), logits)
        weights = np.exp(np.array(logits[0], dtype=np.float64) - float(mx.max(logits)))
        token = int(rng.choice(len(weights), p=weights / weights.sum()))
        out.append(token)
        tokens.append(token)
        if token in tokenizer.eos_token_ids:
            return out
    raise AssertionError(f"no EOS in 400 tokens: {tokenizer.decode(out)!r}")


def text(tokenizer: TokenizerWrapper, tokens: list[int]) -> str:
    """The answer's text, without its EOS (which must end it)."""
    assert tokens and tokens[-1] in tokenizer.eos_token_ids, tokenizer.decode(tokens)
    return str(tokenizer.decode(tokens[:-1]))


def split(
    tokenizer: TokenizerWrapper, chat: ChatOptions, prompt: list[int], tokens: list[int]
) -> tuple[str, str, list[ToolCall], str | None]:
    """The answer as the runner's output splitter reads it: content,
    reasoning, tool calls, and the invalid tool-call text if any."""
    splitter = OutputSplitter(tokenizer, chat, prompt)
    detokenizer = tokenizer.detokenizer
    content, reasoning, calls = "", "", []
    pieces = []
    for token in tokens[:-1]:
        detokenizer.add_token(token)
        pieces.append((detokenizer.last_segment, token))
    detokenizer.finalize()
    pieces.append((detokenizer.last_segment, tokens[-1]))
    for segment, token in pieces:
        parts = splitter.feed(segment, token)
        content, reasoning = content + parts.content, reasoning + parts.reasoning
        calls += parts.tool_calls
    parts, invalid = splitter.finish()
    return content + parts.content, reasoning + parts.reasoning, calls + parts.tool_calls, invalid


# --- JSON answers ---------------------------------------------------------------


def test_json_object_answers_are_json_objects(tiny: tuple[Any, TokenizerWrapper]) -> None:
    model, tokenizer = tiny
    chat = ChatOptions(response_format=ResponseFormat(type="json_object"))
    lean = leaning_to_json(tokenizer, model.args.vocab_size)
    for seed in SEEDS:
        processor = constraint_processor(chat, tokenizer, model.args.vocab_size)
        answer = text(tokenizer, generate(tiny, processor, seed, before=[lean]))
        assert isinstance(json.loads(answer), dict), answer


def test_json_schema_answers_follow_the_schema_and_end_with_eos(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    for seed in SEEDS:
        processor = constraint_processor(json_format(Place), tokenizer, model.args.vocab_size)
        assert processor is not None and not processor.complete
        answer = text(tokenizer, generate(tiny, processor, seed))
        Place.model_validate_json(answer)
        assert processor.complete
    # Unconstrained, the same model and seed write no JSON at all.
    free = tokenizer.decode(generate(tiny, None, 0, max_tokens=40))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)


def test_an_answer_cut_by_max_tokens_is_left_incomplete(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    processor = constraint_processor(json_format(Place), tokenizer, model.args.vocab_size)
    assert processor is not None
    tokens = generate(tiny, processor, 0, max_tokens=6)
    assert len(tokens) == 6 and not processor.complete
    assert tokenizer.decode(tokens).startswith('{"name": "')


def test_nothing_to_constrain_gives_no_processor(tiny: tuple[Any, TokenizerWrapper]) -> None:
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    assert constraint_processor(ChatOptions(), tokenizer, vocab) is None
    text_format = ChatOptions(response_format=ResponseFormat(type="text"))
    assert constraint_processor(text_format, tokenizer, vocab) is None
    auto = ChatOptions(tools=TOOLS, tool_choice="auto")
    assert constraint_processor(auto, tokenizer, vocab) is None
    off = ChatOptions(tools=TOOLS, tool_choice="none")
    assert constraint_processor(off, tokenizer, vocab) is None


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "nothing"}, "Invalid type: nothing"),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            "'/$defs/missing' does not exist",
        ),
        (
            {"type": "integer", "minimum": 5, "maximum": 1},
            "minimum (5) is greater than maximum (1)",
        ),
        ({"type": "string", "pattern": "(?=x)"}, "look-around"),
        ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ],
)
def test_a_schema_that_cannot_compile_raises_value_error_naming_why(
    tiny: tuple[Any, TokenizerWrapper], schema: dict[str, Any], reason: str
) -> None:
    model, tokenizer = tiny
    chat = ChatOptions(response_format=ResponseFormat(type="json_schema", schema=schema))
    with pytest.raises(ValueError, match="response_format's schema cannot be compiled") as caught:
        constraint_processor(chat, tokenizer, model.args.vocab_size)
    assert reason in str(caught.value)
    # In a tool's parameters, the message names the tool.
    tool = {"type": "function", "function": {"name": "broken", "parameters": schema}}
    with pytest.raises(ValueError, match="tool 'broken'") as caught:
        constraint_processor(
            ChatOptions(tools=[tool], tool_choice="required"), tokenizer, model.args.vocab_size
        )
    assert reason in str(caught.value)


def test_a_named_tool_that_is_not_among_the_tools_raises(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    chat = ChatOptions(tools=TOOLS, tool_choice=NamedTool("get_news"))
    with pytest.raises(ValueError, match="'get_news', which is not among the request's tools"):
        constraint_processor(chat, tokenizer, model.args.vocab_size)


def test_a_token_outside_the_grammar_fails_the_request_naming_the_token(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    processor = constraint_processor(json_format(Point), tokenizer, model.args.vocab_size)
    assert processor is not None
    prompt = tokenizer.encode("Hi")
    logits = mx.zeros((1, model.args.vocab_size))
    first = processor(mx.array(prompt), logits)
    (allowed,) = np.nonzero(np.isfinite(np.array(first[0])))
    assert tokenizer.decode(allowed.tolist()).startswith("{")  # only the object's start
    wrong = tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(GrammarError, match=f"token {wrong} is not allowed") as caught:
        processor(mx.array([*prompt, wrong]), logits)
    assert "\n" not in str(caught.value)  # the reason, not the parser's state and grammar


def test_the_grammar_tokenizer_is_built_once_per_model(
    tiny: tuple[Any, TokenizerWrapper], qwen: TokenizerWrapper
) -> None:
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    assert grammar_tokenizer(tokenizer, vocab) is grammar_tokenizer(tokenizer, vocab)
    assert grammar_tokenizer(qwen, vocab) is not grammar_tokenizer(tokenizer, vocab)


# --- forced tool calls ------------------------------------------------------------


def test_a_named_tool_on_a_model_without_tool_syntax_is_the_whole_answer(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    chat = ChatOptions(tools=TOOLS, tool_choice=NamedTool("get_weather"))
    prompt = tokenizer.encode("Describe a place.")
    for seed in SEEDS:
        processor = constraint_processor(chat, tokenizer, model.args.vocab_size)
        tokens = generate(tiny, processor, seed)
        call = json.loads(text(tokenizer, tokens))
        assert call["name"] == "get_weather"
        check_call(call)
        # The runner's output splitter reads it as that call.
        content, _, calls, invalid = split(tokenizer, chat, prompt, tokens)
        assert (content, invalid) == ("", None)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", call["arguments"])
        ]


def test_required_on_a_model_without_tool_syntax_calls_the_tools(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    chat = ChatOptions(tools=TOOLS, tool_choice="required")
    prompt = tokenizer.encode("Describe a place.")
    names = set()
    for seed in range(12):
        processor = constraint_processor(chat, tokenizer, model.args.vocab_size)
        tokens = generate(tiny, processor, seed)
        answer = json.loads(text(tokenizer, tokens))
        answer_calls = answer if isinstance(answer, list) else [answer]
        assert answer_calls
        for call in answer_calls:
            check_call(call)
            names.add(call["name"])
        _, _, calls, invalid = split(tokenizer, chat, prompt, tokens)
        assert invalid is None and [c.name for c in calls] == [c["name"] for c in answer_calls]
    assert names == {"get_weather", "get_time"}  # either may come


def test_forced_calls_use_the_models_tool_call_tags(qwen: TokenizerWrapper) -> None:
    prompt = qwen.encode("<|im_start|>assistant\n", add_special_tokens=False)
    blocks = 0
    for choice in ("required", NamedTool("get_weather")):
        chat = ChatOptions(tools=TOOLS, tool_choice=choice)
        for seed in SEEDS:
            processor = constraint_processor(chat, qwen, len(qwen), prompt)
            # A think block is allowed first (none was opened or closed); a
            # budget of 3 tokens ends any the random model opens.
            budget = reasoning_budget_processor(OutputSplitter(qwen, chat, prompt), qwen, 3)
            assert processor is not None and budget is not None
            tokens = drive([processor, budget], qwen, prompt, seed)
            answer = text(qwen, tokens)
            body = answer.split("</think>")[-1].lstrip("\n")
            assert body.startswith("<tool_call>\n{") and body.endswith("}\n</tool_call>"), answer
            content, _, calls, invalid = split(qwen, chat, prompt, tokens)
            assert not content.strip() and invalid is None, (content, invalid)
            assert calls
            for call in calls:
                check_call({"name": call.name, "arguments": json.loads(call.arguments)})
            if isinstance(choice, NamedTool):
                assert [c.name for c in calls] == ["get_weather"]
            blocks += len(calls)
    assert blocks > 2 * len(SEEDS)  # "required" may write several blocks


def test_a_tool_syntax_the_grammar_cannot_write_is_refused(tiny_dir: Path) -> None:
    coder = wrap(tiny_dir, ["<tool_call>", "</tool_call>"], qwen3_coder)
    chat = ChatOptions(tools=TOOLS, tool_choice="required")
    with pytest.raises(ValueError, match=r"syntax \(qwen3_coder\); only JSON tool calls"):
        constraint_processor(chat, coder, len(coder))


def test_json_format_with_auto_tools_allows_a_call_or_the_json(qwen: TokenizerWrapper) -> None:
    prompt = qwen.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    chat = ChatOptions(
        tools=TOOLS,
        tool_choice="auto",
        response_format=ResponseFormat(type="json_schema", schema=Point.model_json_schema()),
    )
    kinds = set()
    for seed in range(10):
        processor = constraint_processor(chat, qwen, len(qwen), prompt)
        assert processor is not None
        tokens = drive([processor], qwen, prompt, seed)
        content, reasoning, calls, invalid = split(qwen, chat, prompt, tokens)
        assert not reasoning and invalid is None
        if calls:
            assert not content.strip()
            kinds.add("call")
        else:
            Point.model_validate_json(content)
            kinds.add("json")
    assert kinds == {"call", "json"}


# --- thinking ---------------------------------------------------------------------


def test_a_model_left_thinking_finishes_its_thought_then_answers(qwen: TokenizerWrapper) -> None:
    prompt = qwen.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    chat = json_format(Point)
    assert think_mode(qwen, prompt) == "inside"
    for seed in SEEDS:
        processor = constraint_processor(chat, qwen, len(qwen), prompt)
        # The reasoning budget comes last and forces the think end: the grammar lets it.
        budget = reasoning_budget_processor(OutputSplitter(qwen, chat, prompt), qwen, 8)
        assert processor is not None and budget is not None
        tokens = drive([processor, budget], qwen, prompt, seed)
        content, reasoning, calls, invalid = split(qwen, chat, prompt, tokens)
        assert reasoning and not calls and invalid is None
        Point.model_validate_json(content.strip())


def test_a_think_block_is_optional_unless_the_prompt_closed_it(qwen: TokenizerWrapper) -> None:
    chat = json_format(Point)
    think_start = qwen.think_start_tokens[0]
    opened = qwen.encode("<|im_start|>assistant\n", add_special_tokens=False)
    closed = qwen.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    earlier = qwen.encode(
        "<|im_start|>assistant\n<think>\nx\n</think>\n\nHi<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    expected = {"optional": True, "none": False}
    for prompt, mode in ((opened, "optional"), (closed, "none"), (earlier, "optional")):
        assert think_mode(qwen, prompt) == mode
        processor = constraint_processor(chat, qwen, len(qwen), prompt)
        assert processor is not None
        first = processor(mx.array(prompt), mx.zeros((1, len(qwen))))
        assert bool(mx.isfinite(first[0, think_start])) is expected[mode]


def test_a_think_block_is_free_text_without_eos_until_its_whole_end_tag(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    """Markers written in several tokens (a family whose think tags are not
    in the vocabulary): the block ends only when the whole end tag is
    written; inside it any token may come but EOS."""
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    answer = grammar_for(json_format(Point), tokenizer)
    assert answer is not None
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert len(end) > 1
    processor = GrammarConstraint(
        grammar_tokenizer(tokenizer, vocab),
        answer,
        think="inside",
        think_start=tuple(tokenizer.encode("<think>", add_special_tokens=False)),
        think_end=end,
    )
    tokens = tokenizer.encode("Think.")
    logits = mx.zeros((1, vocab))
    for token in [None, *tokenizer.encode("{a} </", add_special_tokens=False), *end]:
        if token is not None:
            tokens.append(token)
        assert processor.thinking
        masked = np.array(processor(mx.array(tokens), logits)[0])
        if not processor.thinking:
            break
        assert set(np.nonzero(~np.isfinite(masked))[0]) == set(tokenizer.eos_token_ids)
    assert tokens[-len(end) :] == list(end) and not processor.thinking
    (allowed,) = np.nonzero(np.isfinite(masked))
    assert {tokenizer.decode([t])[0] for t in allowed} == {"{", "\n"}


# --- in mlx-lm's batch ------------------------------------------------------------


def test_two_constrained_requests_beside_an_unconstrained_one_in_a_batch(
    tiny: tuple[Any, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    mx.random.seed(7)
    place = constraint_processor(json_format(Place), tokenizer, vocab)
    point = constraint_processor(json_format(Point), tokenizer, vocab)
    assert place is not None and point is not None
    batch = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    prompts = [tokenizer.encode(p) for p in ("A place.", "A point, please.", "Say something.")]
    uids = batch.insert(
        prompts,
        max_tokens=[300, 300, 40],
        samplers=[make_sampler(temp=1.0)] * 3,
        logits_processors=[[place], [point], []],
    )
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    reasons: dict[int, str] = {}
    while len(reasons) < len(uids):
        for response in batch.next_generated():
            out[response.uid].append(int(response.token))
            if response.finish_reason is not None:
                reasons[response.uid] = response.finish_reason
    batch.close()
    assert [reasons[u] for u in uids] == ["stop", "stop", "length"]
    Place.model_validate_json(text(tokenizer, out[uids[0]]))
    Point.model_validate_json(text(tokenizer, out[uids[1]]))
    free = tokenizer.decode(out[uids[2]])
    assert len(out[uids[2]]) == 40
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
