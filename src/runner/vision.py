"""Images in a chat, in the runner: decoded, preprocessed, and turned into the
model's input embeddings.

Decoding happens here, not in the daemon: a hostile image can only take a
runner down, and the runner is the process meant to die. The bytes are the
client's file, opened with Pillow as one of :data:`IMAGE_FORMATS` only
(never EPS and the like, whose plugins run other programs on the bytes),
under a pixel cap (a decompression bomb is refused before it is decoded),
reduced while decoding to about what the processor keeps of it (a JPEG
decoded at a smaller scale, other formats box-reduced by a whole factor
before the conversion to RGB), one image at a time.

What follows is mlx-lm's, as ``mlx_lm.server`` does it for a vision model:
the chat template renders each image as one image token, mlx-lm's processor
(``mlx_lm.processors``) resizes and normalises each image and expands its
token to the image's run of patch tokens, and the model's ``embed_inputs``
puts the vision tower's rows at those tokens. The request's prompt is then
those embeddings (:func:`input_embeddings`), prefilled in chunks like any
prompt (``runner.solo``).

The prefix cache keys a vision prompt by :attr:`VisionPrompt.cache_key`: the
tokens with each patch token replaced by a negative id drawn from the sha256
of its image's bytes (and its place in the image), so two different images
never share KV even where their token runs are the same length, and the same
image at the same place does. The ids fit int32, as the disk tier stores
tokens.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ipc.messages import ChatMessage

__all__ = [
    "IMAGE_FORMATS",
    "MAX_IMAGE_PIXELS",
    "VisionPrompt",
    "content_parts",
    "decode_image",
    "has_images",
    "image_processor",
    "input_embeddings",
    "vision_prompt",
]

MAX_IMAGE_PIXELS = 40_000_000
"""An image with more pixels is refused before it is decoded (Pillow's own
bomb check warns at 89M and raises at twice that)."""

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The formats Pillow may open a client's bytes as; anything else is refused."""

# The modes Image.reduce takes; others are converted to RGB first.
_REDUCIBLE_MODES = frozenset({"L", "LA", "RGB", "RGBA", "RGBa", "La", "I", "F", "CMYK"})


@dataclass(frozen=True)
class VisionPrompt:
    """The images of a prompt, preprocessed."""

    pixel_values: list[mx.array]  # one (3, H, W) per image, in order
    spans: list[tuple[int, int]]  # each image's patch tokens: prompt[start:end]
    cache_key: list[int]  # the prompt with each patch token an id of its image


def has_images(messages: Sequence[ChatMessage] | None) -> bool:
    return any(m.images for m in messages or ())


def image_processor(model: Any, model_path: Path | None = None) -> Any | None:
    """mlx-lm's image processor for ``model``, or None for a model that takes
    no images (no vision tower, or a family mlx-lm has no processor for).
    It is given the model's whole config.json (its ``processor_type`` and
    all, as mlx_lm.server gives it) where ``model_path`` has one."""
    from mlx_lm.processors import load_processor

    vision_config = getattr(getattr(model, "args", None), "vision_config", None)
    if not vision_config or not hasattr(model, "embed_inputs"):
        return None
    config: dict[str, Any] = {}
    if model_path is not None:
        try:
            loaded = json.loads((model_path / "config.json").read_text())
        except (OSError, ValueError):
            loaded = None
        config = loaded if isinstance(loaded, dict) else {}
    config.setdefault("vision_config", vision_config)
    return load_processor(model, config)


def useful_pixels(processor: Any) -> int | None:
    """About the most pixels ``processor`` keeps of an image (a bigger one is
    resized down to it), or None where it does not say."""
    tokens = getattr(processor, "max_num_image_tokens", None)
    side = getattr(processor, "token_patch", None)
    if not isinstance(tokens, int) or not isinstance(side, int):
        return None
    return tokens * side * side


def content_parts(message: ChatMessage) -> list[dict[str, Any]]:
    """``message``'s content as the parts a chat template iterates over: its
    text cut at each image offset, an ``image`` part between."""
    images = message.images or []
    offsets = message.image_offsets or [len(message.content)] * len(images)
    if len(offsets) != len(images) or list(offsets) != sorted(offsets):
        raise ValueError("image_offsets must give one non-decreasing offset per image")
    parts: list[dict[str, Any]] = []
    at = 0
    for offset in offsets:
        offset = min(max(offset, 0), len(message.content))
        if offset > at:
            parts.append({"type": "text", "text": message.content[at:offset]})
            at = offset
        parts.append({"type": "image"})
    if at < len(message.content):
        parts.append({"type": "text", "text": message.content[at:]})
    return parts


def decode_image(data: bytes, index: int, keep_pixels: int | None = None) -> Any:
    """Image ``index`` of the request (counted from 1 in messages) as an RGB
    uint8 array (H, W, 3); one of more than ``keep_pixels`` pixels reduced
    by a whole factor while decoding, never below ``keep_pixels``.

    Raises:
        ValueError: not one of IMAGE_FORMATS, too many pixels, or corrupt.
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image {index} is {width}x{height}, more than "
                                 f"{MAX_IMAGE_PIXELS} pixels")  # fmt: skip
            if keep_pixels is None or width * height <= keep_pixels:
                return np.asarray(image.convert("RGB"))
            factor = math.isqrt(width * height // keep_pixels)
            if image.format == "JPEG":  # decoded at 1/2, 1/4 or 1/8 scale: no bigger than asked
                image.draft("RGB", (math.ceil(width / factor), math.ceil(height / factor)))
                factor = math.isqrt(image.size[0] * image.size[1] // keep_pixels)
            small = image if image.mode in _REDUCIBLE_MODES else image.convert("RGB")
            if factor > 1:
                small = small.reduce(factor)
            return np.asarray(small.convert("RGB"))
    except UnidentifiedImageError:
        raise ValueError(f"image {index} cannot be decoded: not a supported image format "
                         f"(one of {', '.join(IMAGE_FORMATS)})") from None  # fmt: skip
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"image {index} cannot be decoded: {exc}") from None


def vision_prompt(
    tokenizer: Any,
    processor: Any,
    text: str,
    images: Sequence[bytes],
    between: Callable[[], None] | None = None,
) -> tuple[list[int], VisionPrompt]:
    """The prompt's tokens and its images, from the chat template's ``text``
    (one image token per image) and the images' bytes, as mlx_lm.server
    makes them. The images are decoded and preprocessed one at a time (each
    decoded array dropped before the next), ``between`` called before each
    (a heartbeat: many big images take a while).

    Raises:
        ValueError: an image that does not decode, or a text whose image
            tokens are not one per image (a client that wrote one itself).
    """
    marker = processor.image_token
    parts = text.split(marker)
    if len(parts) - 1 != len(images):
        raise ValueError(f"the prompt has {len(parts) - 1} {marker} for {len(images)} "
                         f"images: the text may not contain {marker} itself")  # fmt: skip
    keep = useful_pixels(processor)
    pieces, pixel_values = [parts[0]], []
    for i, (data, after) in enumerate(zip(images, parts[1:], strict=True), 1):
        if between is not None:
            between()
        one, values = processor(marker, images=[decode_image(data, i, keep)])
        pieces += [one, after]
        pixel_values += values
    expanded = "".join(pieces)
    prompt = list(tokenizer.encode(expanded, add_special_tokens=False))
    patch = tokenizer.convert_tokens_to_ids(marker)
    spans: list[tuple[int, int]] = []
    for i, token in enumerate(prompt):
        if token == patch:
            if spans and spans[-1][1] == i:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
    if len(spans) != len(images):
        raise ValueError(f"{len(spans)} image token runs for {len(images)} images")
    key = list(prompt)
    for (start, end), data in zip(spans, images, strict=True):
        digest = hashlib.sha256(data).digest()
        for j in range(start, end):
            k = 4 * (j - start) % 28
            key[j] = -1 - (int.from_bytes(digest[k : k + 4], "little") & 0x3FFFFFFF)
    return prompt, VisionPrompt(list(pixel_values), spans, key)


def input_embeddings(model: Any, prompt: list[int], vision: VisionPrompt, start: int) -> mx.array:
    """The input embeddings (L, D) of ``prompt[start:]`` (what the prefix
    cache did not hold), with the vision rows of every image that has patch
    tokens there (an image the cache holds in part is encoded whole)."""
    needed = [i for i, (_, end) in enumerate(vision.spans) if end > start]
    if not needed:
        text_only: mx.array = model.embed_inputs(mx.array(prompt[start:]))
        return text_only
    first = min(start, vision.spans[needed[0]][0])
    embeddings: mx.array = model.embed_inputs(
        mx.array(prompt[first:]), pixel_values=[vision.pixel_values[i] for i in needed])
    return embeddings[start - first :]
