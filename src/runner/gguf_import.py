"""Converting a llama-architecture GGUF file into a model directory that ``mlx_lm.load`` reads.

GGUF is llama.cpp's format: (usually quantized) weights under llama.cpp's tensor names, with the
model's hyperparameters, tokenizer and chat template as metadata. ``convert_gguf`` writes an
ordinary Hugging Face-style directory from it: ``config.json`` (LlamaForCausalLM),
``model.safetensors`` (dequantized; float32 where mlx computes on the CPU, float16 where it has
a GPU), ``tokenizer.json`` for the ``tokenizers`` library (byte-level BPE), and
``tokenizer_config.json`` with the chat template. Two things llama.cpp's converter did are
undone: GGUF lists a tensor's dimensions innermost first, and it permuted the rows of the query
and key projections (llama.cpp's rotary embedding rotates adjacent pairs of dimensions, Hugging
Face's and mlx's rotate the two halves of each head).

``ensure_gguf_model_dir`` converts a local ``.gguf`` file once into the per-user cache.

numpy and ``gguf`` are imported only when a file is converted: the supervisor imports this
module (for its memory estimate: ``built_gguf_model_dir``, ``gguf_config_and_weight_bytes``)
and never imports mlx, numpy or ``gguf``. What the estimate needs of a GGUF file comes from
``read_gguf_header``, a parser of the header (metadata and tensor list) in the standard library.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from runner.model_cache import (
    ProgressCallback,
    build_once,
    cache_root,
    is_complete,
    write_json,
    write_safetensors,
    write_text,
)

__all__ = [
    "CONVERTER_VERSION",
    "DTYPE_TAGS",
    "SUPPORTED_ARCHITECTURES",
    "GgufHeader",
    "GgufTensorInfo",
    "UnreadStrings",
    "built_gguf_model_dir",
    "convert_gguf",
    "default_weight_dtype",
    "ensure_gguf_model_dir",
    "gguf_cache_dir",
    "gguf_config_and_weight_bytes",
    "read_gguf_header",
    "unpermute_qk",
]

log = structlog.get_logger("runner.gguf_import")

# Bump when anything that changes the written files changes; it is part of the cache names.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

DTYPE_TAGS = {"float32": "f32", "float16": "f16"}
_SAFETENSORS_DTYPES = {"float32": ("F32", "<f4"), "float16": ("F16", "<f2")}
_BYTES_PER_ELEMENT = {"float32": 4, "float16": 2}

# gguf.TokenType values (llama.cpp's token attributes in a GGUF vocabulary).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Control tokens llama.cpp also stops generating at, whatever the metadata's eos says
# (llama-vocab.cpp's end-of-generation list): a chat turn's end is the model's usual stop.
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "_<EOT>",
        "<｜end▁of▁sentence｜>",  # noqa: RUF001 (DeepSeek's token uses full-width bars)
    }
)

# llama.cpp tensor names -> mlx_lm's llama model (which uses Hugging Face's names).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# Llama 3's pre-tokenizer split (llama.cpp's LLAMA3 regex, as in Llama 3's tokenizer.json).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values (llama.cpp's pre-tokenizer types) this converter can reproduce.
SUPPORTED_PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe")


def gguf_cache_dir() -> Path:
    """Directory holding the conversions of local GGUF files (``<cache root>/gguf``)."""
    return cache_root() / "gguf"


def default_weight_dtype() -> str:
    """The dtype converted weights are written in: "float32" where mlx computes on the CPU,
    "float16" where it has a GPU.

    In a process that has imported mlx (a runner) this is mlx's default device. Elsewhere (the
    supervisor never imports mlx) it is read from the installed mlx build without importing it:
    Metal on macOS, CUDA where an mlx-cuda package is installed, the CPU otherwise.
    """
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        return "float32" if mx.default_device().type == mx.cpu else "float16"
    if sys.platform == "darwin":
        return "float16"
    from importlib import metadata

    for dist in ("mlx-cuda-12", "mlx-cuda-13", "mlx-cuda"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return "float16"
    return "float32"


def ensure_gguf_model_dir(
    gguf_path: Path, cache_dir: Path | None = None, progress: ProgressCallback | None = None
) -> Path:
    """The model directory converted from the local GGUF file ``gguf_path``, made on first use.

    The conversion is cached in ``cache_dir`` (default ``gguf_cache_dir()``) under a name made
    of the file's name, size and modification time and the weight dtype, so later calls reuse
    it and a changed file is converted afresh. Safe to call from several processes at once.
    ``progress`` hears of the conversion (see ``convert_gguf``).

    Raises:
        FileNotFoundError: no file at ``gguf_path``.
        IsADirectoryError: ``gguf_path`` is a directory.
        ValueError: not a GGUF file, or one this converter does not support (the message names
            the architecture or tokenizer).
    """
    c = _Conversion.of(gguf_path, cache_dir)
    return build_once(
        c.root, c.name, c.identity, lambda out: convert_gguf(c.path, out, c.dtype, progress)
    )


def built_gguf_model_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path | None:
    """The complete conversion of ``gguf_path`` that ``ensure_gguf_model_dir`` would return,
    or None when there is none yet (converts nothing; a stat of the file and of the directory).

    Raises:
        FileNotFoundError: no file at ``gguf_path``.
        IsADirectoryError: ``gguf_path`` is a directory.
    """
    c = _Conversion.of(gguf_path, cache_dir)
    target = c.root / c.name
    return target if is_complete(target, c.identity) else None


@dataclass(frozen=True)
class _Conversion:
    """Where and as what a GGUF file's conversion is cached."""

    path: Path  # the GGUF file, resolved
    root: Path
    name: str
    identity: dict[str, Any]
    dtype: str

    @classmethod
    def of(cls, gguf_path: Path, cache_dir: Path | None) -> _Conversion:
        path = Path(gguf_path).expanduser().resolve()
        stat = path.stat()
        if path.is_dir():
            raise IsADirectoryError(f"{gguf_path} is a directory, not a GGUF file")
        dtype = default_weight_dtype()
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:80] or "model"
        name = f"{stem}-{stat.st_size}-{stat.st_mtime_ns}-{DTYPE_TAGS[dtype]}-v{CONVERTER_VERSION}"
        identity = {
            "gguf_name": path.name,
            "gguf_size": stat.st_size,
            "gguf_mtime_ns": stat.st_mtime_ns,
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
        }
        root = cache_dir if cache_dir is not None else gguf_cache_dir()
        return cls(path, root, name, identity, dtype)


def gguf_config_and_weight_bytes(
    gguf_path: Path, dtype: str | None = None
) -> tuple[dict[str, Any], int]:
    """The sizes in the ``config.json`` a conversion of ``gguf_path`` writes (hidden size,
    layers, heads, key/value heads, head dimension, context length, vocabulary; ``torch_dtype``)
    and the bytes of its ``model.safetensors``: every tensor's elements at ``dtype`` (default
    ``default_weight_dtype()``) bytes each, for the converter dequantizes them all.

    Reads the header alone (``read_gguf_header``: no tensor data, no numpy, no ``gguf``), so
    the supervisor can estimate a file before the runner converts it.

    Raises:
        ValueError: not a readable GGUF file, or one the converter refuses for its architecture,
            hyperparameters or tensor shapes (the message says which, in the converter's words).
        OSError: the file cannot be read.
    """
    path = Path(gguf_path)
    dtype = dtype or default_weight_dtype()
    if dtype not in _BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(_BYTES_PER_ELEMENT)}, not {dtype!r}")
    header = read_gguf_header(path)
    _check_architecture(header.metadata, path.name)
    shapes = {name: info.shape for name, info in header.tensors.items()}
    config = {**_llama_dimensions(header.metadata, shapes, path.name), "torch_dtype": dtype}
    hf_shapes = {
        _hf_tensor_name(name, path.name): tuple(reversed(shape)) for name, shape in shapes.items()
    }
    _check_tensor_shapes(hf_shapes, config, path.name)
    elements = sum(math.prod(shape) for shape in hf_shapes.values())
    return config, elements * _BYTES_PER_ELEMENT[dtype]


def convert_gguf(
    gguf_path: Path,
    out: Path,
    dtype: str | None = None,
    progress: ProgressCallback | None = None,
) -> None:
    """Write a model directory for ``mlx_lm.load`` converted from ``gguf_path`` into ``out``.

    ``out`` is an existing directory; ``dtype`` ("float32" or "float16") defaults to
    ``default_weight_dtype()``. Everything is checked before anything is written (metadata,
    tensor names, shapes and types), and ``progress("convert", done, total)`` is called as
    tensors are written (a big model takes minutes).

    Raises:
        ValueError: not a GGUF file; an architecture other than llama (the message names it);
            a tokenizer, tensor, tensor type or hyperparameter this converter cannot reproduce
            (heads, key/value heads and the head dimension must be positive, the head
            dimension even).
        OSError: the file cannot be read or the directory written.
    """
    dtype = dtype or default_weight_dtype()
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_SAFETENSORS_DTYPES)}, not {dtype!r}")
    started = time.perf_counter()
    reader = _open_reader(gguf_path)
    meta = {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }
    _check_architecture(meta, gguf_path.name)
    tensors = {str(t.name): t for t in reader.tensors}
    vocabulary = _Vocabulary.from_metadata(meta, gguf_path.name)
    config = _llama_config(meta, tensors, vocabulary, dtype, gguf_path.name)
    weights = _weight_plan(tensors, config, gguf_path.name)
    write_text(out / "tokenizer.json", vocabulary.tokenizer_json())
    write_json(out / "tokenizer_config.json", vocabulary.tokenizer_config(config))
    write_json(out / "special_tokens_map.json", vocabulary.special_tokens_map())
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", _generation_config(config))
    _write_weights(weights, config, dtype, out / "model.safetensors", progress)
    log.info(
        "gguf converted",
        gguf=str(gguf_path),
        dtype=dtype,
        tensors=len(weights),
        seconds=round(time.perf_counter() - started, 1),
    )


def unpermute_qk(weight: Any, n_heads: int) -> Any:
    """Undo llama.cpp's permutation of a query or key projection's rows (numpy, rows first).

    Hugging Face keeps the two members of each rotary pair half a head apart (rows i and
    i + head_dim/2); llama.cpp's converter interleaves them (rows 2i and 2i+1) with
    ``w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2)``; this is the inverse.
    ``n_heads`` is the number of query heads for q and of key/value heads for k.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _open_reader(gguf_path: Path) -> Any:
    """A gguf.GGUFReader over ``gguf_path``; ValueError when it is not a readable GGUF file."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except OSError:
        raise
    except Exception as error:  # the reader signals a malformed file in many ways
        raise ValueError(f"{gguf_path.name} is not a readable GGUF file: {error}") from error
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{gguf_path.name}: big-endian GGUF files are not supported")
    return reader


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _float32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that reads back as the same float32
    (1e-05 rather than 9.999999747378752e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def _required(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise ValueError(f"{source}: GGUF metadata has no {key}")
    return meta[key]


def _int_metadata(meta: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None:
            raise ValueError(f"{source}: GGUF metadata has no {key}")
        raise ValueError(f"{source}: GGUF metadata {key} is {value!r}; a single integer is needed")
    return value


def _positive_int_metadata(
    meta: dict[str, Any], key: str, source: str, default: int | None = None
) -> int:
    value = _int_metadata(meta, key, source, default)
    if value < 1:
        if key in meta:
            raise ValueError(f"{source}: GGUF metadata {key} is {value}; at least 1 is needed")
        raise ValueError(f"{source}: GGUF metadata has no {key}, and {value} is no default for it")
    return value


def _check_architecture(meta: Mapping[str, Any], source: str) -> None:
    architecture = meta.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {architecture!r} is not supported; "
            f"only {', '.join(SUPPORTED_ARCHITECTURES)}-architecture GGUF files can be converted"
        )


def _llama_dimensions(
    meta: dict[str, Any], shapes: Mapping[str, tuple[int, ...]], source: str
) -> dict[str, Any]:
    """The sizes in the ``config.json`` of a llama GGUF file, from its metadata and its tensors'
    shapes (GGUF order: innermost dimension first). Shared by the converter and the memory
    estimate (which reads the header with ``read_gguf_header``, not gguf-py).

    Raises ValueError for what mlx_lm's llama model cannot express: mixture of experts,
    partial rotary embeddings, Llama 3.1-style RoPE frequency factors; and for attention it
    cannot compute: no heads, key/value heads that do not divide the heads, an odd head
    dimension (rotary embeddings rotate pairs).
    """
    arch = "llama"
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{source}: mixture-of-experts llama GGUF files are not supported")
    if "rope_freqs.weight" in shapes:
        raise ValueError(
            f"{source}: RoPE frequency factors (Llama 3.1-style rope scaling) are not supported"
        )
    hidden = _positive_int_metadata(meta, f"{arch}.embedding_length", source)
    heads = _positive_int_metadata(meta, f"{arch}.attention.head_count", source)
    kv_heads = _positive_int_metadata(meta, f"{arch}.attention.head_count_kv", source, heads)
    if heads % kv_heads:
        raise ValueError(
            f"{source}: {heads} attention heads cannot share {kv_heads} key/value heads "
            "(the key/value heads must divide the heads)"
        )
    head_dim = _positive_int_metadata(meta, f"{arch}.attention.key_length", source, hidden // heads)
    if head_dim % 2:
        raise ValueError(
            f"{source}: head dimension {head_dim} is odd; rotary embeddings rotate pairs of "
            "dimensions"
        )
    rope_dims = _int_metadata(meta, f"{arch}.rope.dimension_count", source, head_dim)
    if rope_dims != head_dim:
        raise ValueError(
            f"{source}: rotary embeddings over {rope_dims} of {head_dim} head dimensions "
            "are not supported"
        )
    embedding = shapes.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{source}: the GGUF file has no token_embd.weight tensor")
    return {
        "hidden_size": hidden,
        "intermediate_size": _int_metadata(meta, f"{arch}.feed_forward_length", source),
        "num_hidden_layers": _int_metadata(meta, f"{arch}.block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int_metadata(meta, f"{arch}.context_length", source),
        "vocab_size": int(embedding[-1]),  # GGUF order: (hidden, vocab)
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _llama_config(
    meta: dict[str, Any], tensors: dict[str, Any], vocabulary: _Vocabulary, dtype: str, source: str
) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a llama GGUF file, from its metadata and tensors.

    Raises ValueError for what mlx_lm's llama model cannot express (see ``_llama_dimensions``)
    and for unknown RoPE scaling.
    """
    arch = "llama"
    shapes = {name: tuple(int(d) for d in t.shape) for name, t in tensors.items()}
    dimensions = _llama_dimensions(meta, shapes, source)
    vocab_size = dimensions["vocab_size"]
    if len(vocabulary.tokens) > vocab_size:
        raise ValueError(
            f"{source}: {len(vocabulary.tokens)} tokens for {vocab_size} embedding rows"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **dimensions,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(
            _required(meta, f"{arch}.attention.layer_norm_rms_epsilon", source)
        ),
        "rope_theta": _float32_value(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, source),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": vocabulary.bos_id,
        "eos_token_id": vocabulary.end_of_generation_ids() or None,
        "pad_token_id": vocabulary.pad_id,
        "torch_dtype": dtype,
    }


def _rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # the key older files use
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind in (None, "none"):
        return None
    if kind == "linear" and factor is not None:
        return {"type": "linear", "factor": _float32_value(factor)}
    raise ValueError(f"{source}: RoPE scaling {kind!r} is not supported")


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _optional_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class _Vocabulary:
    """The tokenizer a GGUF file describes: ``tokenizer.ggml.*`` and ``tokenizer.chat_template``."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str) -> _Vocabulary:
        """Read the vocabulary; ValueError for a tokenizer other than byte-level BPE ("gpt2")
        or a pre-tokenizer not in ``SUPPORTED_PRE_TOKENIZERS``."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{source}: GGUF tokenizer model {model!r} is not supported; only byte-level "
                "BPE ('gpt2') tokenizers can be converted"
            )
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        pre = "gpt-2" if pre == "default" else pre
        if pre not in SUPPORTED_PRE_TOKENIZERS:
            raise ValueError(
                f"{source}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
                + ", ".join(SUPPORTED_PRE_TOKENIZERS)
            )
        tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens", [])]
        token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [])]
        if not tokens or len(token_types) != len(tokens):
            raise ValueError(f"{source}: GGUF tokenizer has no tokens or no type for each token")
        template = meta.get("tokenizer.chat_template")
        return cls(
            tokens=tokens,
            token_types=token_types,
            merges=[str(m) for m in meta.get("tokenizer.ggml.merges", [])],
            pre=pre,
            bos_id=_optional_int(meta, "tokenizer.ggml.bos_token_id"),
            eos_id=_optional_int(meta, "tokenizer.ggml.eos_token_id"),
            eot_id=_optional_int(meta, "tokenizer.ggml.eot_token_id"),
            eom_id=_optional_int(meta, "tokenizer.ggml.eom_token_id"),
            pad_id=_optional_int(meta, "tokenizer.ggml.padding_token_id"),
            unk_id=_optional_int(meta, "tokenizer.ggml.unknown_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=str(template) if template is not None else None,
        )

    def text(self, token_id: int | None) -> str | None:
        """The text of token ``token_id``; None for None or an id outside the vocabulary."""
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def end_of_generation_ids(self) -> list[int]:
        """Ids generation stops at, as llama.cpp decides: eos, eot and eom, then the control
        tokens whose text marks the end of a turn or text (``<|im_end|>``, ``<|endoftext|>``)."""
        named = (self.eos_id, self.eot_id, self.eom_id)
        ids = [i for i in named if i is not None and self.text(i) is not None]
        for i, (token, kind) in enumerate(zip(self.tokens, self.token_types, strict=True)):
            if kind == _TOKEN_CONTROL and token in _END_OF_GENERATION_TEXTS:
                ids.append(i)
        return list(dict.fromkeys(ids))

    def tokenizer_json(self) -> str:
        """The ``tokenizer.json`` of this vocabulary for the Hugging Face tokenizers library."""
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
        )

        vocab = {token: i for i, token in enumerate(self.tokens)}
        merges = []
        for merge in self.merges:
            # As llama.cpp splits a merge: at the first space after the first character.
            cut = merge.find(" ", 1)
            if cut < 0:
                raise ValueError(f"GGUF merge {merge!r} has no space")
            merges.append((merge[:cut], merge[cut + 1 :]))
        tokenizer = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=self.pre == "llama-bpe")
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.pre == "smollm":  # GPT-2's split after splitting off every digit
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif self.pre == "llama-bpe":
            split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False)
            no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = self._post_processor(processors)
        special = [i for i, kind in enumerate(self.token_types) if kind == _TOKEN_CONTROL]
        user = [i for i, kind in enumerate(self.token_types) if kind == _TOKEN_USER_DEFINED]
        tokenizer.add_special_tokens(
            [AddedToken(self.tokens[i], special=True, normalized=False) for i in special]
        )
        tokenizer.add_tokens(
            [AddedToken(self.tokens[i], special=False, normalized=False) for i in user]
        )
        text: str = tokenizer.to_str(pretty=False)
        return text

    def _post_processor(self, processors: Any) -> Any:
        """Byte-level offsets, plus bos/eos around each sequence where the GGUF adds them."""
        byte_level = processors.ByteLevel(trim_offsets=False)
        special: dict[str, int] = {}
        bos = self.text(self.bos_id) if self.add_bos else None
        eos = self.text(self.eos_id) if self.add_eos else None
        if bos is not None and self.bos_id is not None:
            special[bos] = self.bos_id
        if eos is not None and self.eos_id is not None:
            special[eos] = self.eos_id
        if not special:
            return byte_level

        def sequence(text: str, type_id: int) -> list[str]:
            pieces = [f"{bos}:{type_id}"] if bos is not None else []
            pieces.append(f"{text}:{type_id}")
            return pieces + ([f"{eos}:{type_id}"] if eos is not None else [])

        template = processors.TemplateProcessing(
            single=sequence("$A", 0),
            pair=sequence("$A", 0) + sequence("$B", 1),
            special_tokens=list(special.items()),
        )
        return processors.Sequence([byte_level, template])

    def special_tokens_map(self) -> dict[str, Any]:
        """``special_tokens_map.json``: the bos, eos, pad and unk tokens that exist."""
        named = {
            "bos_token": self.text(self.bos_id),
            "eos_token": self.text(self.eos_id),
            "pad_token": self.text(self.pad_id),
            "unk_token": self.text(self.unk_id),
        }
        return {key: value for key, value in named.items() if value is not None}

    def tokenizer_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``tokenizer_config.json``: special tokens, the chat template and the context length."""
        named = set(self.special_tokens_map().values())
        extra = [
            token
            for token, kind in zip(self.tokens, self.token_types, strict=True)
            if kind == _TOKEN_CONTROL and token not in named
        ]
        result: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{key: None for key in ("bos_token", "eos_token", "pad_token", "unk_token")},
            **self.special_tokens_map(),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "additional_special_tokens": extra,
        }
        if self.chat_template is not None:
            result["chat_template"] = self.chat_template
        return result


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _hf_tensor_name(gguf_name: str, source: str) -> str:
    """The Hugging Face / mlx_lm name of llama.cpp tensor ``gguf_name``; ValueError for a
    tensor mlx_lm's llama model has no place for."""
    name = _GLOBAL_TENSORS.get(gguf_name)
    if name is not None:
        return name
    match = _BLOCK_TENSOR_NAME.fullmatch(gguf_name)
    if match is not None and match.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}"
    raise ValueError(f"{source}: tensor {gguf_name!r} has no counterpart in a llama model")


@dataclass(frozen=True)
class _PlannedTensor:
    name: str  # Hugging Face name
    shape: tuple[int, ...]  # numpy order (outermost first)
    source: Any  # gguf.ReaderTensor


def _weight_plan(
    tensors: dict[str, Any], config: dict[str, Any], source: str
) -> list[_PlannedTensor]:
    """Every tensor of the file with its Hugging Face name and shape, checked against the config
    and for a type gguf-py can dequantize (so that a file mlx_lm would refuse, or one the
    converter would fail on halfway, fails before anything is written)."""
    planned = [
        _PlannedTensor(_hf_tensor_name(name, source), tuple(int(d) for d in reversed(t.shape)), t)
        for name, t in tensors.items()
    ]
    _check_tensor_shapes({t.name: t.shape for t in planned}, config, source)
    dequantizable = _dequantizable_types()
    for name, t in tensors.items():
        if t.tensor_type not in dequantizable:
            raise ValueError(
                f"{source}: tensor {name!r} is {t.tensor_type.name}, a type the converter "
                "cannot dequantize"
            )
    return planned


def _check_tensor_shapes(
    found: dict[str, tuple[int, ...]], config: dict[str, Any], source: str
) -> None:
    """ValueError unless ``found`` (Hugging Face name -> shape, outermost first) is exactly the
    tensors of mlx_lm's llama model for ``config``."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    expected = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (vocab, d)
    for i in range(layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q_out, d),
            p + "self_attn.k_proj.weight": (kv_out, d),
            p + "self_attn.v_proj.weight": (kv_out, d),
            p + "self_attn.o_proj.weight": (d, q_out),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ffn, d),
            p + "mlp.up_proj.weight": (ffn, d),
            p + "mlp.down_proj.weight": (d, ffn),
        }
    if found != expected:
        missing = sorted(expected.keys() - found.keys())[:3]
        extra = sorted(found.keys() - expected.keys())[:3]
        wrong = sorted(n for n in found.keys() & expected.keys() if found[n] != expected[n])[:3]
        raise ValueError(
            f"{source}: tensors do not match the llama config (missing {missing}, "
            f"unexpected {extra}, wrong shape {[(n, found[n]) for n in wrong]})"
        )


def _dequantizable_types() -> frozenset[Any]:
    """The ggml tensor types ``gguf.quants.dequantize`` implements: F32 and F16, which it
    handles itself, and each type it registered a quantization class for (BF16, Q4_0, Q4_K,
    IQ4_XS, ...; not Q8_1, Q8_K, the integer types or F64)."""
    import gguf
    from gguf import quants

    return frozenset(
        {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *quants._type_traits}
    )


def _write_weights(
    planned: list[_PlannedTensor],
    config: dict[str, Any],
    dtype: str,
    path: Path,
    progress: ProgressCallback | None,
) -> None:
    """Dequantize the tensors one at a time into a safetensors file."""
    import numpy as np
    from gguf.quants import dequantize

    st_dtype, np_dtype = _SAFETENSORS_DTYPES[dtype]
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }

    def converted() -> Iterator[bytes]:
        for done, tensor in enumerate(planned):
            if progress is not None:
                progress("convert", done, len(planned))
            values = dequantize(tensor.source.data, tensor.source.tensor_type)
            values = values.reshape(tensor.shape)
            projection = tensor.name.rsplit(".", 2)[-2]
            if projection in heads:
                values = unpermute_qk(values, heads[projection])
            data: bytes = np.ascontiguousarray(values, dtype=np_dtype).tobytes()
            yield data

    write_safetensors(path, [(t.name, t.shape, st_dtype) for t in planned], converted())
    if progress is not None:
        progress("convert", len(planned), len(planned))


# --------------------------------------------------------------------------------------------
# The header, without gguf-py
# --------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)  # what gguf-py reads too (version 1 had 32-bit counts)
_GGML_MAX_DIMS = 4
# GGUF metadata value types (gguf.GGUFValueType) of a fixed size, and how they read.
_GGUF_SCALARS = {
    kind: struct.Struct("<" + code)
    for kind, code in {
        0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
    }.items()
}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GgufTensorInfo:
    """A tensor as the GGUF header lists it."""

    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    type: int  # its ggml type (a gguf.GGMLQuantizationType value)


@dataclass(frozen=True)
class UnreadStrings:
    """An array of strings in the metadata, skipped (the vocabulary and merges: the estimate
    does not need them, and 300,000 Python strings are slow to make)."""

    count: int


@dataclass(frozen=True)
class GgufHeader:
    """What precedes a GGUF file's tensor data: metadata and the list of tensors."""

    metadata: dict[str, Any]  # values as gguf-py's contents() gives them; string arrays unread
    tensors: dict[str, GgufTensorInfo]


def read_gguf_header(gguf_path: Path) -> GgufHeader:
    """The metadata and tensor list of the GGUF file ``gguf_path``, read with the standard
    library alone (the supervisor runs this; it never imports numpy or gguf-py).

    The file is memory-mapped and only its header is touched, however big the tensor data.

    Raises:
        ValueError: not a GGUF file (version 2 or 3, little-endian), or its header is cut
            short or inconsistent; the message names the file.
        OSError: the file cannot be read.
    """
    path = Path(gguf_path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < len(_GGUF_MAGIC):
            raise _HeaderParser.unreadable(path.name, "it is too short")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _HeaderParser(data, path.name).header()


class _HeaderParser:
    """Reads a GGUF header out of a buffer, failing with ValueError rather than running past
    the end or believing a count no file of this size can hold."""

    def __init__(self, data: mmap.mmap, source: str) -> None:
        self.data = data
        self.size = len(data)
        self.source = source
        self.pos = 0

    @staticmethod
    def unreadable(source: str, why: str) -> ValueError:
        return ValueError(f"{source} is not a readable GGUF file: {why}")

    def fail(self, why: str) -> ValueError:
        return self.unreadable(self.source, why)

    def header(self) -> GgufHeader:
        if self.data[: len(_GGUF_MAGIC)] != _GGUF_MAGIC:
            raise self.fail("it does not begin with GGUF")
        self.pos = len(_GGUF_MAGIC)
        (version,) = self.unpack(_U32)
        if version not in _GGUF_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in _GGUF_VERSIONS:  # how gguf-py recognises a big-endian file
                raise ValueError(f"{self.source}: big-endian GGUF files are not supported")
            raise self.fail(f"GGUF version {version} is not supported")
        # The least a tensor entry (name, dimension count, type, offset) and a metadata entry
        # (key, type, value) take: a bound on the counts that keeps garbage from looping long.
        tensor_count = self.count(8 + 4 + 4 + 8, "tensor")
        metadata_count = self.count(8 + 4 + 1, "metadata entry")
        metadata: dict[str, Any] = {}
        for _ in range(metadata_count):
            key = self.string()
            (kind,) = self.unpack(_U32)
            metadata[key] = self.value(kind)
        tensors: dict[str, GgufTensorInfo] = {}
        for _ in range(tensor_count):
            name = self.string()
            (n_dims,) = self.unpack(_U32)
            if n_dims > _GGML_MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {n_dims} dimensions")
            shape = self.unpack(struct.Struct(f"<{n_dims}Q"))
            (kind,) = self.unpack(_U32)
            self.unpack(_U64)  # the data's offset: not needed
            if name in tensors:
                raise self.fail(f"tensor {name!r} is listed twice")
            tensors[name] = GgufTensorInfo(shape=tuple(shape), type=kind)
        return GgufHeader(metadata=metadata, tensors=tensors)

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        if self.pos + layout.size > self.size:
            raise self.fail("its header is cut short")
        values = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return values

    def count(self, item_bytes: int, what: str) -> int:
        """A 64-bit count of items at least ``item_bytes`` long each, checked against what is
        left of the file."""
        (n,) = self.unpack(_U64)
        if n * item_bytes > self.size - self.pos:
            raise self.fail(f"{n} {what}s do not fit in the file")
        return int(n)

    def string(self) -> str:
        n = self.count(1, "string byte")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"a string is not UTF-8 ({error})") from None

    def value(self, kind: int) -> Any:
        scalar = _GGUF_SCALARS.get(kind)
        if scalar is not None:
            return self.unpack(scalar)[0]
        if kind == _GGUF_STRING:
            return self.string()
        if kind == _GGUF_ARRAY:
            return self.array()
        raise self.fail(f"unknown metadata value type {kind}")

    def array(self) -> Any:
        (kind,) = self.unpack(_U32)
        scalar = _GGUF_SCALARS.get(kind)
        if scalar is not None:
            n = self.count(scalar.size, "array item")
            values = struct.unpack_from(f"<{n}{scalar.format[-1]}", self.data, self.pos)
            self.pos += n * scalar.size
            return list(values)
        if kind == _GGUF_STRING:
            n = self.count(_U64.size, "array item")
            data, pos, size = self.data, self.pos, self.size
            for _ in range(n):  # skipped: each string is its length, then its bytes
                if pos + _U64.size > size:
                    raise self.fail("its header is cut short")
                pos += _U64.size + _U64.unpack_from(data, pos)[0]
            if pos > size:
                raise self.fail("its header is cut short")
            self.pos = pos
            return UnreadStrings(n)
        if kind == _GGUF_ARRAY:
            n = self.count(4 + 8, "array item")
            return [self.array() for _ in range(n)]
        raise self.fail(f"unknown metadata array type {kind}")
