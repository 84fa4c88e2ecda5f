"""What a llama-architecture GGUF file holds, and what its conversion will be, read with the
standard library alone.

``read_gguf_header`` parses a GGUF file's header (metadata and tensor list) without gguf-py;
``gguf_config_and_weight_bytes`` gives from it the sizes in the ``config.json`` and the bytes of
the ``model.safetensors`` that the runner's converter (``runner.gguf_import``) writes, and
``built_gguf_model_dir`` finds a finished conversion in the per-user cache. The converter and
the supervisor's memory estimate share these, which keeps one definition of a conversion's
cache name, config sizes and dtype, and of the tensors mlx_lm's llama model has.

Nothing here imports mlx, numpy or ``gguf``.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelfiles.cache import cache_root, is_complete

__all__ = [
    "CONVERTER_VERSION",
    "DTYPE_TAGS",
    "SUPPORTED_ARCHITECTURES",
    "GgufHeader",
    "GgufTensorInfo",
    "UnreadStrings",
    "built_gguf_model_dir",
    "default_weight_dtype",
    "gguf_cache_dir",
    "gguf_config_and_weight_bytes",
    "read_gguf_header",
]

# Bump when anything that changes the written files changes; it is part of the cache names.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

DTYPE_TAGS = {"float32": "f32", "float16": "f16"}
_BYTES_PER_ELEMENT = {"float32": 4, "float16": 2}

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


def built_gguf_model_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path | None:
    """The complete conversion of ``gguf_path`` that ``ensure_gguf_model_dir`` (in
    ``runner.gguf_import``) would return, or None when there is none yet (converts nothing; a
    stat of the file and of the directory).

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


# --------------------------------------------------------------------------------------------
# config.json sizes
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Tensor names and shapes
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
