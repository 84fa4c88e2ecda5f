"""``builtin:tiny-vision``, the recipe: a tiny random-weight vision model of mlx-lm's
``muse_spark`` architecture.

Muse Spark is the family whose vision tower (``mlx_lm.models.muse_spark``) and image
processor (``mlx_lm.processors.muse_spark``) mlx-lm itself implements, so ``mlx_lm.load``
loads the directory as a vision model and ``mlx_lm.server`` serves images with it. The
recipe: a two-layer mixture-of-experts text model (width 64, 4 experts, 2 per token) and a
two-layer vision tower (width 32, 8-pixel patches merged 2 x 2, so one image token per 16 x 16
pixels), weights in mlx-lm's own layout (the fused ``qkvg_proj``/``qkv_proj`` and the
residual gates' coefficients, which ``Model.sanitize`` passes through as it does for converted
checkpoints).

Its tokenizer is builtin:tiny's, trained with ``<|image_start|>``, ``<|patch|>`` and
``<|image_end|>`` as single tokens (ids 5, 6, 7); its chat template is builtin:tiny's with an
image part (``image``, ``image_url`` or ``input_image``, as mlx_lm.server passes them) rendered
as one ``<|patch|>``, which mlx-lm's processor expands to the image's tokens. The config's
``image_token_id`` is the ``<|patch|>`` id.

``runner.builtin_vision`` writes the files. Nothing here imports mlx or numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelfiles.cache import is_complete

__all__ = [
    "IMAGE_TOKENS",
    "VISION_BUILTINS",
    "VisionSpec",
    "vision_chat_template",
    "vision_config_and_weight_bytes",
    "vision_dir",
    "vision_identity",
    "vision_model_config",
    "vision_param_count",
    "vision_weight_shapes",
]

# Bump when the written files change; the version is part of the directory name.
VISION_RECIPE_VERSION = 1

# mlx_lm.processors.muse_spark's IMAGE_START, IMAGE_PATCH, IMAGE_END, in this order (ids 5..7).
IMAGE_TOKENS: tuple[str, ...] = ("<|image_start|>", "<|patch|>", "<|image_end|>")


class VisionSpec:
    """builtin:tiny-vision's shapes (one instance; a class for the names it gives)."""

    name = "tiny-vision"
    seed = 0x7E15
    dtype = "float32"
    hidden_size = 64
    num_hidden_layers = 2
    num_attention_heads = 2
    num_key_value_heads = 1
    head_dim = 32
    num_local_experts = 4
    num_experts_per_tok = 2
    moe_hidden_size = 32
    moe_intermediate_size = 64
    sliding_window = 512
    vision_hidden_size = 32
    vision_intermediate_size = 64
    vision_layers = 2
    vision_heads = 2
    patch_size = 8
    merge_size = 2
    patch_temporal = 2
    pos_emb = 8  # the position table's side, in patches

    @property
    def dir_name(self) -> str:
        return f"{self.name}-v{VISION_RECIPE_VERSION}"

    @property
    def tokens_before_merges(self) -> int:
        return 5 + len(IMAGE_TOKENS)  # builtin:tiny's five special tokens, then the image ones


VISION_BUILTINS: dict[str, VisionSpec] = {"tiny-vision": VisionSpec()}


def vision_identity(spec: VisionSpec) -> dict[str, Any]:
    """What the manifest of a build must say (see modelfiles.cache.is_complete)."""
    return {"builtin": f"builtin:{spec.name}", "recipe_version": VISION_RECIPE_VERSION}


def vision_dir(spec: VisionSpec, root: Path) -> Path | None:
    """The built directory under ``root``, or None when not (completely) built."""
    target = root / spec.dir_name
    return target if is_complete(target, vision_identity(spec)) else None


def vision_chat_template() -> str:
    """builtin:tiny's chat template, with each image part rendered as ``<|patch|>``."""
    from modelfiles.builtin_tokenizer import CHAT_TEMPLATE

    parts = (
        "{%- set ns = namespace(text='') %}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{%- set ns.text = ns.text + part['text'] %}"
        "{%- elif part['type'] in ['image', 'image_url', 'input_image'] %}"
        "{%- set ns.text = ns.text + '<|patch|>' %}{%- endif %}"
        "{%- endfor %}"
        "{%- set content = ns.text %}"
    )
    text_only = (
        "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
        " | map(attribute='text') | join('') %}"
    )
    if text_only not in CHAT_TEMPLATE:
        raise RuntimeError("builtin:tiny's chat template no longer has its text-parts join")
    return CHAT_TEMPLATE.replace(text_only, parts)


def vision_model_config(spec: VisionSpec, vocab_size: int) -> dict[str, Any]:
    from modelfiles.builtin_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, EOT_TOKEN_ID, PAD_TOKEN_ID

    text_config = {
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_hidden_layers,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "post_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0},
        "layer_rope_theta": [10000.0] * spec.num_hidden_layers,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": spec.sliding_window,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "num_local_experts": spec.num_local_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_hidden_size": spec.moe_hidden_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "max_position_embeddings": 4096,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }
    vision_config = {
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "merge_size": spec.merge_size,
        "patch_temporal": spec.patch_temporal,
        "pos_emb_height": spec.pos_emb,
        "pos_emb_width": spec.pos_emb,
    }
    out = spec.vision_hidden_size * spec.merge_size**2
    return {
        "model_type": "muse_spark",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": 5 + IMAGE_TOKENS.index("<|patch|>"),
        "out_hidden_size": out,
        "projector_hidden_size": out,
        # No audio tower (mlx-lm has none); transformers' config checks its width anyway.
        "audio_config": {"out_hidden_size": spec.hidden_size},
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": spec.dtype,
        "mlx_supervisor_builtin": {"name": spec.name, "recipe_version": VISION_RECIPE_VERSION},
    }


def vision_processor_config(spec: VisionSpec) -> dict[str, Any]:
    """processor_config.json (mlx-lm's processor reads the patch sizes from the model config;
    the rest are its defaults, written down for other readers)."""
    return {
        "processor_type": "muse_spark",
        "patch_size": spec.patch_size,
        "downsample_factor": spec.merge_size,
        "min_num_image_tokens": 1,
        "max_num_image_tokens": 4096,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def vision_weight_shapes(spec: VisionSpec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of mlx_lm.models.muse_spark.Model for ``spec``, in a fixed order."""
    d, e, c, m = (spec.hidden_size, spec.num_local_experts, spec.moe_hidden_size,
                  spec.moe_intermediate_size)  # fmt: skip
    heads = spec.num_attention_heads + spec.num_key_value_heads
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.language_model.embed_tokens.weight", (vocab_size, d))
    ]
    for i in range(spec.num_hidden_layers):
        p = f"model.language_model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.qkvg_proj.weight", (2 * heads * spec.head_dim, d)),
            (p + "self_attn.o_proj.weight", (d, spec.num_attention_heads * spec.head_dim)),
            (p + "pre_feedforward_layernorm.weight", (d,)),
            (p + "mlp.gate.weight", (e, d)),
            (p + "mlp.gate.e_score_correction_bias", (e,)),
            (p + "mlp.pre_expert_proj.weight", (c, d)),
            (p + "mlp.pre_expert_norm.weight", (c,)),
            (p + "mlp.experts.gate_proj.weight", (e, m, c)),
            (p + "mlp.experts.up_proj.weight", (e, m, c)),
            (p + "mlp.experts.down_proj.weight", (e, c, m)),
            (p + "mlp.experts.post_expert_norm.weight", (c,)),
            (p + "mlp.post_expert_proj.weight", (d, c)),
            (p + "post_feedforward_layernorm.weight", (d,)),
            (p + "add_attn_alpha", (d,)),
            (p + "add_attn_beta", (d,)),
            (p + "add_ffn_alpha", (d,)),
            (p + "add_ffn_beta", (d,)),
        ]
    shapes.append(("model.language_model.norm.weight", (d,)))
    v, vi = spec.vision_hidden_size, spec.vision_intermediate_size
    patch_dim = 3 * spec.patch_size**2 * spec.patch_temporal
    t = "model.vision_tower."
    shapes += [
        (t + "patch_embedder.patch_embedding.weight", (v, patch_dim)),
        (t + "patch_embedder.position_embedding_table.weight", (spec.pos_emb**2, v)),
        (t + "ln_pre.weight", (v,)),
        (t + "ln_pre.bias", (v,)),
    ]
    for i in range(spec.vision_layers):
        p = f"{t}layers.{i}."
        shapes += [
            (p + "norm1.weight", (v,)),
            (p + "norm1.bias", (v,)),
            (p + "attn.qkv_proj.weight", (3 * v, v)),
            (p + "attn.qkv_proj.bias", (3 * v,)),
            (p + "attn.proj.weight", (v, v)),
            (p + "attn.proj.bias", (v,)),
            (p + "norm2.weight", (v,)),
            (p + "norm2.bias", (v,)),
            (p + "mlp.fc1.weight", (vi, v)),
            (p + "mlp.fc1.bias", (vi,)),
            (p + "mlp.fc2.weight", (v, vi)),
            (p + "mlp.fc2.bias", (v,)),
        ]
    out = v * spec.merge_size**2  # out_hidden_size = projector_hidden_size
    shapes += [
        (t + "ln_post.weight", (v,)),
        (t + "ln_post.bias", (v,)),
        ("model.vision_adapter.fc1.weight", (out, out)),
        ("model.vision_adapter.fc2.weight", (out, out)),
        ("model.vision_projection.weight", (d, out)),
        ("lm_head.weight", (vocab_size, d)),
    ]
    return shapes


def _vocab_size() -> int:
    from modelfiles.builtin_tokenizer import _tokenizer_json

    return len(json.loads(_tokenizer_json(IMAGE_TOKENS))["model"]["vocab"])


def vision_param_count(spec: VisionSpec, vocab_size: int | None = None) -> int:
    total = 0
    for _, shape in vision_weight_shapes(spec, vocab_size or _vocab_size()):
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total


def vision_config_and_weight_bytes(spec: VisionSpec) -> tuple[dict[str, Any], int]:
    """config.json and the tensor bytes (float32), from the recipe: nothing is written."""
    vocab_size = _vocab_size()
    return vision_model_config(spec, vocab_size), 4 * vision_param_count(spec, vocab_size)
