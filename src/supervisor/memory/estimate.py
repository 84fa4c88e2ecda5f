"""The pre-load estimate: how much memory a model's runner will need, before it starts.

003's formula, for MLX: weights + KV cache + activations + overhead, plus an allowance for a
vision encoder's activations (ADR-016). Weights are exact where the model ships safetensors (the
byte ranges in the file headers, quantized tensors included); the rest come from ``config.json``.
The overhead's largest part, the runner's runtime (Python, mlx and mlx_lm imported, no model),
is measured by the daemon (:mod:`supervisor.memory.baseline`, applied with :func:`with_runtime`);
the estimate alone carries :data:`RUNTIME_DEFAULT_BYTES` and says so (``overhead_source``).
Admission plans the total plus ``headroom_bytes``, a share of the model's own parts.
A GGUF file is estimated as the runner will load it, converted and dequantized (see
``runner.gguf_import``): from its conversion when there is one, else from its header. The
tensor data itself is never read, and mlx, mlx_lm, numpy and gguf-py are never imported: this
runs inside the daemon. The file readers (safetensors and GGUF headers, builtin recipes, cache
paths) are :mod:`modelfiles`'s, which the runner shares; this module keeps the arithmetic.
"""

from __future__ import annotations

import errno
import functools
import json
from pathlib import Path
from typing import Any

import msgspec

from modelfiles.builtin import (
    BUILTIN_PREFIX,
    built_builtin_model_dir,
    builtin_config_and_weight_bytes,
)
from modelfiles.gguf import built_gguf_model_dir, gguf_config_and_weight_bytes
from modelfiles.safetensors import safetensors_tensor_bytes
from supervisor.units import format_bytes

__all__ = [
    "DEFAULT_CONTEXT_TOKENS",
    "HEADROOM_SHARE",
    "OVERHEAD_SOURCE_TEXT",
    "RUNTIME_DEFAULT_BYTES",
    "Estimate",
    "default_context_tokens",
    "describe_estimate",
    "describe_kv_cache",
    "estimate_model_dir",
    "estimate_reference",
    "local_model_path",
    "with_draft",
    "with_runtime",
]

MiB = 1024**2

# The KV cache is planned for this many tokens unless the model's own limit is smaller or the
# model's config asks for another figure (ModelSpec.context_tokens).
DEFAULT_CONTEXT_TOKENS = 8192
# mlx_lm.generate_step prefills the prompt in steps of this many tokens (its prefill_step_size
# default), evaluating the cache after each: activations never span more tokens than this.
PREFILL_STEP_TOKENS = 2048
# Live tensors of one layer during a prefill step, in units of seq x max(hidden, intermediate):
# the MLP's gate, up and gate*up products (3 x seq x intermediate) plus the residual stream
# (seq x hidden). Layers run one after another and MLX frees a finished layer's intermediates.
ACTIVATION_MULTIPLIER = 4
# Activation (and KV cache) element size when config.json names no dtype: bfloat16/float16.
DEFAULT_BYTES_PER_ELEMENT = 2
# A runner's runtime before any model (Python, mlx and mlx_lm imported) when nothing has been
# measured yet: the daemon measures its warm spare (or its first runner at its start) instead,
# and the ``estimate`` command has neither. A warm spare held 87-89 MiB RSS (Linux, CPU backend,
# mlx 0.32.4, mlx-lm 0.32.2, bench_memory.py); rounded up for a GPU's device context, which
# this machine cannot show.
RUNTIME_DEFAULT_BYTES = 128 * MiB
# What loading a model adds to the runtime besides its tensors and tokenizer, about the same for
# any model: the model's modules, the engine's generation state. builtin:tiny (1.4 MB of
# weights) peaked 17 MiB above its warm spare's RSS plus MLX's peak, after 512 tokens (VmHWM,
# bench_memory.py); rounded up.
MODEL_RUNTIME_BYTES = 20 * MiB
# The tokenizer in memory (the fast tokenizer's tables and transformers' wrapper) grows with the
# vocabulary: loading it added 4.1 MiB RSS for builtin:small's 2,048 tokens and 50.3 MiB for
# builtin:smollm2's 49,152 (Linux, tokenizers 0.22): a base and about 1 KiB a token.
TOKENIZER_BASE_BYTES = 4 * MiB
TOKENIZER_BYTES_PER_TOKEN = 1024
# Memory outside MLX's own count that grows with the weights: the blocks malloc keeps after MLX
# frees them, the loader's transient copies. What builtin:small and smollm2 peaked at beyond
# the runtime, tokenizer, MLX's peak and the constant above was under 2% of their weights.
ALLOCATOR_SHARE_OF_WEIGHTS = 0.02
# Admission plans an estimate plus this share of the model's own parts (all but the measured
# runtime): what the estimate may miss grows with the model, not with the machine.
HEADROOM_SHARE = 0.10
# Vision encoder extra beyond its weights (which are already counted): image tensors and one
# image's encoder activations, about constant, plus a share of all weights because the image
# features then pass through the language model at its width (projector output, cross-attention
# keys and values). ADR-016 saw ~2-5 GB for Llama-3.2-90B-Vision-4bit (49.9 GB): this gives
# 2.5 GB there and 0.75 GB for the 11B (6 GB).
VISION_BASE_BYTES = 512 * MiB
VISION_SHARE_OF_WEIGHTS = 0.04
_BYTES_PER_DTYPE = {"float32": 4, "float16": 2, "bfloat16": 2}
# Name components of vision-tower tensors across the common multimodal checkpoints
# (LLaVA, Pixtral, Llama 3.2 Vision, Qwen2-VL, Gemma 3, Idefics, ...).
_VISION_TENSOR_PARTS = frozenset(
    {
        "vision_tower",
        "vision_model",
        "visual",
        "vision_encoder",
        "multi_modal_projector",
        "mm_projector",
    }
)
_GGUF_MAGIC = b"GGUF"  # how a GGUF file begins
# What snapshot_download must find in the cache for the estimate (and a load) to work.
_HF_ALLOW_PATTERNS = ["*.json", "*.safetensors"]
KvQuantization = tuple[int | None, int]
"""The KV cache's bits (None: the model's dtype) and group size, as ``kv_bits`` and
``kv_group_size`` of a model's config."""


class Estimate(msgspec.Struct, frozen=True):
    """A model's expected peak memory, part by part, in bytes."""

    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    vision_bytes: int  # vision encoder extra (0 for text models)
    total_bytes: int  # sum of the above
    context_tokens: int  # what the KV cache was planned for
    vision: bool
    weights_source: str  # "safetensors" (exact), "gguf" (header), "disk" (size), "builtin"
    path: str | None  # the model directory or file (None if not on disk)
    runtime_bytes: int = 0  # part of overhead: the runners' runtime before any model
    overhead_source: str = "default"  # of the runtime: "spare", "runner" (measured), "default"
    headroom_bytes: int = 0  # planned on top of total_bytes (a share of the model's parts)
    kv_bits: int | None = None  # the KV cache quantized to this many bits (None: model dtype)
    kv_group_size: int | None = None  # values per scale and bias, with kv_bits
    # A draft model (speculative decoding): its weights, KV cache, activations and
    # overhead (it shares the runner's runtime), part of total_bytes; its headroom is in
    # headroom_bytes. 0: no draft.
    draft_bytes: int = 0
    draft_model: str | None = None

    @property
    def planned_bytes(self) -> int:
        """What admission plans for (and grants as the runner's budget): total + headroom."""
        return self.total_bytes + self.headroom_bytes


OVERHEAD_SOURCE_TEXT = {  # where an estimate's runtime figure comes from
    "spare": "measured: the warm spare",
    "runner": "measured: a runner at its start",
    "default": "a default: nothing measured yet",
}


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _text_value(config: dict[str, Any], key: str) -> Any:
    """``config[key]``, else the language model's ``text_config[key]`` (multimodal configs)."""
    value = config.get(key)
    if value is not None:
        return value
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        return text_config.get(key)
    return None


def config_int(config: dict[str, Any], key: str) -> int | None:
    value = _text_value(config, key)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _bytes_per_element(config: dict[str, Any]) -> int:
    """Element size of activations and the KV cache: the model's dtype, even when quantized
    (quantized weights are dequantized on the fly; what they produce is in this dtype)."""
    dtype = _text_value(config, "torch_dtype") or _text_value(config, "dtype")
    if isinstance(dtype, str):
        return _BYTES_PER_DTYPE.get(dtype.removeprefix("torch."), DEFAULT_BYTES_PER_ELEMENT)
    return DEFAULT_BYTES_PER_ELEMENT


def _head_dim(config: dict[str, Any]) -> int | None:
    head_dim = config_int(config, "head_dim")
    if head_dim is not None:
        return head_dim
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    return hidden // heads


def default_context_tokens(config: dict[str, Any]) -> int:
    """Context the KV cache is planned for when none is configured.

    ``min(max_position_embeddings, DEFAULT_CONTEXT_TOKENS)``, reading ``text_config`` for
    multimodal configs; ``DEFAULT_CONTEXT_TOKENS`` when the config gives no limit.
    """
    limit = config_int(config, "max_position_embeddings")
    return DEFAULT_CONTEXT_TOKENS if limit is None else min(limit, DEFAULT_CONTEXT_TOKENS)


def _kv_shape(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """Layers, KV heads and head_dim; None if the config lacks them."""
    layers = config_int(config, "num_hidden_layers")
    kv_heads = config_int(config, "num_key_value_heads") or config_int(
        config, "num_attention_heads"
    )
    head_dim = _head_dim(config)
    if layers is None or kv_heads is None or head_dim is None:
        return None
    return layers, kv_heads, head_dim


def _kv_cache_bytes(
    config: dict[str, Any], context_tokens: int, kv_bits: int | None = None, kv_group_size: int = 64
) -> int:
    """2 (K and V) x context x layers x kv_heads x bytes per head vector; 0 if the config lacks
    them. A head vector is head_dim values in the model's dtype, or quantized (``kv_bits``):
    mlx-lm's QuantizedKVCache packs head_dim x bits, plus a scale and a bias in the model's
    dtype per group of ``kv_group_size`` values.

    Every layer is counted as full attention: an upper bound once the context is a few
    windows long. Quantized, a model with a sliding window has layers the runner leaves in
    its dtype (mlx-lm cannot quantize a rotating cache), holding up to a window of tokens:
    each layer is counted as the larger of the two, an upper bound still.
    """
    shape = _kv_shape(config)
    if shape is None:
        return 0
    layers, kv_heads, head_dim = shape
    element = _bytes_per_element(config)
    per_token = 2 * layers * kv_heads  # head vectors per token of context
    if kv_bits is None:
        return per_token * context_tokens * head_dim * element
    vector = head_dim * kv_bits // 8 + 2 * element * -(-head_dim // kv_group_size)
    quantized = per_token * context_tokens * vector
    window = config_int(config, "sliding_window")
    if window is None:
        return quantized
    unquantized = per_token * min(context_tokens, window) * head_dim * element
    return max(quantized, unquantized)


def _activation_bytes(config: dict[str, Any], context_tokens: int, quantized_kv: bool) -> int:
    """003's ``batch x seq x hidden x multiplier x bytes`` for one prefill step, plus that
    step's attention scores (heads x seq x seq: the score block of the step's queries against
    as many keys; Metal's fused attention never holds more). Batch is 1: a runner serves one
    request at a time. Only the last token's logits are computed, so they are left out.
    A quantized KV cache (``quantized_kv``) adds one layer's K and V dequantized for the
    fused attention of a prefill step.
    """
    widths = [
        w
        for w in (config_int(config, "hidden_size"), config_int(config, "intermediate_size"))
        if w is not None
    ]
    if not widths:
        return 0
    seq = min(context_tokens, PREFILL_STEP_TOKENS)
    element = _bytes_per_element(config)
    layer = seq * max(widths) * ACTIVATION_MULTIPLIER * element
    heads = config_int(config, "num_attention_heads") or 0
    scores = heads * seq * seq * element
    shape = _kv_shape(config)
    if quantized_kv and shape is not None:
        _, kv_heads, head_dim = shape
        layer += 2 * context_tokens * kv_heads * head_dim * element
    return layer + scores


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a model directory; empty when there is none."""
    path = directory / "config.json"
    return _read_json_object(path) if path.is_file() else {}


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those the index names, else ``model*.safetensors`` (what mlx_lm loads),
    else any ``*.safetensors``. Repositories that also ship ``consolidated.safetensors`` are
    thereby not counted twice."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise ValueError(f"{index}: no weight_map of tensor names to file names")
        return sorted({directory / name for name in weight_map.values()})
    return sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("*.safetensors"))


def _is_vision_tensor(name: str) -> bool:
    return not _VISION_TENSOR_PARTS.isdisjoint(name.split("."))


# --------------------------------------------------------------------------------------------
# Estimates
# --------------------------------------------------------------------------------------------


def _assemble(
    config: dict[str, Any],
    weights_bytes: int,
    weights_source: str,
    path: Path | None,
    context_tokens: int | None,
    vision: bool,
    kv: KvQuantization,
) -> Estimate:
    if context_tokens is None:
        context_tokens = default_context_tokens(config)
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, not {context_tokens}")
    kv_bits, kv_group_size = kv
    kv_cache = _kv_cache_bytes(config, context_tokens, kv_bits, kv_group_size)
    activations = _activation_bytes(config, context_tokens, quantized_kv=kv_bits is not None)
    vocabulary = config_int(config, "vocab_size") or 0
    model_overhead = (
        MODEL_RUNTIME_BYTES
        + TOKENIZER_BASE_BYTES
        + TOKENIZER_BYTES_PER_TOKEN * vocabulary
        + round(ALLOCATOR_SHARE_OF_WEIGHTS * weights_bytes)
    )
    vision_extra = (
        VISION_BASE_BYTES + round(VISION_SHARE_OF_WEIGHTS * weights_bytes) if vision else 0
    )
    model = weights_bytes + kv_cache + activations + model_overhead + vision_extra
    return Estimate(
        weights_bytes=weights_bytes,
        kv_cache_bytes=kv_cache,
        activation_bytes=activations,
        overhead_bytes=RUNTIME_DEFAULT_BYTES + model_overhead,
        vision_bytes=vision_extra,
        total_bytes=RUNTIME_DEFAULT_BYTES + model,
        context_tokens=context_tokens,
        vision=vision,
        weights_source=weights_source,
        path=None if path is None else str(path),
        runtime_bytes=RUNTIME_DEFAULT_BYTES,
        overhead_source="default",
        headroom_bytes=round(HEADROOM_SHARE * model),
        kv_bits=kv_bits,
        kv_group_size=kv_group_size if kv_bits is not None else None,
    )


def with_runtime(estimate: Estimate, runtime_bytes: int, source: str) -> Estimate:
    """``estimate`` with its runtime part (in ``overhead_bytes`` and the total) replaced by
    ``runtime_bytes``, which came from ``source`` ("spare", "runner" or "default"). The
    headroom stays: it is a share of the model's parts, which did not change."""
    delta = runtime_bytes - estimate.runtime_bytes
    return msgspec.structs.replace(
        estimate,
        runtime_bytes=runtime_bytes,
        overhead_bytes=estimate.overhead_bytes + delta,
        total_bytes=estimate.total_bytes + delta,
        overhead_source=source,
    )


def with_draft(estimate: Estimate, draft: Estimate, draft_model: str) -> Estimate:
    """``estimate`` with a draft model's needs added (its runner loads both): the draft's
    parts but its runtime (one process holds both models), and its headroom."""
    draft_part = draft.total_bytes - draft.runtime_bytes
    return msgspec.structs.replace(
        estimate,
        draft_bytes=draft_part,
        draft_model=draft_model,
        total_bytes=estimate.total_bytes + draft_part,
        headroom_bytes=estimate.headroom_bytes + draft.headroom_bytes,
    )


def estimate_model_dir(
    path: Path,
    context_tokens: int | None = None,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> Estimate:
    """Estimate the model in directory ``path`` (or a single GGUF file).

    A directory: weights are the safetensors headers' byte counts (``weights_source``
    "safetensors"), else the size of its ``*.gguf`` files, else of all its files ("disk"); KV
    cache and activations come from ``config.json`` (0 without one). A model is a vision model
    when its config has ``vision_config`` or its safetensors hold vision-tower tensors.

    A GGUF file (named ``*.gguf``, or one that begins as GGUF files do, such as Ollama's
    ``sha256-...`` blobs: as ``runner.loading`` decides) is estimated as the runner loads it:
    converted into a directory of dequantized weights (float32 on the CPU, float16 on a GPU;
    ``runner.gguf_import``). When that conversion exists, it is estimated ("safetensors");
    otherwise the config and weight bytes the conversion will have are computed from the
    file's header ("gguf"; the tensor data is not read). ``path`` in the estimate is the GGUF
    file either way.

    Args:
        path: the model directory or GGUF file.
        context_tokens: tokens to plan the KV cache for; default ``default_context_tokens``.
        kv_bits: the KV cache quantized to 4 or 8 bits (None: in the model's dtype).
        kv_group_size: values per scale and bias of the quantized KV cache.

    Raises:
        ValueError: a corrupt safetensors header, index or config.json (the message names the
            file), a file that is not a model, a GGUF file the runner cannot convert (the
            converter's reason), or ``context_tokens`` < 1.
        OSError: ``path`` does not exist, or a file cannot be read.
    """
    path = Path(path)
    kv = (kv_bits, kv_group_size)
    if path.is_file():
        if not _is_gguf_file(path):
            raise ValueError(f"{path}: neither a model directory nor a GGUF file")
        return _estimate_gguf(path, context_tokens, kv)
    if not path.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no model directory", str(path))

    config = _read_config(path)
    vision = isinstance(config.get("vision_config"), dict)
    if files := _safetensors_files(path):
        weights_bytes = 0
        for file in files:
            tensors = safetensors_tensor_bytes(file)
            weights_bytes += sum(tensors.values())
            vision = vision or any(_is_vision_tensor(name) for name in tensors)
        return _assemble(config, weights_bytes, "safetensors", path, context_tokens, vision, kv)
    if ggufs := sorted(path.glob("*.gguf")):
        weights_bytes = sum(file.stat().st_size for file in ggufs)
        return _assemble(config, weights_bytes, "disk", path, context_tokens, vision, kv)
    weights_bytes = sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())
    return _assemble(config, weights_bytes, "disk", path, context_tokens, vision, kv)


def _is_gguf_file(path: Path) -> bool:
    """Whether the runner takes file ``path`` for a GGUF file: by its name (``*.gguf``) or else
    by its first bytes (runner.loading's rule; Ollama's blobs have no suffix)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
    except OSError:
        return False


def _estimate_gguf(path: Path, context_tokens: int | None, kv: KvQuantization) -> Estimate:
    """A GGUF file as the runner loads it: its conversion if made, else from its header."""
    # modelfiles.gguf reads stat results and the GGUF header with the standard library; the
    # runner's converter uses it too, which keeps one definition of the conversion's cache
    # name, config and dtype for the runner and the estimate.
    converted = built_gguf_model_dir(path)
    if converted is not None:
        estimate = estimate_model_dir(converted, context_tokens, kv_bits=kv[0],
                                      kv_group_size=kv[1])  # fmt: skip
        return msgspec.structs.replace(estimate, path=str(path))
    config, weights_bytes = gguf_config_and_weight_bytes(path)
    return _assemble(config, weights_bytes, "gguf", path, context_tokens, False, kv)


def _hf_cached_snapshot(repo_id: str) -> Path | None:
    """The complete snapshot of ``repo_id`` in the local Hugging Face cache, without network."""
    try:
        from huggingface_hub import snapshot_download  # lazy: only hub references need it
    except ImportError:
        return None
    try:
        folder = snapshot_download(
            repo_id, local_files_only=True, allow_patterns=_HF_ALLOW_PATTERNS
        )
    except (OSError, ValueError):  # not cached, incomplete, or not a valid repo id
        return None
    return Path(folder)


def local_model_path(model: str) -> Path | None:
    """Where ``model`` already is on this machine, touching no network; None if it is not.

    ``builtin:NAME``: its directory once built (None before, or for an unknown name); an
    existing directory or GGUF file (``*.gguf``, or by its first bytes): itself; ``org/name``:
    its snapshot in the local Hugging Face cache, if complete.
    """
    if model.startswith(BUILTIN_PREFIX):
        try:
            return built_builtin_model_dir(model)
        except ValueError:  # unknown builtin: the load will say so
            return None
    candidate = Path(model).expanduser()
    if candidate.is_dir() or (candidate.is_file() and _is_gguf_file(candidate)):
        return candidate.resolve()
    if "/" in model and not candidate.is_absolute() and not model.startswith((".", "~")):
        return _hf_cached_snapshot(model)
    return None


def estimate_reference(
    model: str,
    context_tokens: int | None = None,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> Estimate | None:
    """Estimate ``model`` as a config names it (``builtin:NAME``, a path or a hub repo id).

    A builtin model not built yet is estimated from its recipe (``weights_source`` "builtin",
    no files written). Anything else must already be on this machine (see
    ``local_model_path``); otherwise, or for an unknown builtin name, the answer is None and
    the caller goes without an estimate.

    Args:
        model: the model reference.
        context_tokens: tokens to plan the KV cache for; default ``default_context_tokens``.
        kv_bits, kv_group_size: the KV cache's quantization (see ``estimate_model_dir``).

    Raises:
        ValueError: corrupt model files (see ``estimate_model_dir``).
        OSError: model files that cannot be read.
    """
    path = local_model_path(model)
    if path is not None:
        return estimate_model_dir(path, context_tokens, kv_bits=kv_bits,
                                  kv_group_size=kv_group_size)  # fmt: skip
    if model.startswith(BUILTIN_PREFIX):
        try:
            config, weights_bytes = _builtin_recipe(model)
        except ValueError:
            return None
        vision = isinstance(config.get("vision_config"), dict)  # builtin:tiny-vision
        return _assemble(dict(config), weights_bytes, "builtin", None, context_tokens,
                         vision=vision, kv=(kv_bits, kv_group_size))  # fmt: skip
    return None


def model_config(model: str) -> dict[str, Any] | None:
    """The ``config.json`` of ``model`` as a config names it (a GGUF file's
    as the runner converts it; a builtin's from its recipe when not built
    yet); None when it is not on this machine.

    Raises:
        ValueError: corrupt model files.
        OSError: model files that cannot be read.
    """
    path = local_model_path(model)
    if path is not None and path.is_dir():
        return _read_config(path)
    if path is not None:
        converted = built_gguf_model_dir(path)
        if converted is not None:
            return _read_config(converted)
        return dict(gguf_config_and_weight_bytes(path)[0])
    if model.startswith(BUILTIN_PREFIX):
        try:
            return dict(_builtin_recipe(model)[0])
        except ValueError:
            return None
    return None


@functools.lru_cache(maxsize=16)
def _builtin_recipe(model: str) -> tuple[dict[str, Any], int]:
    """A builtin model's config and weight bytes from its recipe (cached: it
    trains the tokenizer to learn the vocabulary size, a few tenths of a second)."""
    return builtin_config_and_weight_bytes(model)


# --------------------------------------------------------------------------------------------
# In words (the ``estimate`` command's table and JSON are ``supervisor.cli.render``'s)
# --------------------------------------------------------------------------------------------


def describe_kv_cache(estimate: Estimate) -> str:
    """'8192 tokens', or '8192 tokens, 8-bit, groups of 64' for a quantized KV cache."""
    tokens = f"{estimate.context_tokens} tokens"
    if estimate.kv_bits is None:
        return tokens
    return f"{tokens}, {estimate.kv_bits}-bit, groups of {estimate.kv_group_size}"


def describe_estimate(estimate: Estimate) -> str:
    """The estimate in one line, for refusals and logs: the total and its parts, the runtime
    and where that came from, and the headroom planned on top."""
    source = OVERHEAD_SOURCE_TEXT.get(estimate.overhead_source, estimate.overhead_source)
    parts = [
        f"weights {format_bytes(estimate.weights_bytes)}",
        f"KV cache {format_bytes(estimate.kv_cache_bytes)} ({describe_kv_cache(estimate)})",
        f"activations {format_bytes(estimate.activation_bytes)}",
        f"overhead {format_bytes(estimate.overhead_bytes)} (runtime "
        f"{format_bytes(estimate.runtime_bytes)}, {source})",
    ]
    if estimate.vision:
        parts.append(f"vision encoder {format_bytes(estimate.vision_bytes)}")
    return (
        f"estimate {format_bytes(estimate.total_bytes)}: {' + '.join(parts)}; "
        f"+ headroom {format_bytes(estimate.headroom_bytes)}"
    )
