"""Embeddings on a real daemon and real runners, through the real clients: OpenAI's
``client.embeddings.create`` (``/v1/embeddings``), Ollama's ``embed`` and ``embeddings``
(``/api/embed``, ``/api/embeddings``) and our own client's ``embed`` (the socket).

The vectors are checked against mlx-lm in this process on the same directory: the model's
decoder on each text alone, pooled and normalized as the model's sentence-transformers files
say. One daemon serves the module (its models loaded before the first test): builtin:tiny-embed
(last-token pooling, normalized, Matryoshka), a copy of it whose files say mean pooling, no
Normalize module and no Matryoshka, and builtin:tiny (a chat model). Its frames are capped at
128 KiB (``max_frame_bytes``), so that a request's vectors can overflow one.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from conftest import faults, module_daemon
from runner.builtin import ensure_builtin_model
from runner.embeddings import EmbeddingConfigError, read_embedding_config
from supervisor.client import Client, ClientError

TOLERANCE = 1e-5
FRAME_BYTES = 131072
SLOW = "slow_prefill=0.008"  # each batch sleeps 8 ms per (padded) token: 64 rows of 3, ~1.5 s
TEXTS = [
    "The river runs from the mountains to the sea.",
    "Paris",
    "A recipe for bread: mix flour, salt, yeast and warm water, then knead the dough.",
    "Emoji 🙂 and 数字 3.14159",
]


@dataclass
class Served:
    url: str
    client: Client
    openai: openai.OpenAI
    ollama: ollama.Client
    embed_dir: Path
    mean_dir: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, builtin_cache: Path) -> Iterator[Served]:
    """A daemon with HTTP on a free port and its three models loaded (no spare runner: a
    process started mid-test would count as one left behind)."""
    root = tmp_path_factory.mktemp("embeddings")
    embed_dir = ensure_builtin_model("builtin:tiny-embed", builtin_cache / "mlx-supervisor" /
                                     "builtin")  # fmt: skip
    mean_dir = root / "mean-embed"
    shutil.copytree(embed_dir, mean_dir)
    pooling = json.loads((mean_dir / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_lasttoken=False, pooling_mode_mean_tokens=True)
    (mean_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = json.loads((mean_dir / "modules.json").read_text())
    (mean_dir / "modules.json").write_text(json.dumps(modules[:2]))  # no Normalize
    model_config = json.loads((mean_dir / "config.json").read_text())
    del model_config["is_matryoshka"]  # its vectors may not be cut
    (mean_dir / "config.json").write_text(json.dumps(model_config))
    config = f"hot_spare = false\nmax_frame_bytes = {FRAME_BYTES}\n"
    with module_daemon(root, builtin_cache, config) as daemon:
        client = Client(daemon.socket_path)
        client.load("builtin:tiny-embed", "embed")
        client.load(str(mean_dir), "mean")
        client.load("builtin:tiny", "tiny")
        url = client.status().supervisor.http
        assert url is not None
        yield Served(
            url, client, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0),
            ollama.Client(host=url, timeout=60), embed_dir, mean_dir,
        )  # fmt: skip


class InProcess:
    """mlx-lm in this process on a model directory: each text alone through the decoder."""

    def __init__(self, path: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(path))[:2]

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def hidden(self, tokens: list[int]) -> Any:
        import mlx.core as mx

        return np.array(self.model.model(mx.array([tokens]))[0].astype(mx.float32))

    def last_token(self, text: str, dimensions: int | None = None) -> Any:
        vector = self.hidden(self.tokens(text))[-1][:dimensions]
        return vector / np.linalg.norm(vector)

    def mean(self, text: str) -> Any:
        return self.hidden(self.tokens(text)).mean(axis=0)


@pytest.fixture(scope="module")
def reference(served: Served) -> InProcess:
    return InProcess(served.embed_dir)


def far(got: Any, want: Any) -> float:
    return float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)))


def refusal(caught: pytest.ExceptionInfo[Any]) -> str:
    error = caught.value
    assert getattr(error, "status_code", None) == 400, error
    return str(error)


def test_embeddings_equal_in_process_ones_whatever_the_batch(
    served: Served, reference: InProcess
) -> None:
    batch = served.openai.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    assert batch.usage.prompt_tokens == sum(len(reference.tokens(t)) for t in TEXTS)
    for text, datum in zip(TEXTS, batch.data, strict=True):
        alone = served.openai.embeddings.create(model="embed", input=text,
                                                encoding_format="float")  # fmt: skip
        want = reference.last_token(text)
        assert far(datum.embedding, want) < TOLERANCE, text
        assert far(alone.data[0].embedding, datum.embedding) < TOLERANCE, text
        assert abs(np.linalg.norm(datum.embedding) - 1) < TOLERANCE
    # Different texts, different vectors: the pooling reads the text, not the padding.
    assert far(batch.data[0].embedding, np.asarray(batch.data[1].embedding)) > 0.01


def test_base64_carries_the_float32_bytes_of_the_vectors(served: Served) -> None:
    floats = served.openai.embeddings.create(model="embed", input=TEXTS[:2],
                                             encoding_format="float")  # fmt: skip
    # The openai client asks for base64 when not told, and decodes it itself.
    default = served.openai.embeddings.create(model="embed", input=TEXTS[:2])
    raw = httpx.post(f"{served.url}/v1/embeddings", timeout=30, json={
        "model": "embed", "input": TEXTS[:2], "encoding_format": "base64"}).json()  # fmt: skip
    for i in range(2):
        want = floats.data[i].embedding
        assert default.data[i].embedding == want
        decoded = np.frombuffer(base64.b64decode(raw["data"][i]["embedding"]), dtype="<f4")
        assert decoded.tolist() == want


def test_token_ids_embed_as_the_text_they_encode(served: Served, reference: InProcess) -> None:
    ids = [reference.tokens(text) for text in TEXTS[:2]]
    # builtin:tiny-embed's tokenizer appends <|end_of_text|> (id 1), the token pooled, as
    # Qwen3-Embedding's appends <|endoftext|>; ids given as they are get no such token.
    assert [row[-1] for row in ids] == [1, 1]
    texts = served.openai.embeddings.create(model="embed", input=TEXTS[:2],
                                            encoding_format="float")  # fmt: skip
    lists = served.openai.embeddings.create(model="embed", input=ids, encoding_format="float")
    one = served.openai.embeddings.create(model="embed", input=ids[0], encoding_format="float")
    assert far(lists.data[1].embedding, np.asarray(texts.data[1].embedding)) < TOLERANCE
    assert far(one.data[0].embedding, np.asarray(texts.data[0].embedding)) < TOLERANCE
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai.embeddings.create(model="embed", input=[[1, 99999]])
    assert "token id 99999" in refusal(caught)


def test_dimensions_keep_the_leading_ones_normalized_again(
    served: Served, reference: InProcess
) -> None:
    cut = served.openai.embeddings.create(model="embed", input=TEXTS[0], dimensions=16,
                                          encoding_format="float")  # fmt: skip
    assert len(cut.data[0].embedding) == 16
    assert far(cut.data[0].embedding, reference.last_token(TEXTS[0], 16)) < TOLERANCE
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai.embeddings.create(model="embed", input="x", dimensions=65)
    assert "dimensions" in refusal(caught) and "1 to 64" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:  # not a Matryoshka model
        served.openai.embeddings.create(model="mean", input="x", dimensions=16)
    assert "is_matryoshka" in refusal(caught)


def test_a_model_pools_as_its_pooling_config_says(served: Served) -> None:
    mean_model = InProcess(served.mean_dir)
    got = served.openai.embeddings.create(model="mean", input=TEXTS, encoding_format="float")
    for text, datum in zip(TEXTS, got.data, strict=True):
        assert far(datum.embedding, mean_model.mean(text)) < TOLERANCE, text
    assert abs(np.linalg.norm(got.data[0].embedding) - 1) > 0.01  # no Normalize module


def test_ollama_embed_and_its_older_route_give_the_same_vectors(served: Served) -> None:
    floats = served.openai.embeddings.create(model="embed", input=TEXTS[:2],
                                             encoding_format="float")  # fmt: skip
    embedded = served.ollama.embed(model="embed", input=TEXTS[:2])
    assert embedded.model == "embed"
    assert embedded.prompt_eval_count == floats.usage.prompt_tokens
    for i in range(2):
        assert embedded.embeddings[i] == floats.data[i].embedding
    legacy = served.ollama.embeddings(model="embed", prompt=TEXTS[0])
    assert list(legacy.embedding) == floats.data[0].embedding
    assert len(served.ollama.embed(model="embed", input="x", dimensions=8).embeddings[0]) == 8
    # Over the model's 512 tokens: cut (Ollama's default), or refused when asked not to.
    long_text = "the river runs " * 400
    assert len(served.ollama.embed(model="embed", input=long_text).embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError) as caught:
        served.ollama.embed(model="embed", input=long_text, truncate=False)
    assert caught.value.status_code == 400 and "over model embed's 512" in caught.value.error


def test_chat_and_embedding_models_refuse_each_others_requests_and_keep_serving(
    served: Served,
) -> None:
    before = {r.name: (r.pid, r.restarts) for r in served.client.status().runners}
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai.embeddings.create(model="tiny", input="Hello")
    assert "model tiny is a chat model, not an embedding model" in refusal(caught)
    with pytest.raises(ollama.ResponseError) as ollama_caught:
        served.ollama.embed(model="tiny", input="Hello")
    assert ollama_caught.value.status_code == 400 and "chat model" in ollama_caught.value.error
    with pytest.raises(openai.BadRequestError) as caught:
        served.openai.chat.completions.create(
            model="embed", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert "model embed is an embedding model" in refusal(caught)
    with pytest.raises(ollama.ResponseError) as ollama_caught:
        served.ollama.chat(model="embed", messages=[{"role": "user", "content": "Hi"}])
    assert ollama_caught.value.status_code == 400
    for bad in ({"model": "embed", "input": []}, {"model": "embed", "input": [""]},
                {"model": "embed", "input": [1, "a"]}, {"model": "embed", "input": "x",
                                                        "encoding_format": "int8"}):  # fmt: skip
        response = httpx.post(f"{served.url}/v1/embeddings", json=bad, timeout=30)
        assert response.status_code == 400, (bad, response.text)
    # Nothing died: the same runners serve on.
    after = {r.name: (r.pid, r.restarts) for r in served.client.status().runners}
    assert after == before
    assert served.openai.embeddings.create(model="embed", input="still here").data
    chat = served.openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason == "length"


def test_the_python_client_embeds_over_the_socket(served: Served) -> None:
    floats = served.openai.embeddings.create(model="embed", input=TEXTS[:2],
                                             encoding_format="float")  # fmt: skip
    answer = served.client.embed("embed", TEXTS[:2])
    assert answer.floats() == [d.embedding for d in floats.data]
    assert answer.prompt_tokens == floats.usage.prompt_tokens
    with pytest.raises(ClientError) as caught:
        served.client.embed("tiny", "Hello")
    assert caught.value.code == "bad_request"


def test_a_pooling_the_runner_cannot_apply_is_named(tmp_path: Path) -> None:
    kinds = ["Transformer", "Pooling", "Dense"]
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": ["", "1_Pooling", "2_Dense"][i],
         "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(kinds)
    ]))  # fmt: skip
    with pytest.raises(EmbeddingConfigError, match=r"models\.Dense"):
        read_embedding_config(tmp_path)
    (tmp_path / "modules.json").unlink()
    assert read_embedding_config(tmp_path) is None  # no modules.json: a chat model


def pid_of(served: Served, name: str) -> int:
    return next(r.pid for r in served.client.status().runners if r.name == name)


def test_inputs_too_large_to_encode_are_refused_naming_the_field(served: Served) -> None:
    pid = pid_of(served, "embed")
    for body, field in (({"input": [2**70]}, "input"), ({"input": [[1, 2**40]]}, "input"),
                        ({"input": [-1]}, "input"), ({"input": "x", "dimensions": 2**70},
                                                     "dimensions")):  # fmt: skip
        response = httpx.post(f"{served.url}/v1/embeddings", json={"model": "embed", **body},
                              timeout=30)  # fmt: skip
        assert response.status_code == 400, (body, response.text)
        assert field in response.text, response.text
    response = httpx.post(f"{served.url}/api/embed", timeout=30,
                          json={"model": "embed", "input": "x", "dimensions": 2**70})  # fmt: skip
    assert response.status_code == 400 and "dimensions" in response.text, response.text
    with pytest.raises(ClientError) as caught:
        served.client.embed("embed", [[1, 2**40]])
    assert caught.value.code == "bad_request" and "input[0]" in str(caught.value)
    assert pid_of(served, "embed") == pid


def test_vectors_over_the_frame_limit_are_refused_and_the_runner_serves_on(
    served: Served,
) -> None:
    pid = pid_of(served, "embed")
    with pytest.raises(openai.BadRequestError) as caught:  # 2048 x 64 x 4 bytes: 512 KiB
        served.openai.embeddings.create(model="embed", input=["a"] * 2048)
    message = refusal(caught)
    assert "2048 inputs x 64 dimensions" in message and f"{FRAME_BYTES}-byte" in message
    assert served.openai.embeddings.create(model="embed", input=["a"] * 400).data
    assert pid_of(served, "embed") == pid


def test_a_cut_input_keeps_the_end_token_its_tokenizer_appends(
    served: Served, reference: InProcess
) -> None:
    long_text = "the river runs " * 400
    tokens = reference.tokens(long_text)
    plain = list(reference.tokenizer.encode(long_text, add_special_tokens=False))
    assert tokens[-1] == 1 and plain[-1] != 1  # <|end_of_text|>, appended
    got = served.ollama.embed(model="embed", input=long_text).embeddings[0]
    want = reference.hidden([*plain[:511], 1])[-1]
    assert far(got, want / np.linalg.norm(want)) < TOLERANCE


def test_the_python_client_takes_a_flat_list_of_token_ids_as_one_input(served: Served) -> None:
    ids = [5, 6, 7, 1]
    flat = served.client.embed("embed", ids)
    assert len(flat.vectors) == 1
    assert flat.floats() == served.client.embed("embed", [ids]).floats()


def embed_in_thread(url: str, model: str, inputs: list[str], timeout_s: float) -> dict[str, Any]:
    """POST /v1/embeddings from a thread; the outcome lands in the dict it returns."""
    outcome: dict[str, Any] = {}

    def post() -> None:
        try:
            outcome["response"] = httpx.post(f"{url}/v1/embeddings", timeout=timeout_s,
                                             json={"model": model, "input": inputs})  # fmt: skip
        except httpx.TimeoutException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=post)
    thread.start()
    outcome["thread"] = thread
    return outcome


def wait_busy(client: Client, name: str) -> None:
    deadline = time.monotonic() + 30
    while next(r.state for r in client.status().runners if r.name == name) != "busy":
        assert time.monotonic() < deadline, f"{name} never got busy"


def test_an_embed_whose_client_left_is_dropped_by_the_runner(served: Served) -> None:
    served.client.load("builtin:tiny-embed", "slow", env=faults(SLOW))
    try:
        # 4 batches of ~1.5 s; the client gives up during the first.
        left = embed_in_thread(served.url, "slow", ["Paris"] * 256, timeout_s=0.5)
        left["thread"].join()
        assert isinstance(left.get("error"), httpx.TimeoutException)
        started = time.monotonic()
        assert served.openai.embeddings.create(model="slow", input="Paris").data
        # Behind at most the batch being computed, not the three more a left client asked for.
        assert time.monotonic() - started < 3.5
    finally:
        served.client.unload("slow")


def test_unloading_a_model_mid_embed_fails_the_embed_cleanly(served: Served) -> None:
    served.client.load("builtin:tiny-embed", "doomed", env=faults(SLOW))
    running = embed_in_thread(served.url, "doomed", ["Paris"] * 256, timeout_s=60)
    try:
        wait_busy(served.client, "doomed")
    finally:
        served.client.unload("doomed")
        running["thread"].join()
    response = running["response"]
    assert response.status_code == 503, response.text
    assert "doomed was unloaded" in response.json()["error"]["message"]


def test_a_model_without_a_length_in_its_config_takes_8192_tokens(
    served: Served, tmp_path: Path
) -> None:
    for name in ("modules.json", "1_Pooling"):
        source = served.embed_dir / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, tmp_path / name)
    config = json.loads((served.embed_dir / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    embedding = read_embedding_config(tmp_path)
    assert embedding is not None and embedding.max_tokens == 8192
