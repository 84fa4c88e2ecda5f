"""The builtin models' tokenizer: its special tokens, chat template and training corpus.

Every random-weight builtin (``modelfiles.builtin``, ``modelfiles.builtin_vision``) shares one
byte-level BPE tokenizer, trained here on an embedded corpus, so that every machine with the same
library versions writes byte-identical files. A module of its own so that the recipes that use
it import it, not each other. Nothing here imports mlx or numpy; the ``tokenizers`` library is
imported when the tokenizer is trained.
"""

from __future__ import annotations

import json
from typing import Any

# Bump when anything that changes the written files changes (corpus, tokenizer settings,
# initialisation, config). The version is part of the directory name, so a new recipe gets a
# new directory and old caches are simply left behind.
RECIPE_VERSION = 2

# MANIFEST_NAME (from modelfiles.cache) is the marker file written last into the build
# directory; it records the recipe and the size of every other file, and is checked on every
# ensure_builtin_model() call (cheap: stat only).

BOS_TOKEN = "<|begin_of_text|>"
EOT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes their ids: 0..4, before the 256 byte symbols and the merges.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 3  # <|im_end|>: the end of a chat turn is what generation stops on.
EOT_TOKEN_ID = 1
PAD_TOKEN_ID = 4

# Qwen3's thinking and tool-call tags, as builtin:tiny-qwen3-tools has them: trained as tokens
# right after SPECIAL_TOKENS (ids 5..10), so they are single tokens inside the output layer, and
# then marked not special, as in Qwen3's tokenizer, so that decoding never drops them (the text
# a model generates must show them to the reasoning and tool-call parsers).
QWEN3_TOOL_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

TOKENIZER_VOCAB_SIZE = 2048  # target; the real size is read back from the trained tokenizer

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- else %}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, EOT_TOKEN],
    }


def _tokenizer_json_appending_eos(tokenizer_json: str) -> str:
    """``tokenizer_json`` with a post-processor that appends ``<|end_of_text|>`` to every
    encoded text (when special tokens are added), as Qwen3-Embedding's tokenizer appends its
    ``<|endoftext|>``."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=False, trim_offsets=False),
        processors.TemplateProcessing(
            single=f"$A {EOT_TOKEN}", pair=f"$A {EOT_TOKEN} $B {EOT_TOKEN}",
            special_tokens=[(EOT_TOKEN, EOT_TOKEN_ID)],
        ),
    ])  # fmt: skip
    text: str = tokenizer.to_str(pretty=False)
    return text


_TOKENIZER_JSON_CACHE: dict[tuple[int, tuple[str, ...]], str] = {}


def _tokenizer_json(extra_tokens: tuple[str, ...] = ()) -> str:
    """Train the byte-level BPE tokenizer and return its serialised tokenizer.json.

    The result is a pure function of the embedded corpus, ``extra_tokens`` and the trainer
    settings: the trainer breaks ties between equally frequent pairs by pair id, and ids are
    assigned in merge order, so thread count and hash seeds do not matter (tests check byte
    identity across processes). ``extra_tokens`` get the ids after SPECIAL_TOKENS' (the merges
    are as many fewer) and are then marked not special.
    """
    key = (RECIPE_VERSION, extra_tokens)
    cached = _TOKENIZER_JSON_CACHE.get(key)
    if cached is not None:
        return cached
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *extra_tokens],
        # All 256 byte symbols, so any UTF-8 text encodes (no unknown tokens) and round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    text: str = tokenizer.to_str(pretty=False)
    if extra_tokens:
        # The trainer adds every token it is given as special; unmark these (it has no option
        # for that), and let the library serialise the result again.
        content = json.loads(text)
        for added in content["added_tokens"]:
            if added["content"] in extra_tokens:
                added["special"] = False
        text = Tokenizer.from_str(json.dumps(content)).to_str(pretty=False)
    _TOKENIZER_JSON_CACHE[key] = text
    return text


# --------------------------------------------------------------------------------------------
# Tokenizer training corpus
# --------------------------------------------------------------------------------------------


def _corpus_lines() -> list[str]:
    """The tokenizer training corpus: embedded text plus a few generated, deterministic lines."""
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    lines += [" ".join(str(i) for i in range(start, start + 32)) for start in range(0, 1024, 32)]
    lines += [f"{i:#06x} {i:08b} {i * 37 % 1000:03d}" for i in range(0, 256, 3)]
    return lines


_CORPUS = '''\
The supervisor starts one runner process for every model it serves. Each runner loads its model,
answers requests over a small message protocol, and exits when it is told to stop. When a runner
crashes, the supervisor notices that the process has died, records the reason, and starts a new
one after a short delay. The delay grows with every failure, so a model that cannot be loaded does
not keep the machine busy forever. Memory is given back to the operating system by ending the
process: nothing the runner allocated can survive its death.

A language model reads a sequence of tokens and predicts the next one. The tokenizer turns text
into tokens and tokens back into text. A byte-level tokenizer starts from the two hundred and
fifty-six possible bytes and learns to merge frequent pairs into longer pieces, so that common
words become single tokens while rare words, names, numbers and symbols are spelled out from
smaller parts. Because every byte has a token, any text at all can be encoded and decoded again
without loss: accents, emoji, tabs, new lines and other scripts included.

Once upon a time there was a small computer that lived on a desk near a window. Every morning the
sun came in, and every evening the lamp was switched on. The computer liked to count things: the
birds on the roof, the cars in the street, the pages of the books on the shelf. One day it counted
the words in all the books and found that the most common word was "the", followed by "of",
"and", "to", "a" and "in". It wrote the numbers down in a table and was very pleased with itself.

Questions and answers. What is the capital of France? Paris is the capital of France. How many
days are there in a week? There are seven days in a week. Why is the sky blue? Sunlight is
scattered by the air, and blue light is scattered more than red light. Which is larger, the moon
or the earth? The earth is larger. Can you help me write a letter? Of course, I would be happy to
help. Please tell me who the letter is for and what you would like to say.

User: hello, who are you?
Assistant: Hello! I am a small test model. My weights are random, so my answers will not make
sense, but I can be loaded, started, stopped and measured like any other model.
User: Thank you. Please count from one to ten.
Assistant: One, two, three, four, five, six, seven, eight, nine, ten.

Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. January, February, March,
April, May, June, July, August, September, October, November and December. Spring, summer,
autumn and winter. North, south, east and west. Red, orange, yellow, green, blue, indigo and
violet. Zero, one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty,
thirty, forty, fifty, hundred, thousand, million, billion.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result: list[int] = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, k: int = 10) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: -item[1])[:k]


if __name__ == "__main__":
    import sys
    for line in sys.stdin:
        print(line.strip().lower())

async def handle(request, response):
    try:
        payload = await request.json()
    except ValueError as error:
        return response.error(400, str(error))
    finally:
        await request.close()
    return response.ok({"id": payload["id"], "status": "done"})

{"model": "builtin:tiny", "max_tokens": 128, "temperature": 0.0, "stream": true}
{"id": 42, "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "length"}]}
{"error": {"type": "timeout", "message": "the runner did not answer in time", "code": 504}}

$ python -m pytest tests -q --timeout 120
$ git status && git diff --stat && git log --oneline -n 5
$ ls -la /tmp && cat /proc/meminfo | grep MemAvailable
SELECT name, COUNT(*) AS total FROM requests WHERE status = 'ok' GROUP BY name ORDER BY total DESC;
for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!("{:?}", v); }

Error: connection refused. Warning: memory usage is above the soft limit. Info: model loaded in
1.25 seconds. Debug: prompt has 512 tokens, generated 256 tokens at 48.7 tokens per second.
Restarting runner after exit code -9 (killed). Unloading the least recently used model.

Le petit chat dort sur le canapé près de la fenêtre. Où est la gare, s'il vous plaît ?
Merci beaucoup.
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung, schön, Mädchen.
El niño come una manzana en el jardín. ¿Dónde está la biblioteca? ¡Qué día tan bonito!
O menino está a ler um livro na praça. Ação, coração, não, irmã, amanhã.
Il gatto nero dorme sotto il tavolo. Perché no? Città, università, caffè.
Καλημέρα, τι κάνεις; Η θάλασσα είναι γαλάζια.
Привет, как дела? Сегодня хорошая погода, и мы идём гулять в парк.
こんにちは、世界。今日はいい天気ですね。猫が好きです。
你好，世界。今天天气很好，我们去公园散步吧。
안녕하세요. 만나서 반갑습니다.
مرحبا بالعالم. كيف حالك؟
नमस्ते दुनिया। आप कैसे हैं?
Emoji: 🙂 😀 🎉 🚀 ✅ ❌ ⚠️ 🔥 ❤️ 👍 — dashes – and “quotes” ‘single’ … ellipsis,
€100, £5, ¥300, 25°C, ±0.5, ×, ÷, ≤, ≥, ≠, ∞, π, λ, μ, σ, Σ, √2.

Units and numbers: 3.14159, 2.71828, 1.41421, 0.5, 0.25, 0.125, 1e-5, 6.02e23, 100%, 50 MB, 256 GB,
8 GiB, 16 cores, 4096 tokens, 2048 tokens, 1024 bytes, 12:30, 2024-01-31, 23:59:59, v1.2.3.

A recipe for bread. Mix five hundred grams of flour with ten grams of salt and seven grams of
yeast. Add three hundred and fifty millilitres of warm water and knead the dough for ten minutes
until it is smooth. Let it rise for an hour, shape it into a loaf, let it rise again, and bake it
in a hot oven for about forty minutes. The bread is done when it sounds hollow when you tap it.

The river runs from the mountains to the sea. In the spring it is full of melted snow and runs
fast and cold; in the late summer it is slow and warm, and children swim in it. Along its banks
there are willows, reeds, herons and, if you are lucky and quiet, a kingfisher. People have lived
beside the river for thousands of years, fishing, farming, trading, and building bridges.

Testing is the art of asking a program questions whose answers you already know. A good test is
small, fast and deterministic: it gives the same result every time it runs, on every machine.
A flaky test is worse than no test, because it teaches people to ignore failures. When a test
fails, it should say clearly what was expected and what happened instead.
'''  # noqa: RUF001 (deliberately multilingual text)
