"""The safetensors format: a file's tensor sizes from its header, and a file written from a
stream of tensor bytes.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensor data. ``safetensors_tensor_bytes`` reads
the header alone (the supervisor's memory estimate: the data is never read);
``write_safetensors`` writes the builtin models' and GGUF conversions' weights one tensor at a
time. Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SAFETENSORS_HEADER_MAX_BYTES",
    "SAFETENSORS_ITEMSIZE",
    "safetensors_tensor_bytes",
    "write_safetensors",
]

# The safetensors reference implementation refuses headers above 100 MB; so do we, so that a
# garbage length cannot make the daemon allocate gigabytes.
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000

SAFETENSORS_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


def write_safetensors(
    path: Path,
    tensors: Sequence[tuple[str, tuple[int, ...], str]],
    data: Iterable[bytes],
) -> None:
    """Write a safetensors file from a stream of tensor bytes, one tensor at a time.

    ``tensors`` lists ``(name, shape, dtype)`` in file order, dtype one of
    ``SAFETENSORS_ITEMSIZE``; ``data`` yields each tensor's little-endian bytes in that order,
    so no more than one tensor need be held at once. Raises ValueError when a tensor's bytes do
    not match its shape and dtype, or ``data`` yields too few or too many tensors.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    sizes: list[int] = []
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = SAFETENSORS_ITEMSIZE[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        sizes.append(nbytes)
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        written = 0
        for chunk in data:
            if written == len(tensors):
                raise ValueError(f"safetensors data has more than {len(tensors)} tensors")
            if len(chunk) != sizes[written]:
                name = tensors[written][0]
                raise ValueError(f"safetensors data does not match the header at tensor {name!r}")
            f.write(chunk)
            written += 1
        if written != len(tensors):
            raise ValueError(f"safetensors data ends after {written} of {len(tensors)} tensors")
        f.flush()
        os.fsync(f.fileno())


def safetensors_tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> byte size, from the file's header only (the data is never read).

    Raises:
        ValueError: the header is truncated, too long, not JSON, or lacks data_offsets.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        length = int.from_bytes(prefix, "little")
        size = os.fstat(f.fileno()).st_size
        if length > SAFETENSORS_HEADER_MAX_BYTES:
            raise ValueError(
                f"{path}: safetensors header length {length} is over the "
                f"{SAFETENSORS_HEADER_MAX_BYTES}-byte limit (corrupt file?)"
            )
        if length > size - 8:
            raise ValueError(
                f"{path}: safetensors header length {length} is beyond the end of the file "
                f"({size} bytes; truncated or corrupt)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ValueError(f"{path}: safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    sizes: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets")
        sizes[name] = offsets[1] - offsets[0]
    return sizes
