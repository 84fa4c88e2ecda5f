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

numpy and ``gguf`` are imported only when a file is converted. What the supervisor's memory
estimate needs of a GGUF file (the conversion's cache name, its config sizes and weight bytes,
read from the header with the standard library) is in ``modelfiles.gguf``, which this
converter shares.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from modelfiles.cache import ProgressCallback, build_once, write_json, write_text
from modelfiles.gguf import (
    _check_architecture,
    _check_tensor_shapes,
    _Conversion,
    _hf_tensor_name,
    _llama_dimensions,
    default_weight_dtype,
)
from modelfiles.safetensors import write_safetensors

__all__ = [
    "convert_gguf",
    "ensure_gguf_model_dir",
    "unpermute_qk",
]

log = structlog.get_logger("runner.gguf_import")

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

# Llama 3's pre-tokenizer split (llama.cpp's LLAMA3 regex, as in Llama 3's tokenizer.json).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values (llama.cpp's pre-tokenizer types) this converter can reproduce.
SUPPORTED_PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe")


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
