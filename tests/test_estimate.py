"""The pre-load memory estimator: exact weights from safetensors headers, 003's KV formula."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from modelfiles.gguf import default_weight_dtype
from runner.builtin import ensure_builtin_model
from supervisor.cli.render import estimate_json, render_estimate
from supervisor.memory.baseline import RuntimeBaseline
from supervisor.memory.estimate import (
    DEFAULT_CONTEXT_TOKENS,
    HEADROOM_SHARE,
    RUNTIME_DEFAULT_BYTES,
    Estimate,
    default_context_tokens,
    describe_estimate,
    estimate_model_dir,
    estimate_reference,
    local_model_path,
    with_runtime,
)
from supervisor.memory.ranks import group_estimate

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4}

Tensor = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape


def write_header_only_safetensors(path: Path, tensors: list[Tensor]) -> None:
    """A safetensors file with a real header (contiguous data_offsets) and no tensor data:
    the estimator must get everything from the header."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = _DTYPE_BYTES[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body)


def write_model(directory: Path, config: dict[str, Any], tensors: list[Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    write_header_only_safetensors(directory / "model.safetensors", tensors)
    return directory


# --------------------------------------------------------------------------------------------
# Qwen3-4B, as in 003
# --------------------------------------------------------------------------------------------

QWEN3_4B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

# (out, in) of every matrix in one layer, and the 1-D norms.
_QWEN3_LAYER_MATRICES = {
    "self_attn.q_proj": (4096, 2560),
    "self_attn.k_proj": (1024, 2560),
    "self_attn.v_proj": (1024, 2560),
    "self_attn.o_proj": (2560, 4096),
    "mlp.gate_proj": (9728, 2560),
    "mlp.up_proj": (9728, 2560),
    "mlp.down_proj": (2560, 9728),
}
_QWEN3_LAYER_NORMS = {
    "self_attn.q_norm": 128,
    "self_attn.k_norm": 128,
    "input_layernorm": 2560,
    "post_attention_layernorm": 2560,
}

# 003's arithmetic, by hand:
#   per layer: q 4096*2560 + k 1024*2560 + v 1024*2560 + o 2560*4096  = 26,214,400
#              gate, up, down: 3 * 9728*2560                           = 74,711,040
#              q_norm + k_norm 2*128 + two layernorms 2*2560           =      5,376
#              -> 100,930,816 per layer, 3,633,509,376 for 36 layers
#   embedding 151,936*2560 = 388,956,160; final norm 2,560; lm_head tied (none)
QWEN3_4B_PARAMS = 36 * (26_214_400 + 74_711_040 + 5_376) + 388_956_160 + 2_560
QWEN3_4B_NORM_PARAMS = 36 * 5_376 + 2_560


def qwen3_4b_tensors(dtype: str = "BF16") -> list[Tensor]:
    tensors: list[Tensor] = [("model.embed_tokens.weight", dtype, (151936, 2560))]
    for i in range(36):
        prefix = f"model.layers.{i}."
        tensors += [
            (f"{prefix}{n}.weight", dtype, shape) for n, shape in _QWEN3_LAYER_MATRICES.items()
        ]
        tensors += [
            (f"{prefix}{n}.weight", dtype, (size,)) for n, size in _QWEN3_LAYER_NORMS.items()
        ]
    tensors.append(("model.norm.weight", dtype, (2560,)))
    return tensors


def qwen3_4b_4bit_tensors(group_size: int = 64) -> list[Tensor]:
    """mlx-lm's 4-bit layout: uint32 weights (8 values a word), bf16 scales and biases."""
    matrices = {"model.embed_tokens": (151936, 2560)}
    norms = {"model.norm": 2560}
    for i in range(36):
        prefix = f"model.layers.{i}."
        matrices |= {prefix + n: shape for n, shape in _QWEN3_LAYER_MATRICES.items()}
        norms |= {prefix + n: size for n, size in _QWEN3_LAYER_NORMS.items()}
    tensors: list[Tensor] = []
    for name, (rows, cols) in matrices.items():
        tensors += [
            (f"{name}.weight", "U32", (rows, cols // 8)),
            (f"{name}.scales", "BF16", (rows, cols // group_size)),
            (f"{name}.biases", "BF16", (rows, cols // group_size)),
        ]
    tensors += [(f"{name}.weight", "BF16", (size,)) for name, size in norms.items()]
    return tensors


def test_qwen3_4b_params_match_003() -> None:
    assert QWEN3_4B_PARAMS == 4_022_468_096  # 003: "Total: ~4,022M params"


def test_qwen3_4b_weights_are_params_times_two_bytes_from_the_header_alone(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path / "qwen3-4b", QWEN3_4B_CONFIG, qwen3_4b_tensors())
    # Only a header: any attempt to read tensor data would find nothing.
    assert (model / "model.safetensors").stat().st_size < 100_000

    estimate = estimate_model_dir(model, context_tokens=128)

    assert estimate.weights_bytes == QWEN3_4B_PARAMS * 2 == 8_044_936_192
    assert estimate.weights_source == "safetensors"
    assert estimate.path == str(model)
    assert estimate.vision is False
    assert estimate.vision_bytes == 0


def test_qwen3_4b_kv_cache_follows_003_formula(tmp_path: Path) -> None:
    model = write_model(tmp_path / "bf16", QWEN3_4B_CONFIG, qwen3_4b_tensors())

    at_128 = estimate_model_dir(model, context_tokens=128)
    assert at_128.context_tokens == 128
    assert at_128.kv_cache_bytes == 2 * 128 * 36 * 8 * 128 * 2 == 18_874_368

    default = estimate_model_dir(model)
    assert default.context_tokens == min(40960, DEFAULT_CONTEXT_TOKENS) == 8192
    assert default.kv_cache_bytes == 2 * 8192 * 36 * 8 * 128 * 2


def test_float32_config_doubles_the_kv_cache_to_003s_36_mb(tmp_path: Path) -> None:
    config = QWEN3_4B_CONFIG | {"torch_dtype": "float32"}
    model = write_model(tmp_path / "f32", config, qwen3_4b_tensors("F32"))

    estimate = estimate_model_dir(model, context_tokens=128)

    assert estimate.kv_cache_bytes == 2 * 128 * 36 * 8 * 128 * 4 == 37_748_736  # "36 MB"
    assert estimate.weights_bytes == QWEN3_4B_PARAMS * 4
    # 003: "Activations: ~10 MB" at seq 128 (f32); ours is the same order.
    assert 5 * 2**20 < estimate.activation_bytes < 40 * 2**20


def test_quantized_weights_are_the_exact_header_byte_counts(tmp_path: Path) -> None:
    config = QWEN3_4B_CONFIG | {"quantization": {"group_size": 64, "bits": 4}}
    model = write_model(tmp_path / "4bit", config, qwen3_4b_4bit_tensors())

    estimate = estimate_model_dir(model, context_tokens=128)

    # A 4-bit matrix element costs 1/2 byte plus bf16 scale and bias per 64: 0.5 + 4/64 bytes.
    matrix_params = QWEN3_4B_PARAMS - QWEN3_4B_NORM_PARAMS
    expected = matrix_params // 2 + matrix_params * 4 // 64 + QWEN3_4B_NORM_PARAMS * 2
    assert expected == 2_262_920_192
    assert estimate.weights_bytes == expected
    # The KV cache stays in the activation dtype (bfloat16), quantized weights or not.
    assert estimate.kv_cache_bytes == 18_874_368


def test_total_is_the_sum_of_the_parts(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())

    e = estimate_model_dir(model, context_tokens=4096)

    parts = (
        e.weights_bytes,
        e.kv_cache_bytes,
        e.activation_bytes,
        e.overhead_bytes,
        e.vision_bytes,
    )
    assert all(part >= 0 for part in parts)
    assert e.total_bytes == sum(parts)
    assert e.overhead_bytes > e.runtime_bytes > 0
    assert e.activation_bytes > 0


# --------------------------------------------------------------------------------------------
# Runtime overhead and headroom
# --------------------------------------------------------------------------------------------


def test_without_a_measurement_the_runtime_is_the_stated_default(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())

    e = estimate_model_dir(model)

    assert (e.runtime_bytes, e.overhead_source) == (RUNTIME_DEFAULT_BYTES, "default")


def test_a_measured_runtime_replaces_the_default_in_overhead_and_total(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())
    e = estimate_model_dir(model, context_tokens=4096)
    measured = 90 * 2**20

    planned = with_runtime(e, measured, "spare")

    assert (planned.runtime_bytes, planned.overhead_source) == (measured, "spare")
    assert planned.overhead_bytes == e.overhead_bytes - RUNTIME_DEFAULT_BYTES + measured
    assert planned.total_bytes == e.total_bytes - RUNTIME_DEFAULT_BYTES + measured
    assert planned.headroom_bytes == e.headroom_bytes  # the model's parts did not change
    assert with_runtime(planned, RUNTIME_DEFAULT_BYTES, "default") == e


def test_headroom_is_a_share_of_the_model_not_a_fixed_floor() -> None:
    tiny, small = estimate_reference("builtin:tiny"), estimate_reference("builtin:small")
    assert tiny is not None and small is not None

    for e in (tiny, small):
        model_part = e.total_bytes - e.runtime_bytes
        assert e.headroom_bytes == round(HEADROOM_SHARE * model_part)
    assert tiny.headroom_bytes < 16 * 2**20 < small.headroom_bytes  # no 256 MiB floor


def test_a_group_splits_the_model_and_counts_a_runtime_per_local_rank(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())
    one = with_runtime(estimate_model_dir(model, context_tokens=4096), 90 * 2**20, "runner")

    two_here = group_estimate(one, 2)
    one_of_two = group_estimate(one, 2, local=1)

    assert two_here.runtime_bytes == 2 * one.runtime_bytes
    assert one_of_two.runtime_bytes == one.runtime_bytes
    assert two_here.overhead_source == "runner"
    for e in (two_here, one_of_two):
        parts = (e.weights_bytes + e.kv_cache_bytes + e.activation_bytes + e.overhead_bytes
                 + e.vision_bytes)  # fmt: skip
        assert abs(e.total_bytes - parts) <= 2  # each split part rounded down on its own
        model_part = e.total_bytes - e.runtime_bytes
        assert abs(e.headroom_bytes - HEADROOM_SHARE * model_part) <= 1


def test_the_runtime_baseline_takes_a_spare_over_a_runner_over_the_default() -> None:
    baseline = RuntimeBaseline()
    assert (baseline.runtime_bytes, baseline.source, baseline.measured) == (
        RUNTIME_DEFAULT_BYTES, "default", False)  # fmt: skip

    baseline.observe(95 * 2**20, "runner")  # a runner at its start, before its weights
    assert (baseline.runtime_bytes, baseline.source, baseline.measured) == (
        95 * 2**20, "runner", True)  # fmt: skip

    baseline.observe(88 * 2**20, "spare")
    baseline.observe(120 * 2**20, "runner")  # a spare's reading is not replaced by a runner's
    assert (baseline.runtime_bytes, baseline.source) == (88 * 2**20, "spare")

    baseline.observe(90 * 2**20, "spare")  # the latest spare is the truth
    baseline.observe(0, "spare")  # a process gone before it was read: no reading
    assert (baseline.runtime_bytes, baseline.source) == (90 * 2**20, "spare")


def test_the_runtime_baseline_applies_itself_to_an_estimate(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())
    e = estimate_model_dir(model)
    baseline = RuntimeBaseline()
    assert baseline.apply(e) == e
    baseline.observe(91 * 2**20, "spare")
    assert baseline.apply(e) == with_runtime(e, 91 * 2**20, "spare")


def test_index_json_names_the_weight_files_and_other_safetensors_are_ignored(
    tmp_path: Path,
) -> None:
    model = tmp_path / "sharded"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    tensors = qwen3_4b_tensors()
    shards = {
        "model-00001-of-00002.safetensors": tensors[:200],
        "model-00002-of-00002.safetensors": tensors[200:],
    }
    weight_map: dict[str, str] = {}
    for file, part in shards.items():
        write_header_only_safetensors(model / file, part)
        weight_map |= {name: file for name, _, _ in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # Mistral-style repositories ship a second copy of the weights in another layout.
    write_header_only_safetensors(model / "consolidated.safetensors", tensors)

    assert estimate_model_dir(model).weights_bytes == QWEN3_4B_PARAMS * 2


# --------------------------------------------------------------------------------------------
# Multimodal configs
# --------------------------------------------------------------------------------------------

VLM_CONFIG: dict[str, Any] = {
    "model_type": "llava",
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
    },
    "text_config": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 256,  # not 4096 / 32 = 128
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
}

VLM_TENSORS: list[Tensor] = [
    ("language_model.model.embed_tokens.weight", "BF16", (32000, 4096)),
    ("language_model.model.layers.0.self_attn.k_proj.weight", "BF16", (2048, 4096)),
    ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "BF16", (4096, 1024)),
    ("multi_modal_projector.linear_1.weight", "BF16", (4096, 1024)),
]


def test_nested_text_config_with_vision_config_is_a_vision_model(tmp_path: Path) -> None:
    model = write_model(tmp_path / "llava", VLM_CONFIG, VLM_TENSORS)

    estimate = estimate_model_dir(model)

    assert estimate.vision is True
    assert estimate.vision_bytes > 0
    assert estimate.context_tokens == 4096  # text_config's max_position_embeddings
    # head_dim 256 from text_config, not hidden_size / heads
    assert estimate.kv_cache_bytes == 2 * 4096 * 4 * 8 * 256 * 2
    assert estimate.weights_bytes == 2 * (32000 * 4096 + 2048 * 4096 + 2 * 4096 * 1024)
    assert estimate.total_bytes == (
        estimate.weights_bytes
        + estimate.kv_cache_bytes
        + estimate.activation_bytes
        + estimate.overhead_bytes
        + estimate.vision_bytes
    )


def test_top_level_keys_win_over_text_config() -> None:
    config = VLM_CONFIG | {"max_position_embeddings": 2048}
    assert default_context_tokens(config) == 2048
    assert default_context_tokens(VLM_CONFIG) == 4096
    assert default_context_tokens({}) == DEFAULT_CONTEXT_TOKENS
    assert default_context_tokens({"max_position_embeddings": 131072}) == DEFAULT_CONTEXT_TOKENS


def test_vision_tower_tensors_alone_mark_a_vision_model(tmp_path: Path) -> None:
    text_only_config = dict(VLM_CONFIG["text_config"])
    model = write_model(tmp_path / "vlm", text_only_config, VLM_TENSORS)

    assert estimate_model_dir(model).vision is True


def test_head_dim_defaults_to_hidden_over_heads(tmp_path: Path) -> None:
    config = QWEN3_4B_CONFIG.copy()
    del config["head_dim"]  # 2560 / 32 = 80
    del config["num_key_value_heads"]  # defaults to num_attention_heads: 32
    model = write_model(tmp_path / "m", config, qwen3_4b_tensors())

    assert (
        estimate_model_dir(model, context_tokens=128).kv_cache_bytes == 2 * 128 * 36 * 32 * 80 * 2
    )


# --------------------------------------------------------------------------------------------
# Corrupt files, other formats
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ((1000).to_bytes(8, "little") + b"{}", "beyond the end of the file"),
        ((2**40).to_bytes(8, "little") + b"{}", "over the"),
        ((8).to_bytes(8, "little") + b"not json", "not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        (b"\x01\x02", "shorter than 8 bytes"),
    ],
    ids=["length-past-end", "length-over-limit", "not-json", "not-an-object", "truncated"],
)
def test_corrupt_safetensors_header_raises_value_error_naming_the_file(
    tmp_path: Path, content: bytes, complaint: str
) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    weights = model / "model.safetensors"
    weights.write_bytes(content)

    with pytest.raises(ValueError, match=re.escape(str(weights))) as raised:
        estimate_model_dir(model)
    assert complaint in str(raised.value)


def test_tensor_without_data_offsets_raises_value_error_naming_it(tmp_path: Path) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    body = json.dumps({"a.weight": {"dtype": "BF16", "shape": [2]}}).encode()
    (model / "model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)

    with pytest.raises(ValueError, match=re.escape("'a.weight' has no valid data_offsets")):
        estimate_model_dir(model)


# --------------------------------------------------------------------------------------------
# GGUF files: estimated as the runner converts them, from the header alone
# --------------------------------------------------------------------------------------------

_GGUF_Q4_0 = 2  # ggml type ids
_GGUF_F32 = 0


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(value: Any) -> bytes:
    """A GGUF metadata value: its type, then its bytes (uint32, float32, string, arrays)."""
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _gguf_string(value)
    if all(isinstance(item, str) for item in value):
        items = b"".join(_gguf_string(item) for item in value)
        return struct.pack("<IIQ", 9, 8, len(value)) + items
    return struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)


def gguf_header_bytes(
    metadata: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], int]], version: int = 3
) -> bytes:
    """A GGUF header (metadata, then tensor infos: shape innermost first, ggml type)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, value in metadata.items():
        out += _gguf_string(key) + _gguf_value(value)
    offset = 0
    for name, (shape, kind) in tensors.items():
        out += _gguf_string(name) + struct.pack(
            f"<I{len(shape)}QIQ", len(shape), *shape, kind, offset
        )
        offset += 1 << 20
    return out


LLAMA_GGUF_METADATA: dict[str, Any] = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": [f"token{i}" for i in range(100)],
    "tokenizer.ggml.token_type": [1] * 100,
}


def llama_gguf_tensors() -> dict[str, tuple[tuple[int, ...], int]]:
    tensors = {"token_embd.weight": ((64, 100), _GGUF_Q4_0), "output_norm.weight": ((64,), 0)}
    for i in range(2):
        tensors |= {
            f"blk.{i}.attn_norm.weight": ((64,), _GGUF_F32),
            f"blk.{i}.attn_q.weight": ((64, 64), _GGUF_Q4_0),
            f"blk.{i}.attn_k.weight": ((64, 32), _GGUF_Q4_0),
            f"blk.{i}.attn_v.weight": ((64, 32), _GGUF_Q4_0),
            f"blk.{i}.attn_output.weight": ((64, 64), _GGUF_Q4_0),
            f"blk.{i}.ffn_norm.weight": ((64,), _GGUF_F32),
            f"blk.{i}.ffn_gate.weight": ((64, 128), _GGUF_Q4_0),
            f"blk.{i}.ffn_up.weight": ((64, 128), _GGUF_Q4_0),
            f"blk.{i}.ffn_down.weight": ((128, 64), _GGUF_Q4_0),
        }
    return tensors


# Embedding 100 x 64 (tied) + the final norm + 2 layers of (2 norms + q, k, v, o + 3 MLP).
LLAMA_GGUF_PARAMS = 100 * 64 + 64 + 2 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64)


def test_gguf_file_is_estimated_dequantized_from_its_header_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "model-q4.gguf"
    gguf.write_bytes(gguf_header_bytes(LLAMA_GGUF_METADATA, llama_gguf_tensors()))  # no data
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))  # not the model's: unused
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where no conversion is

    estimate = estimate_model_dir(gguf, context_tokens=128)

    element = {"float32": 4, "float16": 2}[default_weight_dtype()]
    assert estimate.weights_bytes == LLAMA_GGUF_PARAMS * element
    # 2 (K and V) x 128 tokens x 2 layers x 2 kv heads x head_dim 16 x the converted dtype
    assert estimate.kv_cache_bytes == 2 * 128 * 2 * 2 * 16 * element
    assert (estimate.weights_source, estimate.path) == ("gguf", str(gguf))
    assert estimate_model_dir(gguf).context_tokens == 256  # the GGUF's context length
    assert local_model_path(str(gguf)) == gguf.resolve()
    assert estimate_reference(str(gguf), context_tokens=128) == msgspec.structs.replace(
        estimate, path=str(gguf.resolve())
    )
    assert "GGUF header" in render_estimate(estimate, "model-q4.gguf")


def _truncated_header() -> bytes:
    return gguf_header_bytes(LLAMA_GGUF_METADATA, llama_gguf_tensors())[:-30]


def _huge_string_in_an_array() -> bytes:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string("tokenizer.ggml.tokens")
    return header + struct.pack("<IIQQ", 9, 8, 1, 2**40) + b"x" * 64


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (b"not a gguf file at all", "model.gguf is not a readable GGUF file: it does not begin"),
        (b"GG", "model.gguf is not a readable GGUF file: it is too short"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1 is not supported"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "model.gguf: big-endian GGUF files"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0), "tensors do not fit in the file"),
        (_truncated_header(), "its header is cut short"),
        (_huge_string_in_an_array(), "its header is cut short"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string("k") + struct.pack("<I", 99),
            "unknown metadata value type 99",
        ),
        (
            gguf_header_bytes({**LLAMA_GGUF_METADATA, "general.architecture": "qwen2"}, {}),
            "model.gguf: GGUF architecture 'qwen2' is not supported",
        ),
        (
            gguf_header_bytes(
                LLAMA_GGUF_METADATA,
                llama_gguf_tensors() | {"blk.1.attn_k.weight": ((64, 48), _GGUF_Q4_0)},
            ),
            "model.gguf: tensors do not match the llama config",
        ),
    ],
    ids=[
        "not-gguf",
        "empty",
        "version-1",
        "big-endian",
        "absurd-count",
        "truncated",
        "huge-string",
        "unknown-type",
        "not-llama",
        "wrong-shapes",
    ],
)
def test_gguf_file_the_runner_cannot_load_raises_value_error_naming_it(
    tmp_path: Path, content: bytes, complaint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(complaint)):
        estimate_model_dir(gguf)


def test_directory_of_gguf_files_counts_their_size_on_disk(tmp_path: Path) -> None:
    (tmp_path / "model-q4.gguf").write_bytes(b"GGUF" + bytes(12_340))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))

    directory = estimate_model_dir(tmp_path, context_tokens=128)

    assert (directory.weights_bytes, directory.weights_source) == (12_344, "disk")
    assert directory.kv_cache_bytes == 18_874_368


def test_directory_without_weight_files_counts_its_size_on_disk(tmp_path: Path) -> None:
    (tmp_path / "weights.npz").write_bytes(bytes(5000))
    (tmp_path / "config.json").write_text("{}")

    estimate = estimate_model_dir(tmp_path)

    assert estimate.weights_source == "disk"
    assert estimate.weights_bytes == 5002
    assert estimate.context_tokens == DEFAULT_CONTEXT_TOKENS


def test_missing_directory_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        estimate_model_dir(tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------
# Builtin models: the estimate against the real files
# --------------------------------------------------------------------------------------------


def mlx_tensor_bytes(model_dir: Path) -> int:
    import mlx.core as mx

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        arrays = mx.load(str(file))
        assert isinstance(arrays, dict)
        total += sum(array.nbytes for array in arrays.values())
    return total


@pytest.mark.parametrize(
    "model", ["builtin:tiny", "builtin:small", "builtin:tiny-qwen3", "builtin:tiny-embed"]
)
def test_builtin_weights_match_the_bytes_mlx_loads(model: str) -> None:
    model_dir = ensure_builtin_model(model)

    estimate = estimate_reference(model)

    assert estimate is not None
    assert estimate.weights_source == "safetensors"
    assert estimate.path == str(model_dir)
    loaded = mlx_tensor_bytes(model_dir)
    assert abs(estimate.weights_bytes - loaded) <= 0.05 * loaded


@pytest.mark.parametrize(
    "model",
    ["builtin:tiny", "builtin:small", "builtin:tiny-qwen3", "builtin:tiny-embed",
     "builtin:spec-draft"],
)  # fmt: skip
def test_builtin_estimate_from_the_recipe_matches_the_built_directory(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_dir = estimate_model_dir(ensure_builtin_model(model))  # the session's cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))
    assert local_model_path(model) is None
    from_recipe = estimate_reference(model)

    assert not (tmp_path / "fresh-cache").exists()  # nothing was built
    assert from_recipe is not None
    assert (from_recipe.weights_source, from_recipe.path) == ("builtin", None)
    assert abs(from_recipe.total_bytes - from_dir.total_bytes) <= 0.01 * from_dir.total_bytes
    # In fact the recipe gives the very bytes the headers will record.
    same_origin = msgspec.structs.replace(
        from_recipe, weights_source=from_dir.weights_source, path=from_dir.path
    )
    assert same_origin == from_dir


def test_unknown_builtin_has_no_estimate() -> None:
    assert estimate_reference("builtin:enormous") is None
    assert local_model_path("builtin:enormous") is None


# --------------------------------------------------------------------------------------------
# Hugging Face references
# --------------------------------------------------------------------------------------------


def test_repo_not_in_the_local_hub_cache_has_no_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    assert local_model_path("nobody-here/no-such-model-7b") is None
    assert estimate_reference("nobody-here/no-such-model-7b") is None
    assert estimate_reference("not a path or a repo") is None


def test_repo_in_the_local_hub_cache_is_estimated_from_its_snapshot(tmp_path: Path) -> None:
    # The hub cache's on-disk layout; huggingface_hub reads HF_HOME when imported, hence the
    # fresh process.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--mlx-community--Qwen3-4B-4bit"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = write_model(
        repo / "snapshots" / commit,
        QWEN3_4B_CONFIG | {"quantization": {"group_size": 64, "bits": 4}},
        qwen3_4b_4bit_tensors(),
    )
    env = os.environ | {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    script = (
        "import json, sys\n"
        "import msgspec\n"
        "from supervisor.memory.estimate import estimate_reference\n"
        "estimate = estimate_reference('mlx-community/Qwen3-4B-4bit', 128)\n"
        "print(json.dumps(msgspec.to_builtins(estimate)))\n"
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'numpy') if m in sys.modules))\n"
    )

    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    estimate_line, imported_line = done.stdout.splitlines()
    estimate = json.loads(estimate_line)
    assert estimate["path"] == str(snapshot)
    assert estimate["weights_bytes"] == 2_262_920_192
    assert estimate["kv_cache_bytes"] == 18_874_368
    assert imported_line == "[]"  # the daemon side never imports mlx, mlx_lm or numpy


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def test_estimate_json_has_exactly_the_documented_keys(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())

    document = estimate_json(estimate_model_dir(model))

    assert set(document) == {
        "weights_bytes",
        "kv_cache_bytes",
        "activation_bytes",
        "overhead_bytes",
        "vision_bytes",
        "total_bytes",
        "context_tokens",
        "vision",
        "weights_source",
        "path",
        "runtime_bytes",
        "overhead_source",
        "headroom_bytes",
        "kv_bits",
        "kv_group_size",
        "draft_bytes",
        "draft_model",
        "planned_bytes",
    }
    assert document["planned_bytes"] == document["total_bytes"] + document["headroom_bytes"]
    json.dumps(document)  # serialisable as is


def test_render_estimate_prints_a_line_per_part_and_the_source() -> None:
    gib = 2**30
    estimate = Estimate(
        weights_bytes=8 * gib,
        kv_cache_bytes=18_874_368,
        activation_bytes=10 * 2**20,
        overhead_bytes=gib // 2,
        vision_bytes=gib + gib // 5,
        total_bytes=8 * gib + 18_874_368 + 10 * 2**20 + gib // 2 + gib + gib // 5,
        context_tokens=128,
        vision=True,
        weights_source="safetensors",
        path="/models/qwen",
        runtime_bytes=gib // 8,
        overhead_source="spare",
        headroom_bytes=gib,
    )

    text = render_estimate(estimate, "qwen")

    assert text.splitlines()[0] == "qwen (vision model)"
    assert re.search(r"weights\s+8\.0 GiB", text)
    assert re.search(r"KV cache \(128 tokens\)\s+18\.0 MiB", text)
    assert re.search(r"activations\s+10\.0 MiB", text)
    assert re.search(r"runner overhead\s+512\.0 MiB", text)
    assert re.search(r"vision encoder\s+1\.2 GiB", text)
    assert re.search(r"total\s+9\.7 GiB", text)
    assert re.search(r"runtime \(measured: the warm spare\)\s+128\.0 MiB", text)
    assert re.search(r"headroom\s+1\.0 GiB", text)
    assert re.search(r"planned\s+10\.7 GiB", text)
    assert "safetensors headers" in text
    assert "/models/qwen" in text
    text_only = msgspec.structs.replace(estimate, vision=False, vision_bytes=0)
    assert "vision encoder" not in render_estimate(text_only, "qwen")


# --------------------------------------------------------------------------------------------
# A quantized KV cache (kv_bits, kv_group_size)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "bits", "group", "share"),
    # mlx-lm's QuantizedKVCache per element: bits/8, plus a scale and a bias in the model's
    # dtype per group (a bf16 KVCache of 131072 B became 69632 B at 8-bit/64: 0.53125).
    [("bfloat16", 8, 64, 0.53125), ("bfloat16", 4, 64, 0.28125), ("bfloat16", 8, 32, 0.5625),
     ("bfloat16", 4, 32, 0.3125), ("float32", 8, 64, 0.28125), ("float32", 4, 32, 0.1875)],
)  # fmt: skip
def test_a_quantized_kv_cache_is_packed_bits_plus_a_scale_and_bias_per_group(
    tmp_path: Path, dtype: str, bits: int, group: int, share: float
) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG | {"torch_dtype": dtype}, [])

    full = estimate_model_dir(model, context_tokens=128)
    quantized = estimate_model_dir(model, context_tokens=128, kv_bits=bits, kv_group_size=group)

    assert quantized.kv_cache_bytes == full.kv_cache_bytes * share
    assert (quantized.kv_bits, quantized.kv_group_size) == (bits, group)
    assert (full.kv_bits, full.kv_group_size) == (None, None)


def test_a_quantized_kv_cache_shrinks_the_total_by_the_kv_saved_less_one_dequantized_layer(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())

    full = estimate_model_dir(model, context_tokens=4096)
    quantized = estimate_model_dir(model, context_tokens=4096, kv_bits=8)

    saved = full.kv_cache_bytes - quantized.kv_cache_bytes
    assert saved == 2 * 4096 * 36 * 8 * (256 - 136)  # 128 bf16 values: 256 B; 8-bit/64: 136 B
    # A prefill step's fused attention reads one layer's K and V dequantized.
    dequantized_layer = 2 * 4096 * 8 * 128 * 2
    assert quantized.activation_bytes == full.activation_bytes + dequantized_layer
    assert quantized.total_bytes == full.total_bytes - saved + dequantized_layer
    assert quantized.weights_bytes == full.weights_bytes


def test_kv_bits_reaches_builtin_and_gguf_estimates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = estimate_reference("builtin:tiny", 256)
    quantized = estimate_reference("builtin:tiny", 256, kv_bits=8, kv_group_size=32)
    assert recipe is not None and quantized is not None
    assert quantized.kv_bits == 8 and quantized.kv_cache_bytes < recipe.kv_cache_bytes
    gguf = tmp_path / "model-q4.gguf"
    gguf.write_bytes(gguf_header_bytes(LLAMA_GGUF_METADATA, llama_gguf_tensors()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # not converted
    element = {"float32": 4, "float16": 2}[default_weight_dtype()]
    from_header = estimate_model_dir(gguf, context_tokens=128, kv_bits=4, kv_group_size=32)
    # head_dim 16 with groups of 32: 16 x 4 bits, and one group's scale and bias
    assert from_header.kv_cache_bytes == 2 * 128 * 2 * 2 * (16 * 4 // 8 + 2 * element)
    assert (from_header.kv_bits, from_header.kv_group_size) == (4, 32)


def test_the_estimate_names_the_kv_cache_s_bits_in_its_table_line_and_json(
    tmp_path: Path,
) -> None:
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG, qwen3_4b_tensors())
    quantized = estimate_model_dir(model, context_tokens=128, kv_bits=4, kv_group_size=32)
    full = estimate_model_dir(model, context_tokens=128)

    assert re.search(r"KV cache \(128 tokens, 4-bit, groups of 32\)\s+5\.6 MiB",
                     render_estimate(quantized, "qwen"))  # fmt: skip
    assert "KV cache 5.6 MiB (128 tokens, 4-bit, groups of 32)" in describe_estimate(quantized)
    assert "KV cache (128 tokens) " in render_estimate(full, "qwen")
    assert "(128 tokens)" in describe_estimate(full)
    for estimate, expected in ((quantized, (4, 32)), (full, (None, None))):
        document = estimate_json(estimate)
        assert (document["kv_bits"], document["kv_group_size"]) == expected


def test_the_estimate_command_takes_kv_bits_and_group_size() -> None:
    command = [sys.executable, "-m", "supervisor", "estimate", "builtin:tiny", "--context", "256"]
    quantized = subprocess.run([*command, "--kv-bits", "8", "--kv-group-size", "32", "--json"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert quantized.returncode == 0, quantized.stderr
    document = json.loads(quantized.stdout)
    assert (document["kv_bits"], document["kv_group_size"]) == (8, 32)
    refused = subprocess.run([*command, "--kv-bits", "6"], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "--kv-bits" in refused.stderr


def test_a_quantized_kv_cache_of_a_sliding_window_model_counts_its_unquantized_window(
    tmp_path: Path,
) -> None:
    """The runner leaves sliding-window layers in the model's dtype (mlx-lm
    cannot quantize a rotating cache): each layer counts as the larger of its
    quantized context and its unquantized window, an upper bound still."""
    window = 1024
    model = write_model(tmp_path / "m", QWEN3_4B_CONFIG | {"sliding_window": window}, [])
    vectors = 2 * 36 * 8  # K and V, layers, KV heads
    for context, bits, expected in (
        (8192, 8, vectors * 8192 * 136),  # quantized context: more than the window's bf16
        (1024, 4, vectors * 1024 * 256),  # the window, unquantized: more than 4-bit context
    ):
        estimate = estimate_model_dir(model, context_tokens=context, kv_bits=bits)
        assert estimate.kv_cache_bytes == expected, (context, bits)
