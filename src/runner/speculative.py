"""Speculative decoding: a draft model proposes tokens, the model checks
them, through mlx-lm's ``speculative_generate_step``.

A model with a ``draft_model`` loads both (the draft after the model, each
evaluated layer by layer under the memory guard) and refuses a draft whose
tokenizer is not the model's (:func:`check_same_tokenizer`): the two must
mean the same thing by every token id.

Which requests use the draft: one served alone (:mod:`runner.solo`) whose
logits no processor reshapes. ``speculative_generate_step`` calls the
processors for positions whose tokens it may then reject, which a stateful
processor (a grammar, a reasoning budget) cannot take back, so a request
with penalties, a ``logit_bias``, a grammar or a reasoning budget decodes as
usual. Requests in a batch decode as usual too (mlx-lm's ``BatchGenerator``
has no draft): a lone request that a second one joins moves into the batch
where it left off, and the draft serves the next lone request again.

The prefix cache keeps the model's KV only, as without a draft (so batches,
next-turn prefills and the disk tier share it unchanged): a speculative
request takes the model's cached prefix from it and prefills the draft over
its whole prompt (the draft is small: that costs its share of a full
prefill). At its end the model's cache is brought back to exactly the
request's tokens (:func:`settle`): ``speculative_generate_step`` may leave
rejected drafts in it, or the last token out of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.generate import generation_stream, speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ipc.messages import DraftStats, EngineSettings
from modelfiles.cache import ProgressCallback
from runner.guard import MemoryGuard
from runner.job import Job
from runner.kv_quant import check_quantizable, make_cache
from runner.loading import LoadedModel, load_model
from runner.prefix_cache import PromptCache

__all__ = ["Draft", "check_same_tokenizer", "load_draft", "settle", "speculative_steps"]

log = structlog.get_logger("runner.speculative")


@dataclass(eq=False)
class Draft:
    """A loaded draft model, its settings, and how its drafts have done."""

    model: Any
    reference: str  # as the config names it
    num_draft_tokens: int
    new_cache: Callable[[], PromptCache]  # a fresh cache for the draft (kv_bits as the model's)
    requests: int = 0  # served with the draft
    drafted: int = 0  # draft tokens the model checked
    accepted: int = 0  # of those, kept

    def stats(self) -> DraftStats:
        return DraftStats(self.reference, self.num_draft_tokens, self.requests,
                          self.drafted, self.accepted)  # fmt: skip


def load_draft(
    model: str,
    loaded: LoadedModel,
    settings: EngineSettings,
    progress: ProgressCallback,
    guard: MemoryGuard | None,
) -> Draft:
    """Load ``settings.draft_model`` for ``model`` (``loaded``), layer by
    layer under ``guard`` as the model was (progress phases ``draft resolve``
    and ``draft weights``), and check that it can draft for it.

    Raises:
        ValueError: another tokenizer (see :func:`check_same_tokenizer`); a
            cache of either model that cannot be trimmed back (rejected drafts
            must leave it) or quantized with ``kv_bits``.
        MemoryGuardError: memory ran short while its weights were evaluated.
    """
    reference = settings.draft_model
    assert reference is not None

    def draft_progress(phase: str, done: int, total: int) -> None:
        progress(f"draft {phase}", done, total)

    draft = load_model(reference, draft_progress, guard)
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer, model, reference)
    if settings.kv_bits is not None:
        check_quantizable(draft.model, settings.kv_bits, settings.kv_group_size)
    new_cache = functools.partial(make_cache, draft.model, settings.kv_bits,
                                  settings.kv_group_size)  # fmt: skip
    for name, cache in ((model, make_cache(loaded.model, settings.kv_bits,
                                           settings.kv_group_size)),
                        (reference, new_cache())):  # fmt: skip
        if not can_trim_prompt_cache(cache):
            kinds = ", ".join(sorted({type(c).__name__ for c in cache if not c.is_trimmable()}))
            raise ValueError(f"speculative decoding needs KV caches that can be cut back; "
                             f"those of {name!r} ({kinds}) cannot")  # fmt: skip
    log.info("draft_loaded", draft_model=reference, param_bytes=draft.param_bytes,
             load_s=round(draft.load_s, 3), num_draft_tokens=settings.num_draft_tokens)  # fmt: skip
    return Draft(draft.model, reference, settings.num_draft_tokens, new_cache)


def check_same_tokenizer(tokenizer: Any, draft_tokenizer: Any, model: str, draft: str) -> None:
    """Refuse a draft whose tokenizer differs from the model's.

    Raises:
        ValueError: the vocabularies differ (the message names both models,
            the sizes and a token they disagree on)."""
    ours: dict[str, int] = tokenizer.get_vocab()
    theirs: dict[str, int] = draft_tokenizer.get_vocab()
    if ours == theirs:
        return
    why = f"{len(theirs)} tokens against {len(ours)}"
    if len(ours) == len(theirs):
        token = next(t for t, i in sorted(ours.items(), key=lambda x: x[1]) if theirs.get(t) != i)
        why = f"token {token!r} is id {ours[token]} in the model, {theirs.get(token)} in the draft"
    raise ValueError(
        f"draft_model {draft!r} does not share the tokenizer of {model!r} ({why}); "
        "a draft must have the model's tokenizer"
    )


def speculative_steps(
    job: Job,
    draft: Draft,
    model: Any,
    last: list[int],
    cache: PromptCache,
    draft_cache: PromptCache,
) -> Generator[tuple[Any, Any], None, None]:
    """``job``'s tokens and logprobs, from ``speculative_generate_step`` over
    the prompt's ``last`` token(s) (the rest is in ``cache`` and, but for the
    last token, in ``draft_cache``), counting the drafts on the job and on
    ``draft``.

    ``speculative_generate_step`` says which tokens came from the draft; a
    round drafts ``num_draft_tokens`` (fewer near ``max_tokens``) and ends
    with the model's own token, so a round's drafts are counted at its
    first token."""
    draft.requests += 1
    steps = speculative_generate_step(
        mx.array(last),
        model,
        draft.model,
        num_draft_tokens=draft.num_draft_tokens,
        max_tokens=job.max_tokens,
        sampler=job.sampler,
        prompt_cache=[*cache, *draft_cache],
    )
    round_starts = True
    try:
        for token, logprobs, from_draft in steps:
            if round_starts:
                drafted = min(draft.num_draft_tokens, job.max_tokens - len(job.tokens))
                job.draft_tokens += drafted
                draft.drafted += drafted
            if from_draft:
                job.draft_accepted += 1
                draft.accepted += 1
            round_starts = not from_draft
            yield token, logprobs
    finally:
        steps.close()  # its own finally rewinds the caches to what it kept


def prefill_draft(draft: Draft, tokens: list[int], cache: PromptCache) -> None:
    """Run ``tokens`` through the draft into its ``cache``."""
    with mx.stream(generation_stream):
        draft.model(mx.array(tokens)[None], cache=cache)
        mx.eval([layer.state for layer in cache])


def settle(cache: PromptCache, model: Any, tokens: list[int]) -> bool:
    """Bring the model's ``cache``, left by a closed speculative generation,
    to hold exactly ``tokens`` (the prompt and every token generated), as
    ``generate_step`` leaves it; False when it cannot (then it must not be
    stored).

    A closed generation leaves either the last token out (it came from the
    model, which has not seen it) or one draft too many, rejected, in."""
    if not cache:
        return False
    held = cache[0].size()
    if held > len(tokens):
        trim_prompt_cache(cache, held - len(tokens))
    elif held == len(tokens) - 1:
        with mx.stream(generation_stream):
            model(mx.array(tokens[-1:])[None], cache=cache)
            mx.eval([layer.state for layer in cache])
    return bool(cache[0].size() == len(tokens))
