"""The output splitter on its own: a model's text in, content, reasoning and
tool calls out, as it streams; and the reasoning budget's logits processor.

The tokenizers are mlx-lm ``TokenizerWrapper``s around builtin:tiny's real BPE
tokenizer, given the thinking and tool-call markers a family's checkpoint
would carry (``<think>`` in the vocabulary; a tool parser module's tags and
parser). The text is fed as mlx-lm's streaming detokenizer cuts it, token by
token, or in scripted pieces that split the markers anywhere.
"""

from __future__ import annotations

import importlib
import itertools
import json
import pkgutil
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx_lm.tool_parsers
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools, qwen3_coder
from transformers import AutoTokenizer

from ipc.messages import ChatOptions, NamedTool, ResponseFormat, ToolCall
from modelfiles.builtin import builtin_cache_dir
from runner.builtin import ensure_builtin_model
from runner.output import OutputSplitter, Parts, reasoning_budget_processor
from tool_call_formats import FORMATS, TOOLS, WEATHER

# Read at import, before the fixtures point XDG_CACHE_HOME at a test's own cache.
BUILTIN_CACHE = builtin_cache_dir()

WITH_TOOLS = ChatOptions(tools=TOOLS)
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
# Qwen3's template writes this after the thinking of an earlier turn.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir() -> Any:
    return ensure_builtin_model("builtin:tiny", BUILTIN_CACHE)


def wrap(
    tiny_dir: Any, extra_tokens: Iterable[str] = (), parser: ModuleType | None = None
) -> TokenizerWrapper:
    """builtin:tiny's tokenizer with ``extra_tokens`` in its vocabulary and the
    tool-call tags and parser of ``parser``, as mlx-lm's ``load`` builds it."""
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    if extra_tokens:
        hf.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    return TokenizerWrapper(
        hf,
        BPEStreamingDetokenizer,
        tool_call_start=None if parser is None else parser.tool_call_start,
        tool_call_end=None if parser is None else parser.tool_call_end,
        tool_parser=None if parser is None else parser.parse_tool_call,
    )


@pytest.fixture(scope="module")
def qwen(tiny_dir: Any) -> TokenizerWrapper:
    """Thinking tags in the vocabulary, Hermes-style JSON tool calls."""
    tokenizer = wrap(tiny_dir, ["<think>", "</think>", "<tool_call>", "</tool_call>"], json_tools)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def plain(tiny_dir: Any) -> TokenizerWrapper:
    """No thinking, no tool-call syntax (builtin:tiny as it is)."""
    return wrap(tiny_dir)


def prompt(tokenizer: TokenizerWrapper, text: str = "<|im_start|>assistant\n") -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def stream(tokenizer: TokenizerWrapper, text: str) -> list[tuple[str, int]]:
    """``text`` as the model would send it: its tokens, each with the segment
    mlx-lm's streaming detokenizer gives for it."""
    detokenizer = tokenizer.detokenizer
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
        pieces.append((detokenizer.last_segment, token))
    detokenizer.finalize()
    if tail := detokenizer.last_segment:
        pieces.append((tail, 0))
    return pieces


def run(
    splitter: OutputSplitter, pieces: Iterable[tuple[str, int]]
) -> tuple[Parts, str | None, list[Parts]]:
    """Feed every piece, then finish: everything released, the invalid tool-call
    text, and what each feed released."""
    each = [splitter.feed(segment, token) for segment, token in pieces]
    rest, invalid = splitter.finish()
    total = Parts()
    for part in [*each, rest]:
        total.content += part.content
        total.reasoning += part.reasoning
        total.tool_calls += part.tool_calls
    return total, invalid, each


def calls(found: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in found]


def in_pieces(text: str, cuts: Iterable[int]) -> list[tuple[str, int]]:
    """``text`` cut at ``cuts``, each piece with a dummy token."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [(text[a:b], 7) for a, b in itertools.pairwise(bounds) if b > a]


# -- reasoning --------------------------------------------------------------------------


def test_reasoning_then_content_are_told_apart(qwen: TokenizerWrapper) -> None:
    splitter = OutputSplitter(qwen, ChatOptions(), prompt(qwen))
    assert not splitter.in_reasoning
    total, invalid, _ = run(splitter, stream(qwen, "<think>Paris is big.</think>It is Paris."))
    assert (total.reasoning, total.content, invalid) == ("Paris is big.", "It is Paris.", None)
    thinking = len(qwen.encode("<think>Paris is big.</think>", add_special_tokens=False))
    assert splitter.reasoning_tokens == thinking
    assert not splitter.in_reasoning


def test_prompt_ending_inside_think_starts_in_reasoning(qwen: TokenizerWrapper) -> None:
    opened = prompt(qwen, "<|im_start|>assistant\n<think>\n")
    splitter = OutputSplitter(qwen, ChatOptions(), opened)
    assert splitter.starts_in_reasoning and splitter.in_reasoning
    total, _, _ = run(splitter, stream(qwen, "hmm, Paris</think>Paris."))
    assert (total.reasoning, total.content) == ("hmm, Paris", "Paris.")
    # A think block the prompt already closed leaves the model answering.
    closed = prompt(qwen, "<think>\n\n</think>\n\n")
    assert not OutputSplitter(qwen, ChatOptions(), closed).starts_in_reasoning


def test_model_without_thinking_tags_answers_only_content(plain: TokenizerWrapper) -> None:
    splitter = OutputSplitter(plain, ChatOptions(), prompt(plain, "<think>"))
    total, _, _ = run(splitter, stream(plain, "<think>a</think>b"))
    assert (total.reasoning, total.content) == ("", "<think>a</think>b")
    assert splitter.reasoning_tokens == 0


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=60), max_size=12))
def test_tags_split_anywhere_never_leak_into_content(
    qwen: TokenizerWrapper, cuts: list[int]
) -> None:
    text = f"<think>x < y</think>A <b> <tool_call>{WEATHER}</tool_call> done <tool"
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, each = run(splitter, in_pieces(text, [c % len(text) for c in cuts]))
    assert total.reasoning == "x < y"
    # The unfinished "<tool" at the end was no tag after all: content, once known.
    assert total.content == "A <b>  done <tool"
    for part in each:
        assert "<think" not in part.content and "<tool_call" not in part.content
        assert "</" not in part.content
    assert calls(total.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert invalid is None


def test_text_that_may_start_a_tag_is_held_until_the_next_segment_tells(
    qwen: TokenizerWrapper,
) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    assert splitter.feed("Hi <tool_", 1).content == "Hi "
    assert splitter.feed("box", 2).content == "<tool_box"
    assert splitter.feed(" <thi", 3).content == " "
    assert splitter.finish() == (Parts(content="<thi"), None)


# -- tool calls -------------------------------------------------------------------------


def test_tool_call_in_one_segment_is_released_with_it(qwen: TokenizerWrapper) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    parts = splitter.feed(f"<tool_call>\n{WEATHER}\n</tool_call>", 5)
    assert calls(parts.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    (call,) = parts.tool_calls
    assert call.id.startswith("call_") and len(call.id) > len("call_") + 8
    assert parts.content == ""
    assert splitter.finish() == (Parts(), None)


def test_tool_call_streamed_token_by_token_is_released_when_its_block_closes(
    qwen: TokenizerWrapper,
) -> None:
    text = f"Let me look.<tool_call>\n{WEATHER}\n</tool_call>"
    pieces = stream(qwen, text)
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, each = run(splitter, pieces)
    released = [i for i, part in enumerate(each) if part.tool_calls]
    closing = max(i for i, (segment, _) in enumerate(pieces) if segment)
    assert released == [closing]  # at the closing tag, not before, not later
    assert total.content == "Let me look."
    assert calls(total.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert invalid is None


def test_two_tool_calls_are_released_one_at_a_time_with_their_own_ids(
    qwen: TokenizerWrapper,
) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    first = splitter.feed(f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n", 1)
    second = splitter.feed(f"{TIME}\n</tool_call>", 2)
    assert calls(first.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls(second.tool_calls) == [("get_time", {"zone": "UTC"})]
    assert first.tool_calls[0].id != second.tool_calls[0].id
    assert (first.content, second.content) == ("\n", "")


def test_tool_call_cut_off_by_max_tokens_is_invalid_not_content(
    qwen: TokenizerWrapper,
) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, _ = run(splitter, stream(qwen, 'OK.<tool_call>\n{"name": "get_weather", "argu'))
    assert (total.content, total.tool_calls) == ("OK.", [])
    assert invalid == '<tool_call>\n{"name": "get_weather", "argu'


def test_tool_call_never_closed_is_invalid_even_when_it_reads_whole(
    qwen: TokenizerWrapper,
) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, _ = run(splitter, stream(qwen, f"<tool_call>\n{WEATHER}\n"))
    assert (total.content, total.tool_calls, invalid) == ("", [], f"<tool_call>\n{WEATHER}\n")


def test_garbage_in_a_tool_call_block_is_invalid(qwen: TokenizerWrapper) -> None:
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, _ = run(
        splitter,
        stream(qwen, f"<tool_call>get weather please</tool_call><tool_call>{TIME}</tool_call>"),
    )
    assert calls(total.tool_calls) == [("get_time", {"zone": "UTC"})]
    assert total.content == ""
    assert invalid == "<tool_call>get weather please</tool_call>"
    # JSON that is no call (no name) is garbage too.
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    total, invalid, _ = run(splitter, [('<tool_call>{"city": "Paris"}</tool_call>', 1)])
    assert (total.tool_calls, invalid) == ([], '<tool_call>{"city": "Paris"}</tool_call>')


def test_json_call_the_familys_parser_cannot_read_falls_back_to_json(
    tiny_dir: Any,
) -> None:
    # Qwen3-Coder's parser reads only <function=...> XML; the model wrote JSON.
    tokenizer = wrap(tiny_dir, parser=qwen3_coder)
    with pytest.raises(ValueError):
        qwen3_coder.parse_tool_call(WEATHER, TOOLS)
    splitter = OutputSplitter(tokenizer, WITH_TOOLS, prompt(tokenizer))
    total, invalid, _ = run(splitter, stream(tokenizer, f"<tool_call>\n{WEATHER}\n</tool_call>"))
    assert calls(total.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert invalid is None


@pytest.mark.parametrize(
    "chat", [ChatOptions(), ChatOptions(tools=TOOLS, tool_choice="none")], ids=["no-tools", "none"]
)
def test_without_tool_calls_the_tool_text_is_content(
    qwen: TokenizerWrapper, chat: ChatOptions
) -> None:
    text = f"<think>hm</think>Here: <tool_call>{WEATHER}</tool_call>"
    total, invalid, _ = run(OutputSplitter(qwen, chat, prompt(qwen)), stream(qwen, text))
    assert (total.reasoning, total.content) == ("hm", f"Here: <tool_call>{WEATHER}</tool_call>")
    assert (total.tool_calls, invalid) == ([], None)


def test_tool_call_written_while_thinking_is_a_call(qwen: TokenizerWrapper) -> None:
    # mlx-lm's state machine goes from reasoning straight into a tool call.
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen, "<think>\n"))
    total, invalid, _ = run(splitter, stream(qwen, f"need it<tool_call>{TIME}</tool_call>"))
    assert total.reasoning == "need it"
    assert calls(total.tool_calls) == [("get_time", {"zone": "UTC"})]
    assert invalid is None


@pytest.mark.parametrize("choice", ["required", NamedTool("get_weather")], ids=str)
def test_model_without_tool_syntax_that_must_call_answers_the_call_in_json(
    plain: TokenizerWrapper, choice: Any
) -> None:
    chat = ChatOptions(tools=TOOLS, tool_choice=choice)
    total, invalid, each = run(OutputSplitter(plain, chat, prompt(plain)), stream(plain, WEATHER))
    assert all(part.content == "" for part in each)
    assert (total.content, invalid) == ("", None)
    assert calls(total.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]
    # Not JSON: the answer is an invalid call, not content.
    total, invalid, _ = run(OutputSplitter(plain, chat, prompt(plain)), [("sunny", 1)])
    assert (total.content, total.tool_calls, invalid) == ("", [], "sunny")


@pytest.mark.parametrize(
    "answer",
    [WEATHER, f"\n  {WEATHER}", f"[{WEATHER}, {TIME}]", WEATHER.replace("arguments", "parameters")],
    ids=["object", "after-space", "list", "parameters"],
)
def test_model_without_tool_syntax_free_to_call_may_answer_the_call_in_json(
    plain: TokenizerWrapper, answer: str
) -> None:
    # Llama 3.x's way: the answer is the call, with no tags. Held to the end.
    total, invalid, each = run(OutputSplitter(plain, WITH_TOOLS, prompt(plain)),
                               stream(plain, answer))  # fmt: skip
    assert all(not part for part in each)
    assert (total.content, invalid) == ("", None)
    expected = [("get_weather", {"city": "Paris", "days": 3})]
    if answer.startswith("["):
        expected.append(("get_time", {"zone": "UTC"}))
    assert calls(total.tool_calls) == expected


@pytest.mark.parametrize(
    "answer",
    [
        '{"name": "get_news", "arguments": {}}',  # no tool of the request
        '{"city": "Paris"}',  # no call at all
        WEATHER[:30],  # cut short
        f"{WEATHER} is what I would call.",  # more than the call
    ],
    ids=["other-name", "not-a-call", "cut", "more"],
)
def test_json_answer_that_is_no_call_of_the_request_is_content_unchanged(
    plain: TokenizerWrapper, answer: str
) -> None:
    total, invalid, each = run(OutputSplitter(plain, WITH_TOOLS, prompt(plain)),
                               stream(plain, answer))  # fmt: skip
    assert (total.content, total.tool_calls, invalid) == (answer, [], None)
    assert all(not part for part in each)  # it could have been a call until the end


def test_prose_answer_of_a_model_without_tool_syntax_streams_as_content(
    plain: TokenizerWrapper,
) -> None:
    splitter = OutputSplitter(plain, WITH_TOOLS, prompt(plain))
    assert splitter.feed("  ", 1) == Parts()  # nothing tells yet
    assert splitter.feed("It is", 2).content == "  It is"
    assert splitter.feed(f" {WEATHER}", 3).content == f" {WEATHER}"
    assert splitter.finish() == (Parts(), None)
    # No tools, "none", or a JSON response format: JSON is the answer, streamed.
    json_format = ResponseFormat("json_object")
    for chat in (ChatOptions(), ChatOptions(tools=TOOLS, tool_choice="none"),
                 ChatOptions(tools=TOOLS, response_format=json_format)):  # fmt: skip
        splitter = OutputSplitter(plain, chat, prompt(plain))
        assert splitter.feed(WEATHER, 1).content == WEATHER
        assert splitter.finish() == (Parts(), None)


def test_block_that_closed_broken_is_known_at_once_one_still_open_only_at_the_end(
    qwen: TokenizerWrapper,
) -> None:
    # A stop string may end the answer between the two: the first was in the
    # answer, the second came after its end.
    splitter = OutputSplitter(qwen, WITH_TOOLS, prompt(qwen))
    assert splitter.broken is None
    splitter.feed("<tool_call>{bad}</tool_call> so", 1)
    assert splitter.broken == "<tool_call>{bad}</tool_call>"
    splitter.feed(f"<tool_call>{TIME}", 2)
    assert splitter.broken == "<tool_call>{bad}</tool_call>"
    _, invalid = splitter.finish()
    assert invalid == f"<tool_call>{{bad}}</tool_call>\n<tool_call>{TIME}"
    assert splitter.broken == "<tool_call>{bad}</tool_call>"


# -- every tool-call format mlx-lm parses -----------------------------------------------

PARSERS = sorted(module.name for module in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__))


def test_every_mlx_lm_tool_parser_has_a_format_here() -> None:
    # A parser a new mlx-lm brings fails here until its format joins the table.
    assert sorted(FORMATS) == PARSERS


@pytest.mark.parametrize("name", PARSERS)
def test_splitter_gives_the_calls_mlx_lm_parser_gives(tiny_dir: Any, name: str) -> None:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    body = FORMATS[name]
    direct = module.parse_tool_call(body, TOOLS)
    direct = direct if isinstance(direct, list) else [direct]
    assert direct, f"the sample for {name} parses to no call"

    tokenizer = wrap(tiny_dir, parser=module)
    text = f"Sure.{module.tool_call_start}{body}{module.tool_call_end}"
    splitter = OutputSplitter(tokenizer, WITH_TOOLS, prompt(tokenizer))
    total, invalid, each = run(splitter, stream(tokenizer, text))

    assert (total.content, invalid) == ("Sure.", None)
    assert calls(total.tool_calls) == [(call["name"], call["arguments"]) for call in direct]
    # The model's own ids where its format has them (Kimi's), call_... otherwise.
    assert [call.id for call in total.tool_calls] == [
        call.get("id") or found.id for call, found in zip(direct, total.tool_calls, strict=True)
    ]
    if module.tool_call_end:  # released as the block closes, not at the end
        assert any(part.tool_calls for part in each)


# -- the reasoning budget ---------------------------------------------------------------

FILLER = 100  # the token the fake model always wants next


def generate(
    tokenizer: TokenizerWrapper,
    opening: list[int],
    budget: int | None,
    wants: dict[int, int] | None = None,
    steps: int = 12,
) -> tuple[list[int], OutputSplitter]:
    """A greedy "model" that wants FILLER (or ``wants[step]``) each step, run
    through the budget processor as ``generate_step`` runs processors; its
    tokens also go through a splitter."""
    splitter = OutputSplitter(tokenizer, ChatOptions(), opening)
    processor = reasoning_budget_processor(splitter, tokenizer, budget)
    assert processor is not None
    tokens = list(opening)
    detokenizer = tokenizer.detokenizer
    for step in range(steps):
        logits = mx.zeros((1, len(tokenizer)))
        logits[0, (wants or {}).get(step, FILLER)] = 10.0
        out = processor(mx.array(tokens), logits)
        token = int(mx.argmax(out, axis=-1).item())
        tokens.append(token)
        detokenizer.add_token(token)
        splitter.feed(detokenizer.last_segment, token)
    return tokens[len(opening) :], splitter


def test_budget_forces_think_end_and_the_templates_newlines(qwen: TokenizerWrapper) -> None:
    newlines = list(qwen.encode("\n\n", add_special_tokens=False))
    generated, splitter = generate(qwen, prompt(qwen, "<think>\n"), budget=5)
    assert generated == [FILLER] * 5 + [qwen.think_end_id, *newlines] + [FILLER] * (
        12 - 6 - len(newlines)
    )
    assert not splitter.in_reasoning
    assert splitter.reasoning_tokens == 6  # the five and the closing tag


def test_budget_counts_from_where_the_model_opens_its_thinking(qwen: TokenizerWrapper) -> None:
    generated, _ = generate(qwen, prompt(qwen), budget=3, wants={2: qwen.think_start_id})
    assert generated[:6] == [FILLER, FILLER, qwen.think_start_id, FILLER, FILLER, FILLER]
    assert generated[6] == qwen.think_end_id


def test_thinking_that_ends_within_budget_is_left_alone(qwen: TokenizerWrapper) -> None:
    generated, splitter = generate(
        qwen, prompt(qwen, "<think>\n"), budget=4, wants={2: qwen.think_end_id}, steps=15
    )
    assert generated == [FILLER, FILLER, qwen.think_end_id] + [FILLER] * 12
    assert splitter.reasoning_tokens == 3


def test_budget_of_zero_closes_the_thinking_at_once(qwen: TokenizerWrapper) -> None:
    generated, _ = generate(qwen, prompt(qwen, "<think>\n"), budget=0, steps=1)
    assert generated == [qwen.think_end_id]


def test_processor_leaves_logits_untouched_before_the_budget(qwen: TokenizerWrapper) -> None:
    opening = prompt(qwen, "<think>\n")
    splitter = OutputSplitter(qwen, ChatOptions(), opening)
    processor = reasoning_budget_processor(splitter, qwen, 3)
    assert processor is not None
    logits = mx.zeros((1, len(qwen)))
    assert processor(mx.array(opening), logits) is logits
    assert processor(mx.array([*opening, FILLER, FILLER]), logits) is logits


def test_no_budget_processor_without_budget_or_thinking(
    qwen: TokenizerWrapper, plain: TokenizerWrapper
) -> None:
    splitter = OutputSplitter(qwen, ChatOptions(), prompt(qwen))
    assert reasoning_budget_processor(splitter, qwen, None) is None
    splitter = OutputSplitter(plain, ChatOptions(), prompt(plain))
    assert reasoning_budget_processor(splitter, plain, 10) is None


def test_budget_forces_the_newlines_qwen3s_own_template_writes_after_thinking() -> None:
    # Its template's first "</think>" is in a test ('</think>' in content); the
    # one it writes after a thought is followed by two newlines.
    tokenizer = load_tokenizer(ensure_builtin_model("builtin:tiny-qwen3-tools", BUILTIN_CACHE))
    template = tokenizer.chat_template
    assert template.index("'</think>' in content") < template.index("</think>\\n\\n")
    splitter = OutputSplitter(tokenizer, ChatOptions(), prompt(tokenizer, "<think>\n"))
    processor = reasoning_budget_processor(splitter, tokenizer, 4)
    assert processor is not None
    newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
    assert processor.forced == (tokenizer.think_end_id, *newlines)
