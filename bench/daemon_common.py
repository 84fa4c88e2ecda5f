"""What the figures of ``bench_daemon.py`` share: the model each runs on, the prompt,
the decode rate as a consumer sees it, and the row of the table.

One module per figure family (``daemon_decode``, ``daemon_ttft``, ``daemon_load``,
``daemon_memory``, ``daemon_per_token``); ``bench_daemon.py`` runs them and prints the
table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelfiles.builtin import is_builtin
from runner.builtin import ensure_builtin_model

IPC_MODEL = "builtin:tiny"  # ~1 MB: its compute is tiny, so the IPC overhead stands out
DECODE_PROMPT = "The supervisor starts one runner process for every model it serves."

Row = tuple[str, str, str, str, str, str]  # figure, daemon, in-process, result, target, PASS
Side = Callable[[], dict[str, Any]]


# --- models ----------------------------------------------------------------------


def model_path(model: str) -> Path:
    """The local directory of ``model``: a builtin (made once, cached) or a directory."""
    if is_builtin(model):
        return ensure_builtin_model(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise SystemExit(f"--model must be builtin:NAME or a local model directory: {model}")
    return path


def short(model: str) -> str:
    return model.removeprefix("builtin:") if is_builtin(model) else Path(model).name


def model_info(model: str, path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {
        "model": model,
        "path": str(path),
        "dtype": config.get("torch_dtype"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "weights_bytes": weights,
    }


def stream_tps(run: dict[str, Any]) -> float:
    """Decode rate seen by the consumer: tokens after the first / first -> end."""
    return float((run["frames"] - 1) / run["stream_s"])
