"""The output layer of the random-weight builtin models, shared by every recipe's writer
(``runner.builtin``, ``runner.builtin_vision``)."""

from __future__ import annotations

from typing import Any

__all__ = ["lm_head"]

# Target standard deviation of the output logits. The final RMSNorm makes the hidden state's RMS
# exactly 1, so a logit is a sum of hidden_size terms and lm_head rows get
# std = _LOGIT_STD / sqrt(hidden_size). See lm_head() for why it is this large.
_LOGIT_STD = 3.0


def lm_head(rng: Any, shape: tuple[int, ...], zeroed: int) -> Any:
    """Output projection with the first ``zeroed`` rows, the special tokens' (and
    tiny-qwen3-tools' thinking and tool-call tags), zeroed.

    A zero row gives that token a logit of exactly 0 whatever the hidden state. The other
    vocab_size - 5 logits are ~N(0, _LOGIT_STD^2), so under greedy decoding a special token
    (EOS included) can only win if every one of the ~2000 others is negative: never in practice.
    Under temperature-1 sampling its probability is about 1 / (vocab_size * exp(_LOGIT_STD^2/2))
    ~= 5e-6 per step, so a random model practically always decodes to max_tokens, which is what
    benchmarks want; it also keeps role/control tokens out of generated text (a test that
    wants them can still force one, with a logit bias or a grammar).
    """
    import numpy as np

    hidden = shape[1]
    std = _LOGIT_STD / float(np.sqrt(hidden))
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    values[:zeroed] = 0.0
    return values
