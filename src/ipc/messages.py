"""The whole wire protocol of mlx-supervisor, in one place.

Every connection (client <-> supervisor over the unix socket) and every pipe
pair (supervisor <-> runner) starts with a :class:`Hello` each way, then
carries frames of exactly one tagged union per direction:

- :data:`ClientMessage`: client -> supervisor
- :data:`ServerMessage`: supervisor -> client
- :data:`RunnerCommand`: supervisor -> runner
- :data:`RunnerEvent`: runner -> supervisor

Some structs travel in two unions (a runner's :class:`TextChunk` is forwarded
to the client as it is). Memory figures are bytes; times are seconds.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 11
"""Bumped on any incompatible change to a struct below."""

Role = Literal["client", "supervisor", "runner"]
FinishReason = Literal["stop", "length", "cancelled", "error", "memory_pressure", "tool_calls"]
RunnerState = Literal[
    "starting", "loading", "ready", "busy", "stopping", "crashed", "restarting", "failed"
]
RestartStrategy = Literal["always", "on-failure", "never"]
"""OTP restart strategies: when a runner that died on its own is started again."""
CauseClass = Literal[
    "metal_oom",  # "Insufficient Memory" from a Metal command buffer
    "gpu_timeout",  # kIOGPUCommandBufferCallbackErrorTimeout
    "cuda_oom",
    "peer_lost",  # a rank of a distributed group lost its peer
    "step_failed",  # a step raised on a rank of a group: the group cannot go on
    "memory_guard",  # the runner's own guard stopped a load
    "segfault",
    "oom_killed",  # SIGKILL while the system was under memory pressure
    "requested",  # unload, expiry, eviction, shutdown
    "unknown",
]
"""What kind of death a runner's exit was; memory classes go through
admission before any restart."""
MEMORY_CAUSES: frozenset[str] = frozenset({"metal_oom", "cuda_oom", "memory_guard", "oom_killed"})
GROUP_STEP_FAILED = "step failed"
"""How a rank's exit cause starts when a step raised (not a lost peer); its
exit audit's class is ``step_failed``."""


class Hello(msgspec.Struct, tag="hello"):
    """First frame on every connection and pipe, each way."""

    protocol_version: int
    pid: int
    role: Role
    software_version: str = ""


# --- shared pieces -----------------------------------------------------------


class ToolCall(msgspec.Struct, frozen=True):
    """A call of one of the request's tools, as the model wrote it (or, in a
    chat's history, as an earlier answer did). ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct):
    """One turn of a chat, rendered with the model's chat template.

    ``tool_calls``: an assistant turn that called tools; ``tool_call_id``: a
    ``tool`` turn, the answer to that call; ``reasoning``: an assistant turn's
    reasoning, for templates that show it again. ``images``: the turn's
    images, the encoded file bytes as the client sent them (PNG, JPEG, ...;
    decoded in the runner, see :mod:`runner.vision`), each placed before the
    character of ``content`` at the same index of ``image_offsets``
    (non-decreasing; ``len(content)``: after the text)."""

    role: str
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    images: list[bytes] | None = None
    image_offsets: list[int] | None = None


class SamplingParams(msgspec.Struct, frozen=True):
    """How to generate; the runner clamps max_tokens to its model's cap.

    ``stop``: up to four strings; the text ends before the first that
    appears in it (``finish_reason`` "stop"), and none of it is sent.
    The rest are mlx-lm's sampler and logits processors (``make_sampler``,
    ``make_logits_processors``), with their defaults meaning "off";
    ``top_logprobs`` asks for that many alternatives per token (with
    ``logprobs``); ``max_reasoning_tokens`` ends a model's thinking after
    that many tokens.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logprobs: bool = False
    top_logprobs: int = 0
    max_reasoning_tokens: int | None = None


ToolChoiceMode = Literal["auto", "none", "required"]


class NamedTool(msgspec.Struct, frozen=True):
    """``tool_choice`` naming the one function the model must call."""

    name: str


class ResponseFormat(msgspec.Struct, frozen=True):
    """What the answer's text must be: any JSON value (``json_object``), or
    JSON that follows ``schema`` (``json_schema``). Enforced by constrained
    decoding in the runner; a schema it cannot compile fails the request."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None


class ChatOptions(msgspec.Struct, frozen=True):
    """What a chat request adds to its messages: ``tools`` (OpenAI function
    tools, given to the chat template as they are), which of them the model
    may or must call, the answer's format, and extra arguments for the chat
    template (``enable_thinking``, ...)."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceMode | NamedTool = "auto"
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log probability, and the ``top`` alternatives
    asked for (token text, log probability), most likely first.

    A token's text is the UTF-8 of its bytes, but for a token that holds
    part of a character, whose bytes are no text alone: its text shows them
    escaped (``\\xe6\\x97``) and its bytes come in ``bytes`` (and, for the
    alternatives, in ``top_bytes``, one entry per entry of ``top``). None
    there (and the default, as older runners send): the text's UTF-8 is the
    token's bytes."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []
    bytes: list[int] | None = None
    top_bytes: list[list[int] | None] | None = None


class MemoryFigures(msgspec.Struct, frozen=True):
    """A runner's MLX memory: active, cache and peak bytes (0 before mlx)."""

    active_bytes: int = 0
    cache_bytes: int = 0
    peak_bytes: int = 0


class LoadProgress(msgspec.Struct, tag="load_progress"):
    """Runner -> supervisor -> client while a model loads.

    ``phase`` is ``resolve`` (finding/creating the files), ``weights`` (one
    step per transformer layer evaluated) or ``warmup``.
    """

    name: str
    phase: str
    done: int
    total: int
    active_bytes: int
    remaining_bytes: int | None = None  # memory the machine has left (the load guard's view)
    rank: int | None = None  # the rank that sent it, in a distributed group


class TextChunk(msgspec.Struct, tag="chunk"):
    """A piece of generated text; ``generation_tokens`` counts tokens so far.

    ``text`` is the answer's content; ``reasoning`` the model's thinking
    (templates with thinking tags), never mixed into ``text``; ``tool_calls``
    the calls parsed from the model's tool-call text, each whole;
    ``logprobs`` one entry per token of this chunk (when asked for)."""

    request_id: int
    text: str
    generation_tokens: int
    reasoning: str = ""
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprob] | None = None
    # The first frame of a request tells its prompt's size (Anthropic's stream
    # opens with it): its tokens, and those of them the prefix cache gave.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class GenerationDone(msgspec.Struct, tag="done"):
    """The last frame of a successful (or cancelled) generation."""

    request_id: int
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    ttft_s: float
    peak_memory_bytes: int
    finish_reason: FinishReason
    max_tokens_clamped_to: int | None = None  # the request asked for more than the model's cap
    detail: str | None = None  # why it ended early (memory_pressure: the numbers)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed
    batched: bool = False  # served in a batch beside other requests (for part of it at least)
    reasoning_tokens: int = 0  # of generation_tokens, those the model spent thinking
    # tool-call text the model broke or cut short (it is not passed off as content)
    invalid_tool_call: str | None = None
    stop_string: str | None = None  # the request's stop string that ended it (finish "stop")
    # Speculative decoding (a model with a draft_model): the draft's tokens the
    # model checked, and those it accepted (0 and 0: served without the draft).
    draft_tokens: int = 0
    draft_accepted: int = 0


class DiskCacheStats(msgspec.Struct, frozen=True):
    """The prefix cache's disk tier: KV blocks kept in files, so that a chat
    comes back warm after its runner's process ends.

    ``entries``, ``bytes``: the blocks in the model's directory (every
    runner of the same model shares them). ``hits``: RAM misses the disk
    served; ``tokens_restored``: the tokens those reads gave back.
    ``rejected``: blocks read but dropped (a checksum, a key or a shape did
    not match; a file was missing or truncated), by reason in
    ``rejected_by``. ``skipped``: blocks not written because the disk was
    nearly full or the write queue was. ``reason``: why the tier is off
    (then the rest is zero)."""

    directory: str | None = None
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    tokens_restored: int = 0
    rejected: int = 0
    rejected_by: dict[str, int] = {}
    written: int = 0
    write_errors: int = 0
    skipped: int = 0
    evictions: int = 0
    pending: int = 0  # blocks queued for the writer thread
    save_s: float = 0.0  # the main thread's time copying blocks out for the writer
    writer_cpu_s: float = 0.0  # the writer thread's CPU time (writes, checksums, index)
    reason: str | None = None


class PrefixCacheStats(msgspec.Struct, frozen=True):
    """A runner's KV prefix cache: what it holds and how it has done."""

    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    tokens_reused: int = 0
    disk: DiskCacheStats | None = None  # None: no disk tier for this model


class NextTurnStats(msgspec.Struct, frozen=True):
    """Chat turns prefilled ahead: after an answer, while the runner is idle,
    the conversation as its next request will start (the answer and the
    template's next user header) goes into the prefix cache."""

    pending: int = 0  # answered chats whose next turn is not prefilled yet
    prefilled: int = 0  # next turns prefilled in full
    tokens: int = 0  # tokens computed ahead (partial ones included)
    dropped: int = 0  # given up: memory pressure, a full queue, an error


class DraftStats(msgspec.Struct, frozen=True):
    """A runner's draft model (speculative decoding): what it is, and how its
    drafts have done since the runner started. ``requests``: those served
    with the draft (the others ran in a batch, or with logits processors);
    ``drafted``: draft tokens the model checked; ``accepted``: of those, the
    ones it kept (``accepted / drafted`` is the acceptance rate)."""

    model: str
    num_draft_tokens: int
    requests: int = 0
    drafted: int = 0
    accepted: int = 0


class EngineStats(msgspec.Struct, frozen=True):
    """A runner's engine: requests in flight and the prefix cache.

    ``batching`` is False (with ``batching_reason``) when the model's caches
    cannot be merged into one batch: its requests then run one at a time.
    """

    active_requests: int = 0
    max_concurrent: int = 1
    queued: int = 0  # received by the runner, waiting for room in the batch
    batching: bool = False
    batching_reason: str | None = None
    prefix_cache: PrefixCacheStats | None = None  # None: switched off for this model
    next_turn: NextTurnStats | None = None  # None: next-turn prefill switched off
    kv_bits: int | None = None  # the KV cache's quantization (None: the model's dtype)
    kv_group_size: int | None = None
    draft: DraftStats | None = None  # None: no draft model (no speculative decoding)
    # LoRA adapters loaded beside the model (references, the config's order; the
    # first serves requests that name none), and how often the engine switched.
    adapters: tuple[str, ...] = ()
    adapter_switches: int = 0


# --- client -> supervisor ----------------------------------------------------


class LoadRequest(msgspec.Struct, tag="load"):
    """Start a runner for ``model`` (repo id, local path or ``builtin:NAME``).

    ``env`` is added to the runner's environment (fault injection in tests,
    MLX knobs for long contexts). ``max_tokens`` caps every request.
    """

    model: str
    name: str | None = None
    max_tokens: int | None = None
    env: dict[str, str] = {}
    restart: RestartStrategy | None = None
    keep_alive_s: float | None = None  # unload after this long idle (0: never)
    pinned: bool | None = None  # never evicted nor expired
    context_tokens: int | None = None  # the context the memory estimate plans for
    max_concurrent: int | None = None  # requests served side by side (1: one at a time)
    prefix_cache: bool | None = None  # keep a KV prefix cache
    ranks: int | None = None  # processes the model is sharded over (mx.distributed)
    hostfile: str | None = None  # or an mlx.launch hostfile: one rank per host
    kv_bits: int | None = None  # quantize the KV cache: 4 or 8 bits
    kv_group_size: int | None = None  # its values per scale and bias: 32, 64 or 128
    draft_model: str | None = None  # a draft for speculative decoding (same tokenizer)
    num_draft_tokens: int | None = None  # tokens the draft proposes per step


class UnloadRequest(msgspec.Struct, tag="unload"):
    name: str


class StatusRequest(msgspec.Struct, tag="status"):
    pass


class GenerateRequest(msgspec.Struct, tag="generate"):
    """Exactly one of ``prompt`` and ``messages`` is set.

    ``sampling_given`` names the sampling fields the client chose; the
    model's configured defaults (its ``temperature``, ``default_max_tokens``,
    ...) fill in the others. None (a client that does not say): a field that
    differs from :class:`SamplingParams`' default counts as chosen."""

    name: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    cache: bool = True  # False: neither use nor fill the prefix cache
    chat: ChatOptions = ChatOptions()
    sampling_given: tuple[str, ...] | None = None
    # A LoRA adapter among the model's (its reference or name); None: the
    # model's default (its first), "": the base model without an adapter.
    adapter: str | None = None


class CacheClearRequest(msgspec.Struct, tag="cache_clear"):
    """Drop a model's prefix cache, both tiers (its runner stays loaded);
    ``disk_only``: only the blocks on disk."""

    name: str
    disk_only: bool = False


class CancelRequest(msgspec.Struct, tag="cancel"):
    """Sent on the connection of a running generate to stop it early."""


class ShutdownRequest(msgspec.Struct, tag="shutdown"):
    """Stop every runner (escalating) and exit the daemon."""


class ReloadRequest(msgspec.Struct, tag="reload"):
    """Read the daemon's config file again and apply it (:class:`ReloadReply`)."""


EmbeddingInput = str | list[int]
"""One input to embed: a text, or token ids taken as they are."""


class EmbedRequest(msgspec.Struct, tag="embed"):
    """Embed each of ``inputs`` (a text, or token ids taken as they are) with
    the embedding model ``name``; answered with :class:`Embeddings`.
    ``dimensions``: keep that many leading dimensions (models whose config
    says they are Matryoshka models only), normalized again when the model
    normalizes. ``truncate``: cut an input over the model's length instead
    of refusing it."""

    name: str
    inputs: list[EmbeddingInput]
    dimensions: int | None = None
    truncate: bool = False


ClientMessage = (
    LoadRequest
    | UnloadRequest
    | StatusRequest
    | GenerateRequest
    | CancelRequest
    | ShutdownRequest
    | CacheClearRequest
    | ReloadRequest
    | EmbedRequest
)

# --- supervisor -> client ----------------------------------------------------


class ExitInfo(msgspec.Struct):
    """How a runner process ended.

    ``signal`` is a name such as ``SIGKILL`` and ``signal_description`` its
    ``strsignal`` text; ``cause`` is the runner's own last word (its exit
    audit) or the supervisor's (a stall, a kill); ``stderr_tail`` holds the
    last lines it wrote to stderr.
    """

    code: int | None
    signal: str | None
    cause: str
    signal_description: str | None = None
    stderr_tail: list[str] = []
    cause_class: CauseClass = "unknown"
    audit: ExitAudit | None = None  # the runner's exit audit, when it wrote one
    # A distributed group: the rank this is about (the first to die), and how
    # every rank ended, in rank order.
    rank: int | None = None
    ranks: list[RankExit] = []


class RankExit(msgspec.Struct):
    """How one rank of a distributed group ended (see :class:`ExitInfo`)."""

    rank: int
    code: int | None
    signal: str | None
    cause: str
    cause_class: CauseClass = "unknown"


class Loaded(msgspec.Struct, tag="loaded"):
    name: str
    model: str
    pid: int
    param_bytes: int
    active_bytes: int
    peak_bytes: int
    load_s: float


class Unloaded(msgspec.Struct, tag="unloaded"):
    """``steps`` lists the escalation steps taken, e.g. ``["shutdown"]``."""

    name: str
    pid: int
    steps: list[str]
    elapsed_s: float
    exit: ExitInfo


class UnkillableRunner(msgspec.Struct):
    """A runner process SIGKILL has not ended (it sleeps uninterruptibly): its
    model is gone, but it holds its memory (``rss_bytes``, as last measured)
    until the kernel lets it die."""

    name: str
    pid: int
    rss_bytes: int | None = None


class SupervisorInfo(msgspec.Struct):
    pid: int
    version: str
    uptime_s: float
    socket: str
    http: str | None = None  # the HTTP front's base URL (None: off, or its port was taken)
    unkillable: list[UnkillableRunner] = []


class SystemInfo(msgspec.Struct):
    """The machine's memory as the daemon sees it (``override_mb`` applied)."""

    memory_total_bytes: int
    memory_available_bytes: int
    pressure_pct: float = 0.0  # share of memory in use
    threshold_pct: float = 0.0  # pressure at which admission stops and guards warn
    override_mb: int | None = None  # OVERRIDE_MEMORY_MB / memory_override_mb
    runners_bytes: int = 0  # what our runners (and the spare) hold


class RunnerInfo(msgspec.Struct):
    name: str
    model: str
    pid: int | None
    state: RunnerState
    rss_bytes: int | None
    started_at: float | None
    restarts: int
    last_exit: ExitInfo | None
    param_bytes: int | None = None
    queue_depth: int = 0  # requests waiting for their turn (not the one being served)
    next_restart_at: float | None = None  # wall-clock time of the next attempt
    failure: str | None = None  # why it is failed (restart budget spent, ...)
    mlx_active_bytes: int | None = None
    mlx_cache_bytes: int | None = None
    mlx_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None  # what admission granted it
    estimate_bytes: int | None = None  # the estimator's figure for it
    pinned: bool = False
    keep_alive_s: float = 0.0  # 0: kept loaded until unloaded
    last_used_at: float | None = None  # wall-clock end of its last request (or load)
    active_requests: int = 0  # being generated now
    max_concurrent: int = 1  # served side by side at most
    batching: bool | None = None  # None until loaded
    batching_reason: str | None = None  # why not, when batching is False
    prefix_cache: PrefixCacheStats | None = None
    next_turn: NextTurnStats | None = None  # chat turns prefilled ahead
    kv_bits: int | None = None  # the KV cache's quantization (None: the model's dtype)
    kv_group_size: int | None = None
    ranks: list[RankInfo] = []  # a distributed group: one per rank, rank 0 first
    draft: DraftStats | None = None  # its draft model and how its drafts did
    adapters: list[str] = []  # its LoRA adapters (the first is the default)
    adapter_switches: int = 0  # times its runner switched adapters between steps


class RankInfo(msgspec.Struct):
    """One rank of a model sharded over several processes."""

    rank: int
    pid: int | None
    host: str
    state: str  # starting, loading, ready, exited
    rss_bytes: int | None = None
    mlx_active_bytes: int | None = None
    mlx_peak_bytes: int | None = None


class SpareInfo(msgspec.Struct):
    """The hot spare: a runner with mlx imported, waiting for a model.

    ``state`` is ``starting``, ``warm`` or ``failed`` (its last starts failed;
    ``failure`` says why, and it is retried with backoff)."""

    pid: int | None
    warm: bool  # mlx and mlx_lm are imported
    rss_bytes: int | None
    state: Literal["starting", "warm", "failed"] = "starting"
    failure: str | None = None


class StatusReply(msgspec.Struct, tag="status_reply"):
    supervisor: SupervisorInfo
    system: SystemInfo
    runners: list[RunnerInfo]
    spare: SpareInfo | None = None
    counters: dict[str, int] = {}  # restarts, retries, stalls killed, ... since start


class ShutdownAck(msgspec.Struct, tag="shutdown_ack"):
    runners: int


class ModelChange(msgspec.Struct):
    """What a reload changed in one configured model: the keys that apply to
    its next request at once (``now``: sampling defaults, system prompt,
    aliases, keep-alive, pin, restart strategy), and those that wait for its
    next load (``next_load``: what shapes its runner, as kv_bits, the model
    reference, context_tokens, max_tokens, max_concurrent, env). A model not
    loaded (``loaded`` false) takes every change at its next load, which is
    its next request's: all its keys are in ``now``."""

    name: str
    loaded: bool
    now: list[str] = []
    next_load: list[str] = []


class ReloadReply(msgspec.Struct, tag="reload_reply"):
    """The outcome of a reload of the config file at ``path``.

    Refused (``ok`` false): ``error`` says why and ``key`` names the key at
    fault when there is one (``models[1].temperature``); nothing changed.
    Applied: ``added`` models may be used now (``preloading``: those loading
    because of ``preload``); ``removed`` ones take no new request, and are
    ``unloaded`` at once when idle, else (``unloading``) once their requests
    end; ``changed`` says per model which keys apply now and which at its
    next load. Daemon-level keys that changed: ``daemon_now`` (applied),
    ``daemon_next_load`` (each model's next load takes them) and
    ``needs_restart`` (not applied: the socket, the HTTP front, ...)."""

    ok: bool
    path: str | None = None
    error: str | None = None
    key: str | None = None
    added: list[str] = []
    preloading: list[str] = []
    removed: list[str] = []
    unloaded: list[str] = []
    unloading: list[str] = []
    changed: list[ModelChange] = []
    daemon_now: list[str] = []
    daemon_next_load: list[str] = []
    needs_restart: list[str] = []


class CacheCleared(msgspec.Struct, tag="cache_cleared"):
    """Runner -> supervisor -> client: the prefix cache was dropped
    (``entries`` and ``bytes`` in RAM, ``disk_entries`` and ``disk_bytes``
    on disk)."""

    name: str
    entries: int
    bytes: int
    disk_entries: int = 0
    disk_bytes: int = 0


NO_MODEL_LOADED = "no model loaded"
"""A :class:`TokenCount`'s ``error`` from a runner that has no model yet."""

EMBED_CANCELLED = "cancelled"
"""An :class:`Embeddings`' ``error`` for an embed dropped unfinished: cancelled
by the supervisor, or the runner shutting down (the model unloads)."""


class TokenCount(msgspec.Struct, tag="token_count"):
    """Runner -> supervisor: the answer to :class:`CountTokens`; ``error``
    when the template could not render these messages (or
    :data:`NO_MODEL_LOADED`)."""

    request_id: int
    tokens: int
    error: str | None = None


class Embeddings(msgspec.Struct, tag="embeddings"):
    """Runner -> supervisor -> client: the answer to :class:`Embed` (and
    :class:`EmbedRequest`): one vector per input, in order, each as
    little-endian float32 bytes (OpenAI's base64 form is their base64), and
    the tokens the inputs made. ``error``: why there are none;
    ``invalid_request``: the request was at fault (not an embedding model, an
    input too long, ...), not the runner."""

    request_id: int
    vectors: list[bytes] = []
    prompt_tokens: int = 0
    error: str | None = None
    invalid_request: bool = False

    def floats(self) -> list[list[float]]:
        """The vectors as lists of floats."""
        import sys
        from array import array

        out = []
        for vector in self.vectors:
            values = array("f", vector)
            if sys.byteorder == "big":
                values.byteswap()
            out.append(values.tolist())
        return out


class Queued(msgspec.Struct, tag="queued"):
    """A generate waits for its turn: ``position`` 1 is next in line.

    Sent when the request starts waiting and again each time it moves up.
    """

    position: int


ErrorCode = Literal[
    "bad_request",  # the request itself is wrong (fields, names, env)
    "too_large",  # the request (or its reply) is over the frame limit
    "forbidden",  # the peer's uid may not use this daemon
    "unknown_model",
    "already_loaded",
    "load_failed",
    "runner_died",
    "not_ready",  # restarting, stopping or timed out waiting for the model
    "busy",  # the model's queue or the daemon's connections are full
    "insufficient_memory",  # admission refused: the message gives needed and available
    "generation_failed",
    "shutting_down",
    "protocol",  # a malformed frame or handshake
    "internal",  # a bug in the daemon; it logged the traceback and carries on
]


class ErrorReply(msgspec.Struct, tag="error"):
    """A request failed; ``message`` is one line meant for people."""

    code: ErrorCode
    message: str


ServerMessage = (
    LoadProgress
    | Loaded
    | Queued
    | TextChunk
    | GenerationDone
    | Unloaded
    | StatusReply
    | ShutdownAck
    | ErrorReply
    | CacheCleared
    | ReloadReply
    | Embeddings
)

# --- supervisor -> runner ----------------------------------------------------


FAULTS_ENV = "MLX_SUPERVISOR_FAULTS"
"""Environment variable with a runner's fault-injection settings (test tooling)."""


class MemoryPlan(msgspec.Struct, frozen=True):
    """What the supervisor tells a runner about memory, with its LoadModel.

    ``total_bytes`` is the machine as the daemon sees it (an override
    applied); under an override the runner counts ``others_bytes`` (what
    the daemon's other runners hold) as used. ``budget_bytes`` is this
    runner's share; the guards keep ``guard_bytes`` free on the machine.
    """

    total_bytes: int
    override: bool = False
    others_bytes: int = 0
    budget_bytes: int | None = None
    guard_bytes: int = 0  # 0: the guards are off
    threshold_pct: float = 100.0  # pressure at which the generation guard warns
    wired_limit_bytes: int | None = None  # Metal only: this runner's wired limit


class EngineSettings(msgspec.Struct, frozen=True):
    """How a runner serves requests: side by side, and with a prefix cache.

    ``prefix_cache_bytes`` None: a quarter of the memory plan's budget, or
    of the memory available at load without a budget. ``stream_interval_s``:
    a request's text frames go out at most this often (its first token at
    once, its last with the end); 0 sends one frame per token.
    ``batch_wait_share``: requests on an idle engine wait up to this share of
    the prefill they all expect (at most 50 ms) for others to prefill with;
    0 never waits. ``next_turn_prefill``: after a chat answer, while
    idle, prefill the next turn's start into the prefix cache.
    ``prefill_chunk_s``: a prefill step computes as many prompt tokens as
    take about this long at the rate measured on the model. ``kv_bits``:
    the KV cache is quantized to this many bits (4 or 8; None: the model's
    dtype), in groups of ``kv_group_size`` values with a scale and a bias.
    ``prefix_cache_disk_bytes``: the prefix cache's disk tier may hold this
    much in ``prefix_cache_dir`` (0 or no directory: no disk tier).
    """

    max_concurrent: int = 8
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None
    prefix_cache_entries: int = 256
    stream_interval_s: float = 0.025
    batch_wait_share: float = 0.02
    next_turn_prefill: bool = True
    prefill_chunk_s: float = 1.0
    kv_bits: int | None = None
    kv_group_size: int = 64
    prefix_cache_disk_bytes: int = 0
    prefix_cache_dir: str | None = None
    # Speculative decoding: a draft model (a reference, with the model's
    # tokenizer) proposes ``num_draft_tokens`` tokens a step (None: no draft).
    draft_model: str | None = None
    num_draft_tokens: int = 3
    # LoRA adapters (references: directories or builtin:NAME), each applied once
    # at load; a Generate picks one of them (or none) per request.
    adapters: tuple[str, ...] = ()


class Distributed(msgspec.Struct, frozen=True):
    """This runner is rank ``rank`` of an ``mx.distributed`` group.

    ``hosts`` holds the address every rank listens on (``"ip:port"``, in
    rank order). ``hostfile`` is the backend's host file the supervisor
    wrote for a rank on its own machine; a remote rank writes its own from
    ``hosts``. Joining takes at most ``join_timeout_s`` (the backend has no
    timeout of its own).
    """

    rank: int
    hosts: list[str]
    backend: Literal["ring"] = "ring"
    hostfile: str | None = None
    join_timeout_s: float = 60.0

    @property
    def size(self) -> int:
        return len(self.hosts)


class LoadModel(msgspec.Struct, tag="load_model"):
    """Load ``model``. ``faults`` adds fault injection (see runner.faults) to a
    runner that was started without it, such as the hot spare."""

    name: str
    model: str
    max_tokens_cap: int | None = None
    faults: str = ""
    memory: MemoryPlan | None = None
    engine: EngineSettings = EngineSettings()
    distributed: Distributed | None = None  # one rank of a group


class Generate(msgspec.Struct, tag="generate"):
    request_id: int
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    cache: bool = True  # False: neither use nor fill the prefix cache
    chat: ChatOptions = ChatOptions()
    adapter: str | None = None  # one of EngineSettings.adapters (None: the base model)


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: int


class Ping(msgspec.Struct, tag="ping"):
    seq: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = "unload"


class ClearCache(msgspec.Struct, tag="clear_cache"):
    """Drop the prefix cache (``disk_only``: only its disk tier); the runner
    answers :class:`CacheCleared`."""

    disk_only: bool = False


class Environment(msgspec.Struct, tag="environment"):
    """The first frame to a runner on another machine, before any Hello: the
    model's environment variables. ssh would put them in its command line,
    which every user of either machine can read (a token such as HF_TOKEN);
    the runner sets them before it does anything else."""

    env: dict[str, str]


class CountTokens(msgspec.Struct, tag="count_tokens"):
    """How many prompt tokens a generate with these fields would have (chat
    template, tools and all); the runner answers :class:`TokenCount`."""

    request_id: int
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions = ChatOptions()


class Embed(msgspec.Struct, tag="embed"):
    """Embed ``inputs`` (see :class:`EmbedRequest`); the runner answers
    :class:`Embeddings`, computed a batch per turn of its loop."""

    request_id: int
    inputs: list[EmbeddingInput]
    dimensions: int | None = None
    truncate: bool = False


RunnerCommand = (
    LoadModel
    | Generate
    | Cancel
    | Ping
    | Shutdown
    | ClearCache
    | Environment
    | CountTokens
    | Embed
)

# --- runner -> supervisor ----------------------------------------------------


class Started(msgspec.Struct, tag="started"):
    """The runner has imported mlx and mlx_lm and waits for a LoadModel.
    It says what memory its machine has (0: unknown), for a rank on another
    machine than the supervisor's, and its runtime before any model: what
    MLX holds once its device is set up (``memory``) and its own RSS, read
    before it takes any command (a LoadModel may be waiting already)."""

    import_s: float
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    memory: MemoryFigures = MemoryFigures()
    rss_bytes: int = 0


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Progress from the runner's working loop (``phase`` is ``prefill`` or
    ``decode``); load progress and text chunks count as heartbeats too.
    ``step_s``: how long the runner expects its step under way to take (a
    prefill chunk about to start, or the step just done), where it knows;
    the stall watchdog never gives a step less than a multiple of it."""

    phase: str
    progress: int
    memory: MemoryFigures | None = None
    step_s: float | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The model is loaded and evaluated; the runner takes requests."""

    model_path: str
    param_bytes: int
    active_bytes: int
    peak_bytes: int
    load_s: float
    engine: EngineStats = EngineStats()


class LoadFailed(msgspec.Struct, tag="load_failed"):
    error: str


class GenerationFailed(msgspec.Struct, tag="generation_failed"):
    """A request ended in error. ``invalid_request``: the request itself could
    not run (its chat template raised, an empty prompt, a bad setting), as
    opposed to a failure while it ran."""

    request_id: int
    error: str
    invalid_request: bool = False


class Pong(msgspec.Struct, tag="pong"):
    """Answer to a Ping, from the runner's reader thread; ``memory`` holds the
    figures its main thread measured last."""

    seq: int
    memory: MemoryFigures = MemoryFigures()
    engine: EngineStats | None = None  # the main thread's latest, once a model is loaded


class EngineReport(msgspec.Struct, tag="engine_report"):
    """The engine's figures, sent after each request ends and each cache change."""

    engine: EngineStats


class ExitAudit(msgspec.Struct, tag="exit_audit"):
    """Last words of a runner that exits on purpose."""

    cause: str
    active_bytes: int
    peak_bytes: int
    cache_bytes: int = 0
    tokens_served: int = 0  # generated tokens over the runner's life
    requests_served: int = 0
    cause_class: CauseClass | None = None  # memory_guard when its guard stopped a load


RunnerEvent = (
    Started
    | LoadProgress
    | Ready
    | LoadFailed
    | Heartbeat
    | TextChunk
    | GenerationDone
    | GenerationFailed
    | Pong
    | ExitAudit
    | EngineReport
    | CacheCleared
    | TokenCount
    | Embeddings
)
