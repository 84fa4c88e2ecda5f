"""Speculative decoding: builtin:tiny with builtin:small-draft (a draft that proposes its
input token again; it has tiny's and small's tokenizer), served by a real daemon and runner
through the OpenAI front (the real ``openai`` client) and the socket client, each greedy
answer compared with mlx-lm's plain ``generate_step`` in this process on the same directory.
One daemon serves the module."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import openai
import pytest
from mlx_lm.generate import generate_step

from conftest import USER_BUILTIN_CACHE, module_daemon
from ipc.messages import LoadRequest
from runner.builtin import ensure_builtin_model
from supervisor.client import Client, ClientError
from supervisor.config import (
    ModelConfig,
    SupervisorConfig,
    spec_problem,
)
from supervisor.memory.estimate import estimate_reference, with_draft
from supervisor.registry.specs import merge_spec

DRAFT = "builtin:small-draft"
TOKENS = 12
# tiny's greedy answer to this repeats its first token: the draft has something to get right.
QUESTION = "hello"
# No hot spare: the refused load must leave no process behind (a spare taken is replaced).
CONFIG = f"""
hot_spare = false

[[models]]
name = "spec"
model = "builtin:tiny"
draft_model = "{DRAFT}"
num_draft_tokens = 3
max_concurrent = 4
"""


@pytest.fixture(scope="module")
def served(
    builtin_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Client, str, Path]]:
    """One daemon for the module with model "spec" loaded: its client, its HTTP base URL
    and its socket path."""
    root = tmp_path_factory.mktemp("speculative")
    with module_daemon(root, builtin_cache, CONFIG) as daemon:
        client = Client(daemon.socket_path)
        client.load("builtin:tiny", name="spec")
        url = client.status().supervisor.http
        assert url is not None
        yield client, url, daemon.socket_path


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(url: str, prompt: str = QUESTION, **extra: Any) -> Any:
    return api(url).chat.completions.create(
        model="spec", messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS,
        temperature=0.0, **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def greedy() -> dict[tuple[str, int], str]:
    """mlx-lm's plain greedy answers (no draft) in this process, by prompt and length."""
    return {}


def plain_answer(cache: dict[tuple[str, int], str], prompt: str, tokens: int = TOKENS) -> str:
    if (prompt, tokens) not in cache:
        model, tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:tiny")))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)  # fmt: skip
        made = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=tokens)]
        cache[(prompt, tokens)] = str(tokenizer.decode(made)).strip()
    return cache[(prompt, tokens)]


def draft_stats(client: Client) -> Any:
    (info,) = [r for r in client.status().runners if r.name == "spec"]
    assert info.draft is not None
    return info.draft


def test_small_draft_has_small_and_tiny_tokenizer_and_proposes_its_input_again() -> None:
    draft, draft_tokenizer = mlx_lm.load(str(ensure_builtin_model(DRAFT)))
    _, tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:tiny")))
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()
    ids = tokenizer.encode("The river runs from the mountains to the sea.")
    proposed = mx.argmax(draft(mx.array(ids)[None])[0], axis=-1).tolist()
    assert proposed == ids


def test_spec_draft_predicts_most_of_spec_targets_greedy_tokens() -> None:
    """The bench's pair accepts drafts by prediction: over a text, the draft's greedy next
    token is the target's at most positions (built once per machine, like smollm2)."""
    target, tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:spec-target",
                                                             USER_BUILTIN_CACHE)))  # fmt: skip
    draft, draft_tokenizer = mlx_lm.load(str(ensure_builtin_model("builtin:spec-draft",
                                                                  USER_BUILTIN_CACHE)))  # fmt: skip
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert (len(target.layers), len(draft.layers)) == (12, 1)
    text = "The river runs from the mountains to the sea. In the spring it is full of melted snow"
    ids = mx.array([tokenizer.encode(text)])
    wanted, proposed = target(ids)[0], draft(ids)[0]
    agreed = int((wanted.argmax(-1) == proposed.argmax(-1)).sum().item())
    assert agreed >= 0.75 * ids.shape[1], (agreed, ids.shape[1])
    # ... and not because the target is the draft: its quiet layers still change its logits.
    assert float(mx.abs(wanted - proposed).max().item()) > 0.1


def test_speculative_answer_is_plain_greedy_and_says_how_many_drafts_were_accepted(
    served: tuple[Client, str, Path], greedy: dict[tuple[str, int], str]
) -> None:
    client, url, _ = served
    before = draft_stats(client)
    reply = chat(url)
    assert (reply.choices[0].message.content or "").strip() == plain_answer(greedy, QUESTION)
    ours = reply.model_extra["supervisor"]
    assert ours["batched"] is False
    assert 0 < ours["draft_accepted"] <= ours["draft_tokens"]
    after = draft_stats(client)
    assert after.model == DRAFT and after.num_draft_tokens == 3
    assert after.requests == before.requests + 1
    assert after.drafted - before.drafted == ours["draft_tokens"]
    assert after.accepted - before.accepted == ours["draft_accepted"]


def test_prefix_cache_still_hits_and_the_answer_stays_greedy(
    served: tuple[Client, str, Path], greedy: dict[tuple[str, int], str]
) -> None:
    _, url, _ = served
    prompt = "Please count from one to ten."
    first = chat(url, prompt)
    again = chat(url, prompt)
    expected = plain_answer(greedy, prompt)
    for reply in (first, again):
        assert (reply.choices[0].message.content or "").strip() == expected
        assert reply.model_extra["supervisor"]["draft_tokens"] > 0
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= again.usage.prompt_tokens - 1


def test_requests_side_by_side_batch_without_the_draft_and_stay_greedy(
    served: tuple[Client, str, Path], greedy: dict[tuple[str, int], str]
) -> None:
    """A long answer decoding speculatively alone moves into a plain batch when two more
    requests come (its cache cut back to the tokens it has sent), and all three answers
    stay plain greedy."""
    _, url, _ = served
    long_tokens, prompts = 600, ["Why is the sky blue?", "What is the capital of France?"]
    expected_long = plain_answer(greedy, QUESTION, long_tokens)
    expected = [plain_answer(greedy, p) for p in prompts]
    stream = api(url).chat.completions.create(
        model="spec", messages=[{"role": "user", "content": QUESTION}], max_tokens=long_tokens,
        temperature=0.0, stream=True,
    )  # fmt: skip
    parts: list[str] = []
    long_fields: dict[str, Any] = {}
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = None
        for chunk in stream:
            long_fields = (chunk.model_extra or {}).get("supervisor") or long_fields
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if futures is None:  # it streams: the others come while it decodes
                    futures = [pool.submit(chat, url, p) for p in prompts]
        assert futures is not None
        replies = [f.result() for f in futures]
    assert "".join(parts).strip() == expected_long
    assert [(r.choices[0].message.content or "").strip() for r in replies] == expected
    fields = [r.model_extra["supervisor"] for r in replies]
    assert all(f["batched"] for f in fields), fields
    # The long one itself drafted while alone, then went on in the batch.
    assert long_fields["batched"] is True, long_fields
    assert 0 < long_fields["draft_accepted"] <= long_fields["draft_tokens"], long_fields


def test_a_request_with_logits_processors_decodes_without_the_draft(
    served: tuple[Client, str, Path],
) -> None:
    _, url, _ = served
    reply = chat(url, frequency_penalty=0.5)
    assert "draft_tokens" not in reply.model_extra["supervisor"]


def test_cli_json_reports_draft_counts(served: tuple[Client, str, Path]) -> None:
    _, _, socket_path = served
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "generate", "--socket", str(socket_path), "spec",
         QUESTION, "--max-tokens", str(TOKENS), "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["generation_tokens"] == TOKENS
    assert 0 <= summary["draft_accepted"] <= summary["draft_tokens"] and summary["draft_tokens"] > 0


def test_a_draft_with_another_tokenizer_is_refused_at_load_and_the_daemon_serves_on(
    served: tuple[Client, str, Path], greedy: dict[tuple[str, int], str]
) -> None:
    client, url, _ = served
    with pytest.raises(ClientError) as refused:
        client.load("builtin:tiny", name="mismatched", draft_model="builtin:tiny-qwen3-tools")
    message = str(refused.value)
    assert "does not share the tokenizer" in message and "builtin:tiny-qwen3-tools" in message
    reply = chat(url)
    assert (reply.choices[0].message.content or "").strip() == plain_answer(greedy, QUESTION)
    assert [r.name for r in client.status().runners if r.state == "ready"] == ["spec"]


def test_the_estimate_counts_the_draft_and_a_group_with_a_draft_is_refused() -> None:
    model = estimate_reference("builtin:tiny")
    draft = estimate_reference(DRAFT)
    assert model is not None and draft is not None
    both = with_draft(model, draft, DRAFT)
    assert both.draft_bytes >= draft.weights_bytes + draft.kv_cache_bytes
    assert both.total_bytes == model.total_bytes + both.draft_bytes
    assert both.planned_bytes > model.planned_bytes + draft.weights_bytes
    spec = merge_spec(SupervisorConfig(), LoadRequest("builtin:tiny", draft_model=DRAFT,
                                                      num_draft_tokens=5))  # fmt: skip
    assert (spec.draft_model, spec.num_draft_tokens) == (DRAFT, 5)
    grouped = ModelConfig(name="g", model="builtin:tiny", draft_model=DRAFT, ranks=2)
    assert "draft_model with a distributed group" in (spec_problem(grouped) or "")
