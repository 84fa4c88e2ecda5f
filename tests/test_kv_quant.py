"""Quantized KV caches (``kv_bits``) in the runner: the cache layers
(:mod:`runner.kv_quant`), the prefix cache, the load's probe, and the engine
alone, in a batch and ahead of the next turn.

builtin:tiny's heads (16 wide) cannot be quantized in mlx's groups (32, 64 or
128 values), so ``tiny_kv`` is tiny with 64-wide heads: its embedding, MLP,
norms and output head, and new attention projections. Greedy tokens are the
yardstick: a request must give the same tokens whether its prefix came from
the cache or was computed, and whether it ran alone or in a batch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import base, llama
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from ipc.messages import (
    ChatMessage,
    EngineSettings,
    ExitAudit,
    Generate,
    LoadFailed,
    LoadModel,
    Started,
)
from runner.engine import build_prompt_tokens
from runner.kv_quant import BatchQuantizedKV, QuantizedKV, check_quantizable, make_cache
from runner.loading import LoadedModel, load_model
from runner.next_turn import next_turn_prefix
from runner.prefix_cache import PrefixCache, prefix_view
from test_engine import PROMPTS, Harness
from test_runner_process import spawn_runner

KV8 = EngineSettings(kv_bits=8)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny", lambda phase, done, total: None)


@pytest.fixture(scope="module")
def tiny_kv(tiny: LoadedModel) -> LoadedModel:
    """builtin:tiny with 64-wide attention heads (a group size of 64 divides them)."""
    config = json.loads((tiny.path / "config.json").read_text())
    mx.random.seed(26)
    model = llama.Model(llama.ModelArgs.from_dict({**config, "head_dim": 64}))
    kept = [(k, v) for k, v in tree_flatten(tiny.model.parameters()) if ".self_attn." not in k]
    # Queries and keys scaled up: attention sharp enough that each token depends
    # on its context (near-uniform attention repeats one token whatever came before).
    sharper = [(f"model.layers.{i}.self_attn.{name}.weight",
                getattr(layer.self_attn, name).weight * 4)
               for i, layer in enumerate(model.model.layers)
               for name in ("q_proj", "k_proj")]  # fmt: skip
    model.load_weights(kept + sharper, strict=False)
    mx.eval(model.parameters())
    return dataclasses.replace(tiny, model=model)


@pytest.fixture
def query_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query length of every call of mlx-lm's quantized attention, from now on."""
    lengths: list[int] = []
    original = base.quantized_scaled_dot_product_attention

    def counting(queries: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        lengths.append(queries.shape[2])
        return original(queries, *args, **kwargs)

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", counting)
    return lengths


def greedy(model: Any, prompt: list[int], cache: list[Any], n: int, step: int = 2048) -> list[int]:
    """``n`` greedy tokens of ``prompt`` through mlx-lm's ``generate_step``."""
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, prefill_step_size=step)
    return [int(token) for (token, _), _ in zip(steps, range(n), strict=False)]


def encode(model: LoadedModel, text: str) -> list[int]:
    return build_prompt_tokens(model.tokenizer, Generate(0, prompt=text))


# --- the cache layers -------------------------------------------------------------------


class LayeredModel:
    """A model that makes the cache layers it is given (only its cache is used)."""

    def __init__(self, *layers: Any) -> None:
        self.layers = layers

    def make_cache(self) -> list[Any]:
        return list(self.layers)


def test_only_plain_kv_cache_layers_are_quantized() -> None:
    model = LayeredModel(KVCache(), RotatingKVCache(8), ArraysCache(1))
    cache = make_cache(model, 4, 32)
    assert [type(layer) for layer in cache] == [QuantizedKV, RotatingKVCache, ArraysCache]
    assert (cache[0].kv_bits, cache[0].group_size) == (4, 32)
    assert make_cache(model, None) == list(model.layers)  # no kv_bits: mlx-lm's own


def test_a_quantized_layer_measures_its_tokens_and_bytes(tiny_kv: LoadedModel) -> None:
    cache = make_cache(tiny_kv.model, 8, 64)
    layer = cache[0]
    assert (layer.size(), layer.nbytes, layer.empty()) == (0, 0, True)
    tiny_kv.model(mx.array([encode(tiny_kv, PROMPTS[0])]), cache=cache)
    n = len(encode(tiny_kv, PROMPTS[0]))
    assert (layer.size(), layer.empty()) == (n, False)
    # 256 token slots, 2 KV heads of 64 values: 8-bit values plus a float32 scale and bias.
    assert layer.nbytes == 2 * 256 * 2 * (64 + 2 * 4)
    assert layer.kv_bits == 8 and not hasattr(layer, "bits")  # hidden after a prefill step
    # A layer sharing this cache (gemma3n's) reads K/V as the step fetched them: dense.
    keys, values = layer.keys_and_values()
    assert isinstance(keys, mx.array) and keys.shape == (1, 2, n, 64)
    assert values.dtype == layer.keys[1].dtype  # the model's dtype
    tiny_kv.model(mx.array([[5]]), cache=cache)
    assert layer.bits == 8 and layer.size() == n + 1
    keys, _ = layer.keys_and_values()  # after a decode step: the quantized triples
    assert isinstance(keys, tuple) and len(keys) == 3 and keys[0].dtype == mx.uint32


def test_a_prefix_view_of_a_quantized_cache_is_its_class_over_its_arrays(
    tiny_kv: LoadedModel,
) -> None:
    prompt = encode(tiny_kv, " ".join(PROMPTS))
    cache = make_cache(tiny_kv.model, 4, 32)
    tiny_kv.model(mx.array([prompt]), cache=cache)
    mx.eval([layer.state for layer in cache])
    stored = [tuple(mx.array(part) for part in layer.keys) for layer in cache]
    view = prefix_view(cache, 10)
    for layer, seen in zip(cache, view, strict=True):
        assert type(seen) is QuantizedKV and (seen.kv_bits, seen.group_size) == (4, 32)
        # Slices that end at the prefix (a copy would keep the whole 256-token buffer).
        assert seen.size() == 10 and all(part.shape[2] == 10 for part in seen.keys)
        for part, whole in zip(seen.keys, layer.keys, strict=True):
            assert mx.array_equal(part, whole[..., :10, :]).item()
    tiny_kv.model(mx.array([prompt[10:14]]), cache=view)  # writing to the view...
    mx.eval([layer.state for layer in view])
    for layer, before in zip(cache, stored, strict=True):  # ...leaves the stored arrays alone
        assert all(mx.array_equal(a, b).item() for a, b in zip(layer.keys, before, strict=True))


def test_the_prefix_cache_keeps_a_quantized_cache_and_hits_it(tiny_kv: LoadedModel) -> None:
    prompt = encode(tiny_kv, PROMPTS[2])
    cache = make_cache(tiny_kv.model, 8, 64)
    tiny_kv.model(mx.array([prompt]), cache=cache)
    prefix_cache = PrefixCache(1 << 30, 8)
    assert prefix_cache.store(prompt, cache)
    view, reused = prefix_cache.fetch([*prompt, 7, 8])
    stats = prefix_cache.stats()
    assert (stats.entries, stats.hits, reused) == (1, 1, len(prompt))
    assert view is not None and all(type(layer) is QuantizedKV for layer in view)


# --- attention: dense prefill, quantized decode -----------------------------------------


@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (4, 32)])
def test_prefill_steps_take_the_fused_attention_and_decode_the_quantized_one(
    tiny_kv: LoadedModel, query_lengths: list[int], bits: int, group_size: int
) -> None:
    model, prompt = tiny_kv.model, encode(tiny_kv, " ".join(PROMPTS))
    plain = [QuantizedKVCache(group_size, bits) if type(c) is KVCache else c
             for c in make_prompt_cache(model)]  # fmt: skip
    reference = greedy(model, prompt, plain, 12, step=16)  # mlx-lm's quantized attention throughout
    assert max(query_lengths) == 16  # (the count sees a prefill step that takes it)
    query_lengths.clear()
    tokens = greedy(model, prompt, make_cache(model, bits, group_size), 12, step=16)
    assert tokens == reference
    assert query_lengths and set(query_lengths) == {1}  # decode only: no score block in prefill


# --- batches -----------------------------------------------------------------------------


def history_cache(model: Any, head: list[int], bits: int, group_size: int) -> list[Any]:
    """A cache that holds ``head``, as a prefix-cache hit leaves it: computed
    with 3 tokens too many, then cut back."""
    cache = make_cache(model, bits, group_size)
    model(mx.array([[*head, 1, 2, 3]]), cache=cache)
    trim_prompt_cache(cache, 3)
    mx.eval([layer.state for layer in cache])
    return cache


@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (4, 32)])
def test_a_quantized_batch_gives_each_request_its_solo_tokens(
    tiny_kv: LoadedModel, query_lengths: list[int], bits: int, group_size: int
) -> None:
    model, n = tiny_kv.model, 16
    long = encode(tiny_kv, " ".join(PROMPTS * 3))
    prompts = [encode(tiny_kv, PROMPTS[0]), encode(tiny_kv, PROMPTS[1])[:3], long,
               encode(tiny_kv, PROMPTS[3]), long[:50]]  # fmt: skip
    solo = [greedy(model, p, make_cache(model, bits, group_size), n) for p in prompts]
    query_lengths.clear()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=5, prefill_batch_size=5,
                         prefill_step_size=32)  # fmt: skip
    gen.insert(prompts[:2], max_tokens=[n, n - 5],
               caches=[make_cache(model, bits, group_size) for _ in range(2)])  # fmt: skip
    got: dict[int, list[int]] = {uid: [] for uid in range(5)}
    caches: dict[int, list[Any]] = {}
    steps = 0
    while len(caches) < 5:
        _, responses = gen.next()
        steps += 1
        if steps == 3:  # late joiners: two with history caches of different lengths, one without
            heads = [prompts[2][:40], [], prompts[4][:20]]
            joining = [history_cache(model, head, bits, group_size) for head in heads]
            gen.insert([p[len(h) :] for p, h in zip(prompts[2:], heads, strict=True)],
                       max_tokens=[n] * 3, caches=joining, all_tokens=heads)  # fmt: skip
        for r in responses:
            got[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    assert got[1] == solo[1][: n - 5]
    for uid in (0, 2, 3, 4):
        assert got[uid] == solo[uid], uid
    for uid, cache in caches.items():  # each leaves the batch with a cache of its own sequence
        expected = len(prompts[uid]) + len(got[uid])
        assert type(cache[0]) is QuantizedKV and cache[0].size() == expected
    assert set(query_lengths) == {1}  # batch prefill chunks took the fused attention too


def test_a_batch_refuses_a_cache_that_is_not_quantized_alike(tiny_kv: LoadedModel) -> None:
    eight = make_cache(tiny_kv.model, 8, 64)[0]
    for other in (KVCache(), make_cache(tiny_kv.model, 4, 64)[0]):
        with pytest.raises(TypeError, match="cannot join a batch of 8-bit quantized caches"):
            BatchQuantizedKV.merge([eight, other])


# --- the load's probe --------------------------------------------------------------------


def test_the_probe_passes_a_model_whose_heads_the_group_size_divides(
    tiny_kv: LoadedModel,
) -> None:
    for bits, group_size in ((8, 64), (4, 32), (8, 32)):
        check_quantizable(tiny_kv.model, bits, group_size)


def test_the_probe_names_why_a_model_cannot_use_a_quantized_cache(
    tiny: LoadedModel, tiny_kv: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"^kv_bits=8: llama cannot use a quantized KV cache: "
                       r"the head dimension of its keys \(16\) is not a multiple of "
                       r"kv_group_size \(64\)$"):  # fmt: skip
        check_quantizable(tiny.model, 8, 64)
    with pytest.raises(ValueError, match=r"none of its layers has a plain KV cache \(ArraysCache"):
        check_quantizable(LayeredModel(ArraysCache(1)), 8, 64)

    def with_sinks(queries: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        sinks = mx.zeros((queries.shape[1],))
        return base.scaled_dot_product_attention(queries, *args, sinks=sinks, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", with_sinks)
    with pytest.raises(ValueError, match="does not support attention sinks"):
        check_quantizable(tiny_kv.model, 8, 64)


def test_a_runner_told_to_quantize_a_model_that_cannot_fails_its_load() -> None:
    proc, channel = spawn_runner()
    try:
        assert isinstance(channel.recv(), Started)
        channel.send(LoadModel("tiny", "builtin:tiny", engine=KV8))
        events = [channel.recv()]
        while not isinstance(events[-1], ExitAudit):
            events.append(channel.recv())
        (failed,) = [e for e in events if isinstance(e, LoadFailed)]
        assert failed.error.startswith("ValueError: kv_bits=8: llama cannot use a quantized KV")
        assert "(16) is not a multiple of kv_group_size (64)" in failed.error
        assert proc.wait(timeout=10) == 72
    finally:
        channel.close()
        proc.kill()
        proc.wait()


# --- the engine --------------------------------------------------------------------------


def alone(model: LoadedModel, prompt: str | list[ChatMessage], max_tokens: int) -> str:
    """The request served alone by a fresh 8-bit engine with no prefix cache."""
    h = Harness(model, EngineSettings(kv_bits=8, max_concurrent=1, prefix_cache=False))
    request_id = h.submit(prompt, max_tokens)
    h.run()
    return h.text(request_id)


def entries(h: Harness) -> Iterator[list[Any]]:
    assert h.engine.prefix_cache is not None
    index = h.engine.prefix_cache.index
    for key in index.keys():  # noqa: SIM118 (a PrefixIndex, not a dict)
        match = index.peek([*key, 0])
        assert match is not None
        yield match.value


def test_an_engine_reports_its_kv_quantization(tiny_kv: LoadedModel) -> None:
    stats = Harness(tiny_kv, EngineSettings(kv_bits=4, kv_group_size=32)).engine.stats()
    assert (stats.kv_bits, stats.kv_group_size, stats.batching) == (4, 32, True)
    stats = Harness(tiny_kv).engine.stats()
    assert (stats.kv_bits, stats.kv_group_size) == (None, None)


def test_a_quantized_chat_hits_the_prefix_cache_and_matches_the_uncached_output(
    tiny_kv: LoadedModel, query_lengths: list[int]
) -> None:
    h = Harness(tiny_kv, EngineSettings(kv_bits=8, next_turn_prefill=False))
    history = [ChatMessage("system", "You are terse. " * 20)]
    for turn in range(3):
        history.append(ChatMessage("user", f"Question {turn}: {PROMPTS[turn]}?"))
        request_id = h.submit(list(history), max_tokens=12)
        h.run()
        done = h.done(request_id)
        assert h.text(request_id) == alone(tiny_kv, list(history), 12), turn
        assert (done.cached_tokens > 0) == (turn > 0), turn
        history.append(ChatMessage("assistant", h.text(request_id)))
    stats = h.engine.stats().prefix_cache
    assert stats is not None and (stats.hits, stats.misses) == (2, 1) and stats.tokens_reused > 0
    for cache in entries(h):
        assert all(type(layer) is QuantizedKV and layer.kv_bits == 8 for layer in cache)
    assert set(query_lengths) == {1}


def test_quantized_requests_in_a_batch_give_their_solo_tokens(
    tiny_kv: LoadedModel, query_lengths: list[int]
) -> None:
    h = Harness(tiny_kv, EngineSettings(kv_bits=8, next_turn_prefill=False))
    shared = " ".join(PROMPTS)
    warm = h.submit(shared + " First.", 4)  # the prefix cache holds the shared start
    h.run()
    prompts = [PROMPTS[0], shared + " Second, then more.", PROMPTS[2], shared + " Third."]
    lengths = [30, 16, 12, 20]
    lone = h.submit(prompts[0], lengths[0])
    h.run(until=lambda: h.made(lone) >= 6)
    assert h.engine.solo is not None  # alone so far
    ids = [lone, *(h.submit(p, n) for p, n in zip(prompts[1:3], lengths[1:3], strict=True))]
    h.run(until=lambda: h.made(ids[1]) >= 3)
    assert h.engine.batch is not None and len(h.engine.in_batch) == 3
    ids.append(h.submit(prompts[3], lengths[3]))  # joins the running batch
    h.run()
    for request_id, prompt, n in zip(ids, prompts, lengths, strict=True):
        done = h.done(request_id)
        assert done.batched and done.generation_tokens == n, request_id
        assert h.text(request_id) == alone(tiny_kv, prompt, n), request_id
    assert h.done(ids[1]).cached_tokens > 0 and h.done(ids[3]).cached_tokens > 0
    assert h.done(warm).cached_tokens == 0
    for cache in entries(h):  # what each left the batch with
        assert all(type(layer) is QuantizedKV for layer in cache)
    assert set(query_lengths) == {1}


def test_a_lone_request_that_computed_nothing_yet_joins_a_batch_quantized(
    tiny_kv: LoadedModel,
) -> None:
    h = Harness(tiny_kv, EngineSettings(kv_bits=8, next_turn_prefill=False))
    first = h.submit("A", 12)  # one prompt token: its first step only starts generate_step
    h.engine.step()
    assert h.engine.solo is not None and not h.engine.solo.job.tokens
    second = h.submit(PROMPTS[1], 12)
    h.run()
    for request_id, prompt in ((first, "A"), (second, PROMPTS[1])):
        assert h.done(request_id).batched
        assert h.text(request_id) == alone(tiny_kv, prompt, 12)
    for cache in entries(h):
        assert all(type(layer) is QuantizedKV for layer in cache)


def test_next_turn_prefill_builds_quantized_entries_that_the_next_turns_use(
    tiny_kv: LoadedModel,
) -> None:
    h = Harness(tiny_kv, KV8)
    prefix_cache = h.engine.prefix_cache
    assert prefix_cache is not None
    history = [ChatMessage("system", "You are terse. " * 20)]
    ahead: list[int] = []  # what was prefilled after the last answer
    for turn in range(3):
        history.append(ChatMessage("user", f"Question {turn}: {PROMPTS[turn]}?"))
        request_id = h.submit(list(history), max_tokens=12)
        h.run()
        text = h.text(request_id)
        assert text == alone(tiny_kv, list(history), 12), turn
        if turn:  # it started from there
            assert h.done(request_id).cached_tokens == len(ahead), turn
        if turn == 0:  # nothing left to start from: the next turn starts from a fresh cache
            prefix_cache.evict(None)
        h.settle()
        ahead = next_turn_prefix(tiny_kv.tokenizer, history, text)
        assert ahead in prefix_cache.index
        for cache in entries(h):
            assert all(type(layer) is QuantizedKV for layer in cache), turn
        history.append(ChatMessage("assistant", text))
    stats = h.engine.stats().next_turn
    assert stats is not None and (stats.prefilled, stats.dropped) == (3, 0)


def test_an_8_bit_prefix_cache_entry_takes_9_32_of_the_float32_bytes(
    tiny_kv: LoadedModel,
) -> None:
    nbytes = []
    for settings in (EngineSettings(next_turn_prefill=False),
                     EngineSettings(kv_bits=8, next_turn_prefill=False)):  # fmt: skip
        h = Harness(tiny_kv, settings)
        h.submit(PROMPTS[4], 8)
        h.run()
        stats = h.engine.stats().prefix_cache
        assert stats is not None and stats.entries == 1
        nbytes.append(stats.bytes)
    # Per 64 values: 64 bytes, and a float32 scale and bias, against 256 bytes.
    assert nbytes[1] * 256 == nbytes[0] * (64 + 8)
