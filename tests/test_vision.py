"""Images in chats, end to end: builtin:tiny-vision (mlx-lm's muse_spark, a
tiny random config) behind a real daemon, asked through the real OpenAI,
Anthropic and Ollama clients, answers with the greedy tokens mlx-lm gives in
this process for the same image (mlx_lm.server's way: the chat template's
image token, mlx-lm's processor, ``embed_inputs``, ``generate_step``); the
image changes the answer; a text-only model, a bad image and a remote URL
with remote images off are 400s that leave the daemon serving; the 70% rule
refuses a vision model under OVERRIDE_MEMORY_MB with a 507."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from conftest import DaemonFactory
from supervisor.client import Client
from supervisor.config import HTTP_ENV

TOKENS = 6
QUESTION = "What is in this picture?"
CONFIG = """
[[models]]
name = "eyes"
model = "builtin:tiny-vision"
[[models]]
name = "tiny"
model = "builtin:tiny"
"""


def png(seed: int, width: int = 64, height: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """mlx-lm in this process on builtin:tiny-vision's directory (the same
    files the runner makes: a fixed recipe)."""
    import mlx_lm

    from runner import muse_spark_cpu
    from runner.builtin import ensure_builtin_model

    muse_spark_cpu.install()  # what the runner does where Metal is missing
    path = ensure_builtin_model("builtin:tiny-vision", tmp_path_factory.mktemp("vision"))
    return mlx_lm.load(str(path), return_config=True)


def greedy(reference: Any, content: list[dict[str, Any]], images: list[bytes]) -> str:
    """The greedy answer mlx-lm gives in process, as mlx_lm.server makes its prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.processors import load_processor

    model, tokenizer, config = reference
    processor = load_processor(model, config)
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = [np.asarray(Image.open(io.BytesIO(i)).convert("RGB")) for i in images]
    text, pixel_values = processor(text, images=pixels)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    embeddings = model.embed_inputs(mx.array(prompt), pixel_values=pixel_values)
    steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS, input_embeddings=embeddings)
    detokenizer = tokenizer.detokenizer  # as mlx_lm.server streams it
    detokenizer.reset()
    for token, _ in steps:
        detokenizer.add_token(int(token))
    detokenizer.finalize()
    return str(detokenizer.text)


@pytest.fixture
def served(start_daemon: DaemonFactory) -> Iterator[str]:
    daemon = start_daemon(CONFIG, env={HTTP_ENV: "127.0.0.1:0"})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    yield url


def openai_chat(url: str, content: list[dict[str, Any]], model: str = "eyes") -> str:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=TOKENS, temperature=0,
    )  # fmt: skip
    return reply.choices[0].message.content or ""


def test_an_image_chat_gives_mlx_lms_greedy_tokens_through_every_front(
    served: str, reference: Any
) -> None:
    url = served
    image, other = png(1), png(2)
    url_part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    text_part = {"type": "text", "text": QUESTION}
    expected = greedy(reference, [text_part, url_part], [image])
    assert openai_chat(url, [text_part, url_part]) == expected

    anthropic_api = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    message = anthropic_api.messages.create(
        model="eyes", max_tokens=TOKENS,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}],  # type: ignore[list-item,typeddict-item]
    )  # fmt: skip
    assert "".join(b.text for b in message.content if b.type == "text") == expected

    # Ollama puts a turn's images before its text.
    ollama_expected = greedy(reference, [url_part, text_part], [image])
    ollama_api = ollama.Client(host=url, timeout=120)
    answer = ollama_api.chat(
        model="eyes", options={"num_predict": TOKENS, "temperature": 0},
        messages=[{"role": "user", "content": QUESTION, "images": [image]}],
    )  # fmt: skip
    assert answer.message.content == ollama_expected
    # Base64 with line breaks, as `base64 file` writes it, is taken on every front.
    lines = base64.encodebytes(image).decode()
    assert "\n" in lines
    response = httpx.post(f"{url}/api/chat", json={
        "model": "eyes", "stream": False, "options": {"num_predict": TOKENS},
        "messages": [{"role": "user", "content": QUESTION, "images": [lines]}],
    }, timeout=60)  # fmt: skip
    assert response.json()["message"]["content"] == ollama_expected, response.text
    # /api/generate with an image and an empty prompt asks about the image alone.
    response = httpx.post(f"{url}/api/generate", json={
        "model": "eyes", "prompt": "", "images": [lines], "stream": False,
        "options": {"num_predict": TOKENS},
    }, timeout=60)  # fmt: skip
    assert response.json()["response"] == greedy(reference, [url_part], [image]), response.text
    # The Responses API's input_image.
    responses = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = responses.responses.create(model="eyes", max_output_tokens=TOKENS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": data_url(image),
                                      "detail": "auto"}]}])  # fmt: skip
    assert reply.output_text == expected
    # Anthropic's count_tokens counts the image's tokens as the message did.
    counted = anthropic_api.messages.count_tokens(
        model="eyes", messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, {"type": "image", "source": source}]}],  # type: ignore[list-item,typeddict-item]
    )  # fmt: skip
    usage = message.usage  # Anthropic's input_tokens leave out those read from the cache
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)

    # Another image of the same size (the same tokens but for the pixels): another answer,
    # not the first one's KV from the prefix cache.
    other_part = {"type": "image_url", "image_url": {"url": data_url(other)}}
    changed = openai_chat(url, [text_part, other_part])
    assert changed == greedy(reference, [text_part, other_part], [other])
    assert changed != expected
    # The first image again (its KV may come from the cache): the first answer.
    assert openai_chat(url, [text_part, url_part]) == expected

    # Two images in one turn, text between them.
    two = [url_part, {"type": "text", "text": " and "}, other_part, text_part]
    assert openai_chat(url, two) == greedy(reference, two, [image, other])


def test_bad_images_are_400s_and_the_daemon_goes_on(served: str) -> None:
    url = served
    text_part = {"type": "text", "text": QUESTION}
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    def refused(content: list[dict[str, Any]], model: str = "eyes") -> str:
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
                max_tokens=TOKENS,
            )  # fmt: skip
        return str(caught.value)

    image_part = {"type": "image_url", "image_url": {"url": data_url(png(3))}}
    # A text-only model: the model named, and why.
    error = refused([text_part, image_part], model="tiny")
    assert "tiny" in error and "text-only" in error, error
    # Bytes that are no image: decoded in the runner, a 400 for this request only.
    junk = {"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}
    assert "cannot be decoded" in refused([text_part, junk])
    assert "base64" in refused([{"type": "image_url", "image_url": {"url": "data:image/png,xx"}}])
    # A remote URL, with allow_remote_images off (the default): refused, nothing fetched.
    remote = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}
    assert "allow_remote_images" in refused([text_part, remote])
    # More images than max_image_per_request (16): refused before any work.
    assert "max_images_per_request" in refused([text_part] + [image_part] * 17)
    # Bytes shaped like the old in-band URL placeholder (not UTF-8 after it): only an image
    # that does not decode, not a 500.
    forged = base64.b64encode(b"\x00mlx-supervisor remote image\x00\xff").decode()
    response = httpx.post(f"{url}/api/chat", json={
        "model": "eyes", "stream": False,
        "messages": [{"role": "user", "content": "hi", "images": [forged]}],
    }, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "cannot be decoded" in response.text, response.text
    # The Responses API: a file id is refused by name.
    response = httpx.post(f"{url}/v1/responses", json={"model": "eyes", "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
        timeout=60)  # fmt: skip
    assert response.status_code == 400 and "file_id" in response.text, response.text
    # count_tokens refuses an image to a text-only model, as a message would.
    source = {"type": "base64", "media_type": "image/png",
              "data": base64.b64encode(png(3)).decode()}  # fmt: skip
    response = httpx.post(f"{url}/v1/messages/count_tokens", json={
        "model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image", "source": source}]}],
    }, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "text-only" in response.text, response.text
    # Anthropic and Ollama bodies too.
    response = httpx.post(f"{url}/api/chat", json={
        "model": "eyes", "messages": [{"role": "user", "content": "hi", "images": ["%%%"]}],
    }, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "base64" in response.text
    response = httpx.post(f"{url}/v1/messages", json={
        "model": "eyes", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "x"}}]}],
    }, timeout=60)  # fmt: skip
    assert response.status_code == 400 and "source" in response.text
    # Still serving, images and text.
    assert openai_chat(url, [text_part, image_part])
    assert openai_chat(url, [text_part], model="tiny")


class _OneImage(http.server.BaseHTTPRequestHandler):
    body = b""
    paths: ClassVar[list[str]] = []  # the requests it served, in order

    def do_GET(self) -> None:
        self.paths.append(self.path)
        if self.path.startswith("/hop"):  # a redirect to the image
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_remote_images_are_fetched_when_allowed(start_daemon: DaemonFactory,
                                                reference: Any) -> None:  # fmt: skip
    image = png(4)
    _OneImage.body = image
    _OneImage.paths = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OneImage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = "allow_remote_images = true\nmax_image_bytes = 65536\n" + CONFIG
        daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
        client = Client(daemon.socket_path)
        url = client.status().supervisor.http
        assert url is not None
        base = f"http://127.0.0.1:{server.server_address[1]}"
        remote_url = f"{base}/cat.png"
        text_part = {"type": "text", "text": QUESTION}
        remote = {"type": "image_url", "image_url": {"url": remote_url}}
        inline = {"type": "image_url", "image_url": {"url": data_url(image)}}
        # A loopback host is not fetched (SSRF) unless allow_private_image_hosts: one
        # generic error, and the server never asked.
        with pytest.raises(openai.BadRequestError, match="could not be fetched"):
            openai_chat(url, [text_part, remote])
        # Bytes that a client made to look like the old in-band URL placeholder are only an
        # image that does not decode: nothing is fetched.
        forged = base64.b64encode(b"\x00mlx-supervisor remote image\x00" + remote_url.encode())
        response = httpx.post(f"{url}/api/chat", json={"model": "eyes", "stream": False,
                              "messages": [{"role": "user", "content": "hi",
                                            "images": [forged.decode()]}]}, timeout=60)  # fmt: skip
        assert response.status_code == 400 and "cannot be decoded" in response.text, response.text
        assert _OneImage.paths == []
        # A text-only model is refused before anything is fetched.
        with pytest.raises(openai.BadRequestError, match="text-only"):
            openai_chat(url, [text_part, remote], model="tiny")
        assert _OneImage.paths == []

        assert daemon.config_path is not None
        daemon.config_path.write_text("allow_private_image_hosts = true\n" + config)
        assert "allow_private_image_hosts" in client.reload().daemon_now
        expected = greedy(reference, [text_part, inline], [image])
        assert openai_chat(url, [text_part, remote]) == expected
        # One fetch per distinct URL, redirects followed (each hop checked).
        hop = {"type": "image_url", "image_url": {"url": f"{base}/hop"}}
        _OneImage.paths = []
        two = [text_part, hop, remote, hop]
        assert openai_chat(url, two) == greedy(reference, [text_part, inline, inline, inline],
                                               [image] * 3)  # fmt: skip
        assert sorted(_OneImage.paths) == ["/cat.png", "/cat.png", "/hop"], _OneImage.paths
        _OneImage.body = image * 64  # over max_image_bytes
        with pytest.raises(openai.BadRequestError, match="max_image_bytes"):
            openai_chat(url, [text_part, remote])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_70_percent_rule_refuses_a_vision_model(start_daemon: DaemonFactory) -> None:
    # builtin:tiny-vision's estimate counts the vision encoder's extra (512 MiB and more):
    # less than a 900 MiB machine, more than 70% of it.
    daemon = start_daemon(CONFIG, env={HTTP_ENV: "127.0.0.1:0", "OVERRIDE_MEMORY_MB": "900"})
    url = Client(daemon.socket_path).status().supervisor.http
    assert url is not None
    response = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "eyes", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
    }, timeout=60)  # fmt: skip
    assert response.status_code == 507, response.text
    message = response.json()["error"]["message"]
    assert "vision model" in message and "70%" in message and "900.0 MiB" in message, message


def test_two_images_of_one_size_never_share_a_cache_key(reference: Any) -> None:
    from runner.vision import input_embeddings, vision_prompt

    model, tokenizer, config = reference
    from mlx_lm.processors import load_processor

    processor = load_processor(model, config)
    text = "<|patch|> and <|patch|>"
    prompt_a, a = vision_prompt(tokenizer, processor, text, [png(5), png(6)])
    prompt_b, b = vision_prompt(tokenizer, processor, text, [png(5), png(7)])
    assert prompt_a == prompt_b  # the same tokens ...
    (s1, e1), (s2, e2) = a.spans
    assert a.cache_key[:e1] == b.cache_key[:e1]  # ... the same first image ...
    assert all(x != y for x, y in zip(a.cache_key[s2:e2], b.cache_key[s2:e2], strict=True))
    assert all(-(2**31) <= t < 0 for t in a.cache_key[s1:e1])  # int32, as the disk tier keeps
    # Embeddings from the middle of an image (a cache that holds part of it) are the rows
    # of the whole prompt's.
    whole = input_embeddings(model, prompt_a, a, 0)
    part = input_embeddings(model, prompt_a, a, s2 + 1)
    assert np.allclose(np.array(whole[s2 + 1 :]), np.array(part), atol=1e-6)
    with pytest.raises(ValueError, match="cannot be decoded"):
        vision_prompt(tokenizer, processor, text, [png(5), b"junk"])
    with pytest.raises(ValueError, match="may not contain"):
        vision_prompt(tokenizer, processor, text, [png(5)])


def padded_png(image: bytes, size: int) -> bytes:
    """The PNG ``image`` grown to ``size`` bytes by a private ancillary chunk
    after its header: decoders skip it, the pixels are the same."""
    import struct
    import zlib

    chunk = b"prVt" + bytes(size - len(image) - 12)
    body = struct.pack(">I", len(chunk) - 4) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return image[:33] + body + image[33:]  # 33: the signature and the IHDR chunk


def test_a_frame_limit_over_16_mib_reaches_the_runner_and_a_command_over_it_fails_alone(
    start_daemon: DaemonFactory,
) -> None:
    limit = 40 << 20
    config = (f"max_frame_bytes = {limit}\nmax_image_bytes = {32 << 20}\n"
              '[[models]]\nname = "eyes"\nmodel = "builtin:tiny-vision"\n'
              '[[models]]\nname = "primed"\nmodel = "builtin:tiny"\n'
              f'system_prompt = "{"s" * 16_384}"\n')  # fmt: skip
    daemon = start_daemon(config, env={HTTP_ENV: "127.0.0.1:0"})
    client = Client(daemon.socket_path)
    url = client.status().supervisor.http
    assert url is not None
    text_part = {"type": "text", "text": QUESTION}
    image = png(8)
    expected = openai_chat(url, [text_part, {"type": "image_url",
                                             "image_url": {"url": data_url(image)}}])  # fmt: skip
    (pid,) = [r.pid for r in client.status().runners if r.name == "eyes"]
    # 17 MiB of image in one Generate: over the runner's old fixed 16 MiB, within the limit.
    big = {"type": "image_url", "image_url": {"url": data_url(padded_png(image, 17 << 20))}}
    assert openai_chat(url, [text_part, big]) == expected
    assert [r.pid for r in client.status().runners if r.name == "eyes"] == [pid]
    # A body within the limit whose command is not (the model's system prompt added):
    # a 413 for that request; nothing reached the runner (its prompt would be long: not
    # asked here), and the daemon serves on.
    body = {"model": "primed", "max_tokens": 2,
            "messages": [{"role": "user", "content": "u" * (limit - 4096)}]}  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 413, response.text[:500]
    assert "request too large" in response.json()["error"]["message"]
    (primed,) = [r for r in client.status().runners if r.name == "primed"]
    assert primed.pid is not None and primed.state == "ready", primed
    assert openai_chat(url, [text_part, big]) == expected


def test_only_image_formats_are_opened_and_huge_images_shrink_as_they_decode(
    served: str, reference: Any
) -> None:
    from mlx_lm.processors import load_processor

    from runner.vision import decode_image, useful_pixels

    url = served
    text_part = {"type": "text", "text": QUESTION}
    # EPS would have Pillow run Ghostscript on the client's bytes: never opened.
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\n"
    with pytest.raises(openai.BadRequestError, match="not a supported image format"):
        openai_chat(url, [text_part, {"type": "image_url", "image_url": {"url": data_url(eps)}}])
    # 36 million pixels of one colour (100 KB): reduced while decoding to about what the
    # processor keeps (no less). Counted by the runner (decoded and preprocessed, its
    # 4096 image tokens not run: slow on a CPU) as mlx-lm counts the whole image.
    out = io.BytesIO()
    Image.new("RGB", (6000, 6000), (200, 30, 40)).save(out, format="PNG")
    huge = out.getvalue()
    model, tokenizer, config = reference
    processor = load_processor(model, config)
    keep = useful_pixels(processor)
    assert keep is not None
    height, width, _ = decode_image(huge, 1, keep).shape
    assert height == width and keep <= width * height < 4 * keep, (width, keep)
    parts = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True, tokenize=False)  # fmt: skip
    whole = np.asarray(Image.open(io.BytesIO(huge)).convert("RGB"))
    expected = len(tokenizer.encode(processor(text, images=[whole])[0], add_special_tokens=False))
    api = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)

    def image_turn(image: bytes) -> Any:
        source = {"type": "base64", "media_type": "image/png",
                  "data": base64.b64encode(image).decode()}  # fmt: skip
        return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image", "source": source}]}]  # fmt: skip

    counted = api.messages.count_tokens(model="eyes", messages=image_turn(huge)).input_tokens
    assert counted == expected
    # ... and as the request's usage does.
    small = image_turn(png(9))
    counted = api.messages.count_tokens(model="eyes", messages=small).input_tokens
    assert counted == api.messages.create(model="eyes", max_tokens=2,
                                          messages=small).usage.input_tokens  # fmt: skip


@pytest.mark.parametrize(("address", "public"), [
    ("93.184.215.14", True), ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("192.168.0.1", False),
    ("169.254.169.254", False), ("fe80::1", False), ("224.0.0.1", False), ("0.0.0.0", False),
    ("240.0.0.1", False), ("100.64.0.1", False), ("::ffff:127.0.0.1", False), ("fd00::1", False),
])  # fmt: skip
def test_only_global_unicast_addresses_are_fetched_from(address: str, public: bool) -> None:
    import ipaddress

    from supervisor.fronts.http.images import is_public

    assert is_public(ipaddress.ip_address(address)) is public
