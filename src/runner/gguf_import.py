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
module (for ``default_weight_dtype``) and never imports mlx or numpy.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from runner.model_cache import (
    ProgressCallback,
    build_once,
    cache_root,
    write_json,
    write_safetensors,
    write_text,
)

__all__ = [
    "CONVERTER_VERSION",
    "DTYPE_TAGS",
    "SUPPORTED_ARCHITECTURES",
    "convert_gguf",
    "default_weight_dtype",
    "ensure_gguf_model_dir",
    "gguf_cache_dir",
    "unpermute_qk",
]

log = structlog.get_logger("runner.gguf_import")

# Bump when anything that changes the written files changes; it is part of the cache names.
CONVERTER_VERSION = 1

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

DTYPE_TAGS = {"float32": "f32", "float16": "f16"}
_SAFETENSORS_DTYPES = {"float32": ("F32", "<f4"), "float16": ("F16", "<f2")}

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
    return build_once(root, name, identity, lambda out: convert_gguf(path, out, dtype, progress))


def convert_gguf(
    gguf_path: Path,
    out: Path,
    dtype: str | None = None,
    progress: ProgressCallback | None = None,
) -> None:
    """Write a model directory for ``mlx_lm.load`` converted from ``gguf_path`` into ``out``.

    ``out`` is an existing directory; ``dtype`` ("float32" or "float16") defaults to
    ``default_weight_dtype()``. Everything is checked before the weights are written, and
    ``progress("convert", done, total)`` is called as tensors are (a big model takes minutes).

    Raises:
        ValueError: not a GGUF file; an architecture other than llama (the message names it);
            a tokenizer, tensor or hyperparameter this converter cannot reproduce.
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
    architecture = meta.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {architecture!r} is not supported; "
            f"only {', '.join(SUPPORTED_ARCHITECTURES)}-architecture GGUF files can be converted"
        )
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


def _llama_config(
    meta: dict[str, Any], tensors: dict[str, Any], vocabulary: _Vocabulary, dtype: str, source: str
) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a llama GGUF file, from its metadata and tensors.

    Raises ValueError for what mlx_lm's llama model cannot express: mixture of experts,
    partial rotary embeddings, Llama 3.1-style RoPE frequency factors, unknown RoPE scaling.
    """
    arch = "llama"
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{source}: mixture-of-experts llama GGUF files are not supported")
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{source}: RoPE frequency factors (Llama 3.1-style rope scaling) are not supported"
        )
    hidden = _int_metadata(meta, f"{arch}.embedding_length", source)
    heads = _int_metadata(meta, f"{arch}.attention.head_count", source)
    kv_heads = _int_metadata(meta, f"{arch}.attention.head_count_kv", source, heads)
    head_dim = _int_metadata(meta, f"{arch}.attention.key_length", source, hidden // heads)
    rope_dims = _int_metadata(meta, f"{arch}.rope.dimension_count", source, head_dim)
    if rope_dims != head_dim:
        raise ValueError(
            f"{source}: rotary embeddings over {rope_dims} of {head_dim} head dimensions "
            "are not supported"
        )
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{source}: the GGUF file has no token_embd.weight tensor")
    vocab_size = int(embedding.shape[-1])  # GGUF order: (hidden, vocab)
    if len(vocabulary.tokens) > vocab_size:
        raise ValueError(
            f"{source}: {len(vocabulary.tokens)} tokens for {vocab_size} embedding rows"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int_metadata(meta, f"{arch}.feed_forward_length", source),
        "num_hidden_layers": _int_metadata(meta, f"{arch}.block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(
            _required(meta, f"{arch}.attention.layer_norm_rms_epsilon", source)
        ),
        "rope_theta": _float32_value(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, source),
        "max_position_embeddings": _int_metadata(meta, f"{arch}.context_length", source),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
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
    (so that a file mlx_lm would refuse fails before anything is written)."""
    planned = [
        _PlannedTensor(_hf_tensor_name(name, source), tuple(int(d) for d in reversed(t.shape)), t)
        for name, t in tensors.items()
    ]
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
    found = {t.name: t.shape for t in planned}
    if found != expected:
        missing = sorted(expected.keys() - found.keys())[:3]
        extra = sorted(found.keys() - expected.keys())[:3]
        wrong = sorted(n for n in found.keys() & expected.keys() if found[n] != expected[n])[:3]
        raise ValueError(
            f"{source}: tensors do not match the llama config (missing {missing}, "
            f"unexpected {extra}, wrong shape {[(n, found[n]) for n in wrong]})"
        )
    return planned


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
