"""LoRA adapters: builtin:tiny with builtin:tiny-adapter and builtin:tiny-adapter-b, served by a
real daemon and runner through the OpenAI front (the real ``openai`` client), each greedy answer
compared with mlx-lm in this process (``mlx_lm.load(path, adapter_path=...)`` on the same
directories). One daemon serves the module: its runner switches adapters between requests,
never reloading the base model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import msgspec
import openai
import pytest
from mlx_lm.generate import generate_step

from conftest import DaemonFactory, module_daemon
from ipc.messages import (
    ChatMessage,
    EngineSettings,
    Generate,
    GenerationDone,
    SamplingParams,
    TextChunk,
)
from modelfiles.builtin_adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from runner.adapters import Adapters
from runner.builtin import ensure_builtin_model
from runner.builtin_adapters import ensure_builtin_adapter
from runner.engine import Engine
from runner.faults import Faults
from runner.guard import MemoryGuard
from runner.loading import load_model
from supervisor.adapters import adapter_for, adapters_problem
from supervisor.cli.render import status_table
from supervisor.client import Client, ClientError
from supervisor.config import ModelConfig, spec_problem

A, B = "builtin:tiny-adapter", "builtin:tiny-adapter-b"
QUESTION = "Tell me about the river and the mountains."
TOKENS = 8
CONFIG = f"""
[[models]]
name = "lora"
model = "builtin:tiny"
adapters = ["{A}", "{B}"]
max_concurrent = 4

[[models]]
name = "plain"
model = "builtin:tiny"
"""


@pytest.fixture(scope="module")
def served(
    builtin_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Client, str]]:
    """One daemon for the module, its two models loaded (so no test sees their runners
    start): its client and its HTTP base URL."""
    root = tmp_path_factory.mktemp("adapters")
    with module_daemon(root, builtin_cache, CONFIG) as daemon:
        client = Client(daemon.socket_path)
        client.load("builtin:tiny", name="lora")
        client.load("builtin:tiny", name="plain")
        url = client.status().supervisor.http
        assert url is not None
        yield client, url


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(url: str, prompt: str = QUESTION, adapters: str | None = None, model: str = "lora") -> str:
    body: dict[str, Any] = {} if adapters is None else {"adapters": adapters}
    reply = api(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS,
        temperature=0.0, extra_body=body,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length"
    return (reply.choices[0].message.content or "").strip()  # a chat answer's edges are trimmed


def in_process(
    adapter: str | None, prompt: str | list[dict[str, str]] = QUESTION, raw: bool = False
) -> str:
    """The greedy answer of mlx-lm in this process, loaded with ``adapter_path`` as
    mlx_lm.server would load it, to a user line (or a whole chat)."""
    path = None if adapter is None else str(ensure_builtin_adapter(adapter))
    model, tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:tiny")), adapter_path=path)
    if raw:
        ids = tokenizer.encode(prompt)
    else:
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=TOKENS)]
    text = str(tokenizer.decode(tokens))
    return text if raw else text.strip()


@pytest.fixture(scope="module")
def expected() -> dict[str | None, str]:
    """Each adapter's greedy answer to QUESTION in process (None: the base model), as
    the tests first need them."""
    return {}


def answers(cache: dict[str | None, str], adapter: str | None) -> str:
    if adapter not in cache:
        cache[adapter] = in_process(adapter)
    return cache[adapter]


def test_builtin_adapters_are_lora_directories_that_change_mlx_lm_greedy_tokens() -> None:
    base, a, b = (in_process(adapter) for adapter in (None, A, B))
    assert len({base, a, b}) == 3, (base, a, b)
    path = ensure_builtin_adapter(A)
    assert {ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME} <= {p.name for p in path.iterdir()}
    weights = mx.load(str(path / ADAPTER_WEIGHTS_NAME))
    assert all(bool(mx.any(w != 0)) for name, w in weights.items() if name.endswith("lora_b"))
    assert ensure_builtin_adapter(A) == path  # made once, then found


def test_each_adapter_answers_as_mlx_lm_in_process_switching_back_and_forth(
    served: tuple[Client, str], expected: dict[str | None, str]
) -> None:
    client, url = served
    switches = _runner(client, "lora").adapter_switches
    # The same prompt each time with the prefix cache on: a hit across adapters would
    # hand one adapter's KV to another and change its tokens.
    order: list[tuple[str | None, str | None]] = [
        (None, A), ("", None), ("tiny-adapter-b", B), (A, A), ("", None), (B, B),
        ("tiny-adapter", A),
    ]  # fmt: skip
    for asked, adapter in order:
        assert chat(url, adapters=asked) == answers(expected, adapter), (asked, adapter)
    info = _runner(client, "lora")
    assert info.adapter_switches >= switches + 5
    assert info.prefix_cache is not None and info.prefix_cache.hits >= 3


def test_text_completions_take_adapters_too(
    served: tuple[Client, str],
) -> None:
    _, url = served
    reply = api(url).completions.create(model="lora", prompt="Once upon a time",
                                        max_tokens=TOKENS, temperature=0.0,
                                        extra_body={"adapters": B})  # fmt: skip
    assert reply.choices[0].text == in_process(B, "Once upon a time", raw=True)


def test_concurrent_requests_of_two_adapters_each_get_their_own_tokens(
    served: tuple[Client, str], expected: dict[str | None, str]
) -> None:
    _, url = served
    asked = [A, B, "", A, B, ""]
    wanted = [answers(expected, a or None) for a in asked]
    with ThreadPoolExecutor(len(asked)) as pool:
        got = list(pool.map(lambda a: chat(url, adapters=a), asked))
    assert got == wanted


def test_an_unlisted_adapter_is_refused_and_the_daemon_keeps_serving(
    served: tuple[Client, str], expected: dict[str | None, str], tmp_path: Path
) -> None:
    client, url = served
    for asked in (str(tmp_path), "tiny-adapter-c", "/etc"):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(url, adapters=asked)
        message = str(caught.value)
        assert "adapters" in message and repr(asked) in message and "tiny-adapter-b" in message
    with pytest.raises(openai.BadRequestError, match="has no adapters"):
        chat(url, adapters=A, model="plain")
    with pytest.raises(openai.BadRequestError, match="adapters"):
        api(url).chat.completions.create(model="lora", messages=[{"role": "user", "content": "x"}],
                                         extra_body={"adapters": 3})  # fmt: skip
    assert chat(url, adapters=B) == answers(expected, B)
    text = "".join(client.generate("lora", QUESTION, max_tokens=TOKENS, adapter="tiny-adapter"))
    assert text == in_process(A, QUESTION, raw=True)


def test_status_shows_the_adapters(served: tuple[Client, str]) -> None:
    client, _ = served
    status = client.status()
    assert _runner(client, "lora").adapters == [A, B]
    assert _runner(client, "plain").adapters == []
    assert "builtin:tiny + adapters tiny-adapter*, tiny-adapter-b" in status_table(status)


def test_a_bad_adapter_directory_fails_the_load_with_a_clear_error(
    start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    misfit = tmp_path / "misfit"  # an adapter made for another model: its shapes do not fit
    misfit.mkdir()
    config = msgspec.json.decode((ensure_builtin_adapter(A) / ADAPTER_CONFIG_NAME).read_bytes())
    (misfit / ADAPTER_CONFIG_NAME).write_bytes(msgspec.json.encode(config))
    mx.save_safetensors(str(misfit / ADAPTER_WEIGHTS_NAME),
                        {"model.layers.1.self_attn.q_proj.lora_a": mx.zeros((32, 8))})  # fmt: skip
    daemon = start_daemon(f'[[models]]\nname = "gone"\nmodel = "builtin:tiny"\n'
                          f'adapters = "{missing}"\n'
                          f'[[models]]\nname = "misfit"\nmodel = "builtin:tiny"\n'
                          f'adapters = "{misfit}"\nrestart = "never"\n')  # fmt: skip
    client = Client(daemon.socket_path)
    with pytest.raises(ClientError, match=f"adapter {missing}: no adapter directory there"):
        client.load("builtin:tiny", name="gone", restart="never")
    fits = rf"(?s)adapter {misfit} does not fit the model.*lora_a: adapter shape \(32, 8\)"
    with pytest.raises(ClientError, match=fits):
        client.load("builtin:tiny", name="misfit")


def test_adapters_config_and_requests_are_checked_without_a_runner() -> None:
    def spec(adapters: Any) -> ModelConfig:
        return msgspec.convert({"name": "m", "model": "builtin:tiny", "adapters": adapters},
                               ModelConfig)  # fmt: skip

    assert spec_problem(spec("/some/dir")) is None
    assert "no builtin adapter 'builtin:nope'" in str(spec_problem(spec(["builtin:nope"])))
    assert "'sql' names two adapters" in str(adapters_problem(["/a/sql", "/b/sql/"]))
    assert "distributed group" in str(spec_problem(msgspec.structs.replace(spec(A), ranks=2)))
    assert adapter_for(["/x/sql", A], "m", None) == "/x/sql"  # the first is the default
    assert adapter_for(["/x/sql", A], "m", "tiny-adapter") == A
    assert adapter_for(["/x/sql", A], "m", "") is None
    assert adapter_for([], "m", None) is None
    with pytest.raises(ValueError, match="model 'm' has no adapters"):
        adapter_for([], "m", "/x/sql")


def test_switching_swaps_modules_without_copying_base_weights() -> None:
    model, _ = mlx_lm.load(str(ensure_builtin_model("builtin:tiny")))
    q_proj = model.model.layers[1].self_attn.q_proj
    adapters = Adapters.load(model, [A, B])
    assert model.model.layers[1].self_attn.q_proj is q_proj  # the base layers are back
    adapters.use(A)
    wrapped = model.model.layers[1].self_attn.q_proj
    assert wrapped is not q_proj and wrapped.linear is q_proj  # shared, not copied
    adapters.use(None)
    assert model.model.layers[1].self_attn.q_proj is q_proj
    assert adapters.space(None) == 0 and adapters.space(B) == 2


def test_a_next_turn_prefilled_with_one_adapter_serves_only_that_adapter() -> None:
    """After a chat answered with adapter B the idle engine prefills its next turn with B,
    into B's key space: the next turn with B starts from it, and the same turn with A or
    with no adapter computes its own KV (each answer as mlx-lm's in process)."""
    loaded = load_model("builtin:tiny", lambda phase, done, total: None)
    frames: list[Any] = []
    engine = Engine(loaded.model, loaded.tokenizer, EngineSettings(), guard=MemoryGuard(),
                    faults=Faults(""), send=frames.append, is_cancelled=lambda _: False,
                    on_finished=lambda request_id, tokens: None, max_tokens_cap=None,
                    adapters=Adapters.load(loaded.model, [A, B]))  # fmt: skip

    def ask(request_id: int, history: list[dict[str, str]], adapter: str | None) -> str:
        messages = [ChatMessage(m["role"], m["content"]) for m in history]
        engine.submit(Generate(request_id, messages=messages, adapter=adapter,
                               sampling=SamplingParams(max_tokens=TOKENS)))  # fmt: skip
        while engine.has_work:  # the answer, then its next turn's prefill
            engine.step()
        return "".join(f.text for f in frames
                       if isinstance(f, TextChunk) and f.request_id == request_id)  # fmt: skip

    history = [{"role": "user", "content": QUESTION}]
    history.append({"role": "assistant", "content": ask(1, history, B)})
    assert history[-1]["content"].strip() == in_process(B, history[:1])
    stats = engine.stats().next_turn
    assert stats is not None and stats.prefilled == 1
    history.append({"role": "user", "content": "And the sea?"})
    for request_id, adapter in ((2, A), (3, None), (4, B)):
        assert ask(request_id, history, adapter).strip() == in_process(adapter, history), adapter
    cached = {f.request_id: f.cached_tokens for f in frames if isinstance(f, GenerationDone)}
    assert cached[2] == cached[3] == 0 and cached[4] > 0


def _runner(client: Client, name: str) -> Any:
    return next(r for r in client.status().runners if r.name == name)
