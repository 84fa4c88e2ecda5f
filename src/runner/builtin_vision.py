"""``builtin:tiny-vision``, written: its recipe (``modelfiles.builtin_vision``) as a model
directory that ``mlx_lm.load`` loads as a muse_spark vision model (``config.json`` with its
``vision_config``, ``processor_config.json``, the tokenizer files, ``model.safetensors``).

Weights come from a fixed-seed generator per tensor, as the other builtins' do: norms and
layer-norm weights 1, biases 0, the residual gates' coefficients those of a zero gate, the
output rows of the special and image tokens zero (so greedy decoding never picks them), the
rest N(0, 0.02^2).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import structlog

from modelfiles.builtin import (
    _INIT_STD,
    _generation_config,
    _tokenizer_config,
)
from modelfiles.builtin_tokenizer import _special_tokens_map, _tokenizer_json
from modelfiles.builtin_vision import (
    IMAGE_TOKENS,
    VisionSpec,
    vision_chat_template,
    vision_identity,
    vision_model_config,
    vision_processor_config,
    vision_weight_shapes,
)
from modelfiles.cache import build_once, write_json, write_text
from modelfiles.safetensors import write_safetensors
from runner.builtin_logits import lm_head

__all__ = ["ensure_vision_builtin"]

log = structlog.get_logger("runner.builtin_vision")

_ONES = ("layernorm.weight", "norm.weight", "norm1.weight", "norm2.weight", "ln_pre.weight",
         "ln_post.weight")  # fmt: skip
_ZEROS = (".bias", "e_score_correction_bias")
# mlx_lm.models.muse_spark.residual_gate_coefficients of a zero gate (temperature 0.3):
# beta = sigmoid(0), alpha = sqrt(sigmoid(0) * (1 + beta)).
_GATE_BETA = 0.5
_GATE_ALPHA = math.sqrt(0.5 * 1.5)


def ensure_vision_builtin(spec: VisionSpec, root: Path) -> Path:
    """The directory of ``spec`` under ``root``, written on first use (safe from several
    processes at once, as every builtin)."""
    return build_once(root, spec.dir_name, vision_identity(spec),
                      lambda out: _write(spec, out))  # fmt: skip


def _write(spec: VisionSpec, out: Path) -> None:
    tokenizer_json = _tokenizer_json(IMAGE_TOKENS)
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    write_text(out / "tokenizer.json", tokenizer_json)
    # No muse_spark chat format or tool parser (mlx-lm's defaults for the family): the answer
    # is plain text, as builtin:tiny's.
    tokenizer_config = {**_tokenizer_config(vision_chat_template()), "chat_template_type": "",
                        "tool_parser_type": None}  # fmt: skip
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "special_tokens_map.json", _special_tokens_map())
    write_json(out / "config.json", vision_model_config(spec, vocab_size))
    write_json(out / "processor_config.json", vision_processor_config(spec))
    write_json(out / "generation_config.json", _generation_config())
    shapes = vision_weight_shapes(spec, vocab_size)
    tensors = ((_init(spec, name, shape).astype("<f4").tobytes()) for name, shape in shapes)
    write_safetensors(out / "model.safetensors", [(n, s, "F32") for n, s in shapes], tensors)
    log.info("builtin_written", model=f"builtin:{spec.name}", path=str(out))


def _init(spec: VisionSpec, name: str, shape: tuple[int, ...]) -> Any:
    import numpy as np

    if name.endswith(_ONES):
        return np.ones(shape, dtype=np.float32)
    if name.endswith(_ZEROS):
        return np.zeros(shape, dtype=np.float32)
    if name.endswith("_alpha") or name.endswith("_beta"):
        value = _GATE_ALPHA if name.endswith("_alpha") else _GATE_BETA
        return np.full(shape, value, dtype=np.float32)
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
    if name == "lm_head.weight":
        return lm_head(rng, shape, spec.tokens_before_merges)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(_INIT_STD)
