"""Tool-call parsing coverage: for each tool-call format mlx-lm's parsers know,
a model's text through our front gives the calls mlx-lm's parser gives
in-process.

Usage::

    python bench/bench_tool_parsers.py [--families json_tools mistral ...]
                                       [--out bench/results/tool_parsers.json]

For each module of ``mlx_lm.tool_parsers`` (a family):

1. A model directory: a copy of builtin:tiny-qwen3-tools (random weights;
   ``<think>``, ``<tool_call>`` and ``</tool_call>`` single tokens) whose
   ``tokenizer_config.json`` has a small chat template of our own holding the
   marker strings by which mlx-lm's ``_infer_tool_parser``
   (``mlx_lm/tokenizer_utils.py``) picks that family's parser, in a Jinja
   comment. Two families have no template marker: kimi_k3 is chosen by its
   vocabulary (tokens this model does not have) and laguna by nothing; their
   copies name the parser in ``tokenizer_config.json``'s
   ``tool_parser_type``, mlx-lm's own setting for that.
2. The daemon (one for the run) loads it by local path with the
   ``script_text`` fault (runner/faults.py): every generation writes
   ``Sure.`` then a call in the family's format, between its start and end
   markers, then EOS, through the real decode path (detokenizer, output
   splitter, front). The runner logs the parser mlx-lm chose for the model
   (``scripted_output``); that is the "parser" column.
3. The unmodified ``openai`` client asks with the tools, ``tool_choice``
   "auto", whole and streamed (the deltas assembled by index).
4. The same text between the markers goes to ``parser.parse_tool_call(text,
   tools)`` in this process; its calls (name, arguments as JSON) must equal
   the front's, whole and streamed, with ``Sure.`` as the content and
   ``finish_reason`` "tool_calls".

The markers are single tokens only where this vocabulary has them
(``<tool_call>``, ``</tool_call>``); elsewhere they are several tokens, which
the output splitter matches as text (the "start tokens" column says how
many). A real checkpoint has its own markers as single tokens.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib
import json
import pkgutil
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The families' sample calls live with the splitter's tests, which run them too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx_lm.tool_parsers
import openai
from mlx_lm.tokenizer_utils import load as load_tokenizer

from common import RESULTS_DIR, Daemon, log_records, machine_info, mlx_device, note, write_json
from ipc.messages import FAULTS_ENV
from runner.builtin import ensure_builtin_model
from supervisor.figures import render_table
from tool_call_formats import FORMATS as SAMPLES
from tool_call_formats import TOOLS

DEFAULT_OUT = RESULTS_DIR / "tool_parsers.json"
BASE_MODEL = "builtin:tiny-qwen3-tools"
CONTENT = "Sure."
CHAT = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]

# What mlx-lm's _infer_tool_parser looks for in a chat template, per family
# (None: it picks that family by other means; the copy sets tool_parser_type).
MARKERS: dict[str, str | None] = {
    "function_gemma": "<start_function_call>",
    "gemma4": "<|tool_call> <tool_call|>",
    "glm47": "<arg_key>",
    "json_tools": "<tool_call> tool_call.name",
    "kimi_k2": "<|tool_calls_section_begin|>",
    "kimi_k3": None,  # chosen by the vocabulary: <|open|>, <|close|>, <|sep|>, <|end_of_msg|>
    "laguna": None,  # never inferred
    "longcat": "<longcat_tool_call>",
    "minicpm5": '<function name=" <param name="',
    "minimax_m2": "<minimax:tool_call>",
    "mistral": "[TOOL_CALLS]",
    "muse_spark": "<atem:function_calls>",
    "pythonic": "<|tool_call_start|>",
    "qwen3_coder": "<tool_call>\n<function=",
}


# Our own template: ChatML turns, the tools as JSON in a system turn; the
# family's markers only in a comment, where mlx-lm's inference reads them.
TEMPLATE = (
    "{#- tool-call markup: MARKERS #}"
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def families() -> list[str]:
    return sorted(module.name for module in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__))


def model_dir(base: Path, root: Path, family: str) -> tuple[Path, str]:
    """A copy of ``base`` whose template (or tool_parser_type) picks ``family``'s
    parser; the directory and how the parser is picked."""
    target = root / f"tools-{family}"
    shutil.copytree(base, target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    markers = MARKERS.get(family)
    config["chat_template"] = TEMPLATE.replace("MARKERS", markers or "none")
    how = "template"
    if markers is None:
        config["tool_parser_type"] = family
        how = "tool_parser_type"
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return target, how


def in_process(family: str) -> tuple[Any, str, list[dict[str, Any]]]:
    """The family's parser module, the scripted text, and the calls the
    parser gives for the text between the markers."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    body = SAMPLES[family]
    parsed = module.parse_tool_call(body, TOOLS)
    calls = parsed if isinstance(parsed, list) else [parsed]
    text = f"{CONTENT}{module.tool_call_start}{body}{module.tool_call_end}"
    return module, text, [{"name": c["name"], "arguments": data(c["arguments"])} for c in calls]


def data(value: Any) -> Any:
    """A call's arguments as data (mlx-lm's parsers give a dict or JSON text)."""
    return json.loads(value) if isinstance(value, str) else value


def whole(api: openai.OpenAI, name: str) -> dict[str, Any]:
    reply = api.chat.completions.create(
        model=name, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=400
    )
    (choice,) = reply.choices
    message = choice.message
    return {
        "content": message.content,
        "calls": [
            {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
            for c in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


def streamed(api: openai.OpenAI, name: str) -> dict[str, Any]:
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    stream = api.chat.completions.create(
        model=name, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=400, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
    return {
        "content": "".join(content),
        "calls": [
            {"name": c["name"], "arguments": json.loads(c["arguments"])}
            for _, c in sorted(calls.items())
        ],
        "finish_reason": finish,
    }


def run_family(
    daemon: Daemon, api: openai.OpenAI, base: Path, root: Path, family: str
) -> dict[str, Any]:
    path, how = model_dir(base, root, family)
    module, text, expected = in_process(family)
    tokenizer = load_tokenizer(path)  # as the runner loads it: the marker's tokens
    start_tokens = len(tokenizer.encode(module.tool_call_start, add_special_tokens=False))
    record: dict[str, Any] = {
        "family": family,
        "picked_by": how,
        "start_marker": module.tool_call_start,
        "end_marker": module.tool_call_end,
        "start_tokens": start_tokens,
        "script": text,
        "expected_calls": expected,
    }
    name = f"p-{family}"
    script = base64.b64encode(text.encode("utf-8")).decode("ascii")
    try:
        daemon.client.load(str(path), name=name, env={FAULTS_ENV: f"script_text={script}"})
        record["whole"] = got = whole(api, name)
        record["streamed"] = flow = streamed(api, name)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        got = flow = None
    finally:
        with contextlib.suppress(Exception):
            daemon.client.unload(name)
    logged = log_records(daemon.process, "scripted_output", model=name)
    record["parser"] = logged[0].get("tool_parser") if logged else None
    record["parser_ok"] = record["parser"] == family
    record["calls_equal"] = got is not None and got["calls"] == expected
    record["streamed_equal"] = flow is not None and flow["calls"] == expected
    record["content_ok"] = got is not None and (got["content"] or "") == CONTENT
    record["finish_ok"] = got is not None and got["finish_reason"] == "tool_calls"
    return record


def yes(value: bool) -> str:
    return "yes" if value else "NO"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=None, help="default: every parser")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    known = families()
    chosen = args.families or known
    missing = sorted(set(known) - set(SAMPLES))
    if missing:  # a parser a new mlx-lm brought: it needs a sample and its markers here
        note(f"no sample for {', '.join(missing)}: not tried")
    chosen = [f for f in chosen if f in SAMPLES and f in known]
    results: dict[str, Any] = {"machine": machine_info(mlx_device()), "families": []}
    base = ensure_builtin_model(BASE_MODEL)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        daemon = Daemon.start(stack, root, "parsers", "", http="127.0.0.1:0")
        url = daemon.client.status().supervisor.http
        assert url is not None
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        for family in chosen:
            note(f"{family}")
            results["families"].append(run_family(daemon, api, base, root, family))
        results["shutdown"] = daemon.shutdown()
    results["untried"] = missing
    rows = [
        [
            r["family"],
            r["picked_by"],
            r["parser"] or "-",
            str(r["start_tokens"]),
            yes(r["calls_equal"]),
            yes(r["streamed_equal"]),
            yes(r["content_ok"]),
            yes(r["finish_ok"]),
            r.get("error", "")[:60],
        ]
        for r in results["families"]
    ]
    header = ["family", "picked by", "parser (runner)", "start tokens", "calls equal",
              "streamed equal", "content", "finish", "error"]  # fmt: skip
    print(render_table(header, rows))
    passed = sum(
        r["parser_ok"] and r["calls_equal"] and r["streamed_equal"] for r in results["families"]
    )
    results["summary"] = {"families": len(rows), "equal": passed}
    print(f"\n{passed}/{len(rows)} families: the runner took the family's parser and the"
          " front's calls equal the parser's, whole and streamed")  # fmt: skip
    write_json(results, args.out)
    note(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
