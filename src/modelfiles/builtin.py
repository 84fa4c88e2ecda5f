"""Offline "builtin" models, the recipes: random-weight llama and qwen3 models with a real
byte-level BPE tokenizer.

``builtin:tiny``, ``builtin:small`` (llama), ``builtin:tiny-qwen3`` (qwen3, a second
architecture for tests) and ``builtin:tiny-qwen3-tools`` (tiny-qwen3 with Qwen3's own
tool-calling and thinking chat template) are specified here: their architecture,
``config.json``, tokenizer files and weight shapes. ``runner.builtin`` writes them on first use
as ordinary Hugging Face-style model directories, with weights from a fixed-seed numpy
generator; the supervisor's memory estimate reads their sizes from here without writing
anything. The tokenizer is trained on a corpus embedded in ``modelfiles.builtin_tokenizer``, so
every machine with the same library versions produces byte-identical files.

``builtin:tiny-qwen3-tools`` is for tests of tool calls and reasoning: its tokenizer has Qwen3's
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` as single tokens (ids inside the vocabulary, not special, so decoding keeps
them, as Qwen3's tokenizer does), and its chat template is Qwen3's, which this repository does
not carry: the copy in the ``trl`` wheel (Apache-2.0) is fetched from the package index when the
model is first built, pinned by size and sha256 (``ChatTemplateSource``). With it, mlx-lm finds
the template's thinking tags and its ``json_tools`` tool-call parser as it does for real Qwen3
checkpoints. Its config is recipe data like the others', so the memory estimate needs no fetch.

``builtin:tiny-embed`` is an embedding model laid out as Qwen3-Embedding is: tiny-qwen3's shape
with tied input and output embeddings, sentence-transformers' ``modules.json`` naming a Pooling
module (``1_Pooling/config.json``: last-token pooling) and a Normalize one, a
``sentence_bert_config.json`` with its maximum length, ``is_matryoshka`` in its config (its
vectors may be cut to fewer dimensions), and a tokenizer that appends ``<|end_of_text|>`` to every
text, as Qwen3-Embedding's appends ``<|endoftext|>`` (the last token, the one pooled, is then
always the same kind of token).

``builtin:small-draft`` is a draft model for speculative decoding with small's (and tiny's)
tokenizer: a one-layer llama whose layer adds nothing and whose output layer is its input
embeddings, so that it proposes its input token again (see ``runner.builtin``).

``builtin:spec-target`` and ``builtin:spec-draft`` are a pair for speculative decoding whose
draft predicts the target: the target is small with its layers past the first made quiet (their
residual output projections scaled down), the draft those very tensors less the quiet layers.

``builtin:smollm2`` is a real instruction-tuned model (SmolLM2-135M-Instruct), fetched from the
package index and converted on first use; its recipe lives in ``modelfiles.builtin_gguf``, and
this module only dispatches to it.

Nothing here imports mlx or numpy; the ``tokenizers`` library is imported when the tokenizer is
trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelfiles import builtin_gguf, builtin_vision
from modelfiles.builtin_tokenizer import (
    BOS_TOKEN,
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    EOT_TOKEN,
    EOT_TOKEN_ID,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    QWEN3_TOOL_TOKENS,
    RECIPE_VERSION,
    SPECIAL_TOKENS,
    _tokenizer_json,
)
from modelfiles.cache import MANIFEST_NAME, cache_root, is_complete

__all__ = [
    "BUILTIN_NAMES",
    "BUILTIN_PREFIX",
    "MANIFEST_NAME",
    "QWEN3_TOOL_TOKENS",
    "ChatTemplateSource",
    "built_builtin_model_dir",
    "builtin_cache_dir",
    "builtin_config_and_weight_bytes",
    "is_builtin",
    "param_count",
]

BUILTIN_PREFIX = "builtin:"



@dataclass(frozen=True)
class ChatTemplateSource:
    """A chat template that is a file inside a wheel on the package index, pinned.

    Fetched with ``runner.fetch.fetch_wheel_member`` when the model is first built; the
    template's sha256 is part of the build's identity.
    """

    package: str
    version: str
    wheel_size: int  # bytes, for download progress
    member: str  # the template's path inside the wheel
    size: int  # its size in bytes and sha256, checked before it is used
    sha256: str


# Qwen3's chat template (tools, tool responses, <think> reasoning, enable_thinking), as TRL
# ships a copy of the original (trl/chat_templates/qwen3.jinja; TRL is Apache-2.0).
QWEN3_CHAT_TEMPLATE = ChatTemplateSource(
    package="trl",
    version="1.16.0",
    wheel_size=948_205,
    member="trl/chat_templates/qwen3.jinja",
    size=4168,
    sha256="a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
)


@dataclass(frozen=True)
class EmbeddingRecipe:
    """What makes a builtin an embedding model: the sentence-transformers files it gets."""

    pooling: str = "lasttoken"  # 1_Pooling/config.json's pooling_mode_<pooling>
    normalize: bool = True  # a Normalize module after the pooling
    max_seq_length: int = 512  # sentence_bert_config.json
    matryoshka: bool = True  # config.json's is_matryoshka: `dimensions` may cut its vectors


@dataclass(frozen=True)
class _Spec:
    """Architecture and initialisation of one builtin model."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    # float32 for tiny: it is ~1 MB either way and float32 keeps CPU matmuls free of half
    # precision conversions and rounding; small uses bfloat16 like most real checkpoints,
    # which halves its size (~280 MB instead of ~560 MB). Not float16: mlx's CPU build
    # decodes float16 about 3x slower than bfloat16 here (2.2 vs 6.8 tok/s).
    dtype: str
    seed: int
    # The mlx_lm.models module (and config model_type) the files are written for.
    architecture: str = "llama"
    # Tokens trained right after SPECIAL_TOKENS and then marked not special (see
    # QWEN3_TOOL_TOKENS); their output rows are zeroed like the special tokens'.
    extra_tokens: tuple[str, ...] = ()
    # Where the chat template comes from: None for CHAT_TEMPLATE, else fetched on first build.
    chat_template: ChatTemplateSource | None = None
    # One matrix for the input embeddings and the output layer (no lm_head tensor).
    tie_word_embeddings: bool = False
    # An embedding model (sentence-transformers files, a tokenizer that appends EOS).
    embedding: EmbeddingRecipe | None = None
    # A draft model for speculative decoding that proposes its input token again (see
    # runner.builtin._repeat_draft_tensor) instead of random weights.
    repeats_input: bool = False
    # Layers from this index on have their residual output projections (self_attn.o_proj,
    # mlp.down_proj) scaled by quiet_scale: they add little to the residual stream, so the
    # model's first layers, final norm and head alone predict most of its greedy tokens (see
    # builtin:spec-target). None: every layer as initialised.
    quiet_from_layer: int | None = None
    quiet_scale: float = 1.0

    @property
    def tokens_before_merges(self) -> tuple[str, ...]:
        """The tokens with the lowest ids, 0.., before the byte symbols and merges."""
        return (*SPECIAL_TOKENS, *self.extra_tokens)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def dir_name(self) -> str:
        return f"{self.name}-v{RECIPE_VERSION}"


_TINY = _Spec(
    name="tiny",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    max_position_embeddings=4096,
    dtype="float32",
    seed=0x7E1E,
)

_SMALL = _Spec(
    name="small",
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    max_position_embeddings=8192,
    dtype="bfloat16",
    seed=0x5A11,
)

_SPECS: dict[str, _Spec] = {
    "tiny": _TINY,
    "small": _SMALL,
    # tiny's shape as a qwen3 model (per-head q/k RMSNorm), so that tests can check behaviour
    # such as the KV prefix cache on a second architecture.
    "tiny-qwen3": replace(_TINY, name="tiny-qwen3", seed=0x7E13, architecture="qwen3"),
    # tiny-qwen3 with Qwen3's chat template and its tool-call and thinking tokens, for tests of
    # tool calls and reasoning that find mlx-lm's parsers as real Qwen3 models do.
    "tiny-qwen3-tools": replace(
        _TINY,
        name="tiny-qwen3-tools",
        seed=0x7E17,
        architecture="qwen3",
        extra_tokens=QWEN3_TOOL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
    ),
    # An embedding model laid out as Qwen3-Embedding (see the module's docstring).
    "tiny-embed": replace(
        _TINY,
        name="tiny-embed",
        seed=0x7E1B,
        architecture="qwen3",
        tie_word_embeddings=True,
        embedding=EmbeddingRecipe(),
    ),
    # A draft for speculative decoding with the same tokenizer as small (and tiny): it
    # proposes its input token again. Random-weight models repeat themselves under greedy
    # decoding, so small accepts many of its drafts, where a cut-down small would not: small's
    # own embeddings, norm and head over its first layer agreed with it on no token of 48.
    "small-draft": _Spec(
        name="small-draft",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=8192,
        dtype="float32",
        seed=0xD4AF,
        repeats_input=True,
    ),
    # A pair that accepts drafts by prediction, as a real small/large pair of one family does:
    # spec-target is small with the residual contributions of layers 1-11 scaled down x0.01,
    # and spec-draft is the same tensors (same seed and names: embeddings, layer 0, final norm,
    # head) with that one layer, so it computes what the target computes but for its quiet
    # layers. Its greedy token is the target's about 85% of the time (measured in process),
    # at about a tenth of the target's weights.
    "spec-target": replace(_SMALL, name="spec-target", quiet_from_layer=1, quiet_scale=0.01),
    "spec-draft": replace(_SMALL, name="spec-draft", num_hidden_layers=1),
}

# The random-weight models above, then the real ones fetched from the package index.
BUILTIN_NAMES: tuple[str, ...] = (
    *_SPECS, *builtin_vision.VISION_BUILTINS, *builtin_gguf.GGUF_BUILTINS
)

# Standard deviation of the hidden-layer weights (GPT-2 style).
_INIT_STD = 0.02


# --------------------------------------------------------------------------------------------
# Public interface
# --------------------------------------------------------------------------------------------


def is_builtin(model: str) -> bool:
    """True if ``model`` names a builtin model (``builtin:<name>``), known or not."""
    return model.startswith(BUILTIN_PREFIX)


def builtin_cache_dir() -> Path:
    """Directory holding the builtin models.

    ``$XDG_CACHE_HOME/mlx-supervisor/builtin`` when XDG_CACHE_HOME is set, otherwise
    ``~/Library/Caches/mlx-supervisor/builtin`` on macOS and ``~/.cache/mlx-supervisor/builtin``
    elsewhere.
    """
    return cache_root() / "builtin"


def built_builtin_model_dir(model: str, cache_dir: Path | None = None) -> Path | None:
    """The directory of builtin ``model`` if it is already built and complete, else None.

    Never builds or fetches anything. Raises ValueError for an unknown builtin name.
    """
    root = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return builtin_gguf.built_gguf_builtin_dir(fetched, root)
    vision = builtin_vision.VISION_BUILTINS.get(_bare_name(model))
    if vision is not None:
        return builtin_vision.vision_dir(vision, root)
    spec = _resolve(model)
    target = root / spec.dir_name
    return target if _is_complete(target, spec) else None


def builtin_config_and_weight_bytes(model: str) -> tuple[dict[str, Any], int]:
    """The ``config.json`` contents and total tensor bytes builtin ``model`` will have.

    Computed from the recipe without writing files (the tokenizer is trained in memory, a
    fraction of a second, for its vocabulary size); for ``builtin:smollm2`` from its pinned
    config, and for a builtin whose chat template is fetched without its template: nothing is
    fetched. Raises ValueError for an unknown name.
    """
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return builtin_gguf.gguf_builtin_config_and_weight_bytes(fetched)
    vision = builtin_vision.VISION_BUILTINS.get(_bare_name(model))
    if vision is not None:
        return builtin_vision.vision_config_and_weight_bytes(vision)
    spec = _resolve(model)
    vocab_size = len(json.loads(_tokenizer_json(spec.extra_tokens))["model"]["vocab"])
    bytes_per_param = 2 if spec.dtype == "bfloat16" else 4
    weight_bytes = param_count(model, vocab_size) * bytes_per_param
    return _model_config(spec, vocab_size), weight_bytes


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def _bare_name(model: str) -> str:
    return model[len(BUILTIN_PREFIX) :] if is_builtin(model) else model


def _resolve(model: str) -> _Spec:
    spec = _SPECS.get(_bare_name(model))
    if spec is None:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)
        raise ValueError(f"unknown builtin model {model!r}; known builtin models: {known}")
    return spec


def _identity(spec: _Spec) -> dict[str, Any]:
    """What the manifest of a build of ``spec`` must say (see modelfiles.cache.is_complete)."""
    identity: dict[str, Any] = {
        "builtin": BUILTIN_PREFIX + spec.name,
        "recipe_version": RECIPE_VERSION,
    }
    if spec.chat_template is not None:
        identity["chat_template_sha256"] = spec.chat_template.sha256
    return identity


def _is_complete(path: Path, spec: _Spec) -> bool:
    """True if ``path`` is a finished build of ``spec`` with every file at its recorded size."""
    return is_complete(path, _identity(spec))


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


# Per architecture: the config keys that differ (the values real checkpoints of it use).
_ARCHITECTURE_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "mlp_bias": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
    },
}


def _model_config(spec: _Spec, vocab_size: int) -> dict[str, Any]:
    config = _causal_lm_config(spec, vocab_size)
    if spec.embedding is not None and spec.embedding.matryoshka:
        config["is_matryoshka"] = True  # as vLLM reads it: `dimensions` may cut the vectors
    return config


def _causal_lm_config(spec: _Spec, vocab_size: int) -> dict[str, Any]:
    return {
        **_ARCHITECTURE_CONFIG[spec.architecture],
        "model_type": spec.architecture,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_scaling": None,
        "attention_bias": False,
        # Untied so that the special tokens keep ordinary (random) input embeddings while their
        # output rows are zeroed; costs vocab_size * hidden_size parameters (a few MB for small).
        # Tied in an embedding model, as in Qwen3-Embedding: its output layer is never used.
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": spec.dtype,
        "initializer_range": _INIT_STD,
        "mlx_supervisor_builtin": {"name": spec.name, "recipe_version": RECIPE_VERSION},
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }


def _tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max(s.max_position_embeddings for s in _SPECS.values()),
        "chat_template": chat_template,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, EOT_TOKEN],
    }


def _sentence_transformers_files(recipe: EmbeddingRecipe, hidden_size: int) -> dict[str, Any]:
    """The sentence-transformers files of an embedding model (path -> JSON), as
    Qwen3-Embedding's repository has them: ``modules.json`` (Transformer, Pooling,
    Normalize), the Pooling module's config and ``sentence_bert_config.json``."""
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if recipe.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")  # fmt: skip
    pooling: dict[str, Any] = {"word_embedding_dimension": hidden_size}
    pooling.update({f"pooling_mode_{mode}": mode == recipe.pooling for mode in modes})
    pooling["include_prompt"] = True
    return {
        "modules.json": modules,
        "1_Pooling/config.json": pooling,
        "sentence_bert_config.json": {"max_seq_length": recipe.max_seq_length,
                                      "do_lower_case": False},
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _weight_shapes(spec: _Spec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of mlx_lm.models.<spec.architecture>.Model for ``spec``, in a fixed order.

    qwen3 is llama plus an RMSNorm over each attention head's queries and keys (q_norm, k_norm).
    """
    d, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, d))]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (q_out, d)),
            (p + "self_attn.k_proj.weight", (kv_out, d)),
            (p + "self_attn.v_proj.weight", (kv_out, d)),
            (p + "self_attn.o_proj.weight", (d, q_out)),
        ]
        if spec.architecture == "qwen3":
            shapes += [
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,)),
            ]
        shapes += [
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, d)),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, d)),
            (p + "mlp.down_proj.weight", (d, spec.intermediate_size)),
        ]
    shapes.append(("model.norm.weight", (d,)))
    if not spec.tie_word_embeddings:
        shapes.append(("lm_head.weight", (vocab_size, d)))
    return shapes


def param_count(model: str, vocab_size: int | None = None) -> int:
    """Number of parameters of builtin ``model`` (computed from its recipe, no files written).

    ``vocab_size`` spares training the tokenizer to learn it; ignored for ``builtin:smollm2``,
    whose count is pinned. Raises ValueError for an unknown name.
    """
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return fetched.param_count
    vision = builtin_vision.VISION_BUILTINS.get(_bare_name(model))
    if vision is not None:
        return builtin_vision.vision_param_count(vision, vocab_size)
    spec = _resolve(model)
    if vocab_size is None:
        vocab_size = len(json.loads(_tokenizer_json(spec.extra_tokens))["model"]["vocab"])
    total = 0
    for _, shape in _weight_shapes(spec, vocab_size):
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total
