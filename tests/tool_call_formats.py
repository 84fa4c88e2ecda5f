"""A call in the format of each tool-call parser mlx-lm has (the text between
the parser's start and end tags, read from each parser's code): the splitter's
tests (tests/test_output.py) and the coverage bench (bench/bench_tool_parsers.py)
both run every family on these, with these tools."""

from __future__ import annotations

from typing import Any

# The tools the calls below call.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'

FORMATS: dict[str, str] = {
    "function_gemma": "call:get_weather{city:<escape>Paris<escape>,days:3}",
    "gemma4": 'call:get_weather{city:<|"|>Paris<|"|>,days:3}',
    "glm47": (
        "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
    ),
    "json_tools": f"\n{WEATHER}\n",
    "kimi_k2": (
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        '{"zone": "UTC"}<|tool_call_end|>'
    ),
    "kimi_k3": (
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
    ),
    "laguna": "get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value>",
    "longcat": (
        "get_weather<longcat_arg_key>city</longcat_arg_key>"
        "<longcat_arg_value>Paris</longcat_arg_value>"
    ),
    "minicpm5": '"get_weather"><param name="city">Paris</param><param name="days">3</param>',
    "minimax_m2": (
        '<invoke name="get_weather"><parameter name="city">Paris</parameter>'
        '<parameter name="days">3</parameter></invoke>'
    ),
    "mistral": 'get_weather[ARGS]{"city": "Paris", "days": 3}get_time[ARGS]{"zone": "UTC"}',
    "muse_spark": (
        '<atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>'
        "</atem:invoke>"
    ),
    "pythonic": '[get_weather(city="Paris", days=3), get_time(zone="UTC")]',
    "qwen3_coder": (
        "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n"
    ),
}
