"""The daemon's configuration: a TOML file decoded into msgspec Structs.

Every key has a default; an unknown key is an error that names it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.framing import DEFAULT_MAX_FRAME_BYTES
from ipc.messages import RestartStrategy
from modelfiles.cache import cache_root
from supervisor.adapters import adapter_list, adapters_problem
from supervisor.netaddr import is_loopback
from supervisor.runners.placement import group_places, is_group
from supervisor.security import env_problem, model_name_problem, model_reference_problem

# Ranges checked when the config is decoded; an error names the key and the range.
Seconds = Annotated[float, Meta(gt=0, le=86_400)]
GraceSeconds = Annotated[float, Meta(ge=0, le=3_600)]
Count = Annotated[int, Meta(ge=0, le=1_000_000)]
Positive = Annotated[int, Meta(ge=1, le=1_000_000)]
FrameBytes = Annotated[int, Meta(ge=4096, le=1 << 30)]
Uid = Annotated[int, Meta(ge=0, le=2**32 - 1)]
Bytes = Annotated[int, Meta(ge=0, le=1 << 50)]
Percent = Annotated[float, Meta(gt=0, le=100)]
KeepAliveSeconds = Annotated[float, Meta(ge=0, le=365 * 86_400)]  # 0: forever
ContextTokens = Annotated[int, Meta(ge=1, le=10_000_000)]
Concurrency = Annotated[int, Meta(ge=1, le=256)]
Ranks = Annotated[int, Meta(ge=1, le=16)]
NonEmpty = Annotated[str, Meta(min_length=1)]
AdapterRef = Annotated[str, Meta(min_length=1, max_length=4096)]
# "*", a DNS name or IPv4 address (a final dot allowed), or an IPv6 address (brackets allowed).
HostName = Annotated[
    str,
    Meta(max_length=255,
         pattern=r"^(\*|[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|\[?[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\]?)$"),
]  # fmt: skip


DEFAULT_HTTP_PORT = 11480
"""The HTTP front's port: near Ollama's 11434 (a local model server), and used
by none of the usual peers (Ollama 11434, LM Studio 1234, llama.cpp,
mlx_lm.server and llama-swap 8080, vLLM 8000), so they run side by side."""
DEFAULT_HTTP_LISTEN = f"127.0.0.1:{DEFAULT_HTTP_PORT}"
HTTP_OFF = "off"
HTTP_ENV = "MLX_SUPERVISOR_HTTP"
"""Overrides http_listen (``serve --http`` overrides both)."""
KV_CACHE_DIR_ENV = "MLX_SUPERVISOR_KV_CACHE_DIR"
"""Where the prefix cache's disk tier keeps KV blocks when the config's
prefix_cache_dir is unset (the tests point it at a directory of their own)."""


class ConfigError(Exception):
    """The config file is unreadable or invalid; the message says where, and
    ``key`` names the offending key when there is one (``models[0].temperature``)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


_ERROR_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<field>[^`]*)`")


def error_key(message: str) -> str | None:
    """The key a msgspec validation error is about, from its message:
    ``Expected ... - at `$.models[0].top_p``` gives ``models[0].top_p``; an
    unknown field gives its own path (``models[0].foo``); None when the
    message names no key (a TOML syntax error says its line instead)."""
    match = _ERROR_PATH.match(message)
    path = (match.group("path") or "") if match else ""
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown:
        field = unknown.group("field")
        return f"{path}.{field}" if path else field
    return path or None


def parse_listen(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:11480``) as a host and
    a port, or None for ``off``. Port 0 picks a free port.

    Raises:
        ValueError: not ``off`` nor ``HOST:PORT`` with a port in 0-65535.
    """
    if value == HTTP_OFF:
        return None
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {host!r} is no IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"{value!r}: write an IPv6 host in brackets, as [::1]:{DEFAULT_HTTP_PORT}")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{value!r} is not {HTTP_OFF!r} nor HOST:PORT with a port in 0-65535")
    return host, int(port_text)


def exposure_problem(config: SupervisorConfig) -> str | None:
    """Why ``config`` would let anyone who reaches the HTTP front use it, or
    None: beyond loopback the front needs an ``api_key`` (whoever reaches it
    could run generations and load models, any model path with
    ``load_on_demand = "any"``)."""
    listen = parse_listen(config.http_listen)
    if config.api_key is not None or listen is None or is_loopback(listen[0]):
        return None
    reach = "load any model path on this machine" if config.load_on_demand == "any" else (
        "run generations and load models"
    )  # fmt: skip
    return (
        f"anyone who reaches {config.http_listen} could {reach}: set api_key, "
        "or listen on loopback only"
    )


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings for one model, applied whenever a model of this name loads."""

    name: str  # checked by security.model_name_problem
    model: Annotated[str, Meta(min_length=1, max_length=4096)]
    max_tokens: Positive | None = None  # cap on every request's max_tokens
    env: dict[str, str] = {}  # added to the runner's environment
    preload: bool = False  # load when the daemon starts
    restart: RestartStrategy | None = None  # default: the daemon's restart setting
    pinned: bool = False  # never evicted to make room, never expired
    keep_alive_s: KeepAliveSeconds | None = None  # idle this long: unloaded (default: daemon's)
    context_tokens: ContextTokens | None = None  # what the estimate plans the KV cache for
    max_concurrent: Concurrency | None = None  # requests served side by side (default: daemon's)
    prefix_cache: bool | None = None  # keep a KV prefix cache (default: daemon's)
    prefix_cache_bytes: Bytes | None = None  # its budget (default: 25% of the memory budget)
    prefix_cache_disk_bytes: Bytes | None = None  # its disk tier's budget (default: daemon's)
    next_turn_prefill: bool | None = None  # prefill chats' next turns (default: daemon's)
    # Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache), in
    # groups of kv_group_size values with a scale and a bias each; None: the
    # model's dtype. 4-bit at group 64 can ruin a small model's answers (see the shipped config).
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    # Shard the model over this many processes on this machine with
    # mx.distributed (tensor parallel where the architecture has ``shard``,
    # else pipeline); they are supervised as one unit.
    ranks: Ranks | None = None
    # Or over several machines: an mlx.launch hostfile (JSON: one
    # {"ssh": HOST, "ips": [IP]} per rank); local hosts are spawned here,
    # the others through ssh_command.
    hostfile: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    distributed_backend: Literal["ring"] = "ring"
    # Speculative decoding: a smaller model with the same tokenizer (a
    # reference like ``model``) drafts num_draft_tokens tokens a step, which
    # the model checks in one forward pass; a request served alone uses it.
    draft_model: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    num_draft_tokens: Annotated[int, Meta(ge=1, le=32)] = 3
    # LoRA adapters (directories as mlx_lm.load's adapter_path, or builtin:NAME):
    # one or a list, each loaded once beside the model; the first serves the
    # requests that name none, and a request may name another (see supervisor.adapters).
    adapters: AdapterRef | list[AdapterRef] = []
    # More names for this model: a request, a load or an unload may use any of
    # them; each is checked as a name, and no name or alias may repeat.
    aliases: list[str] = []
    # Defaults for requests that do not set their own (None: the API's own
    # default); a reload applies them to the next request at once.
    temperature: Annotated[float, Meta(ge=0, le=100)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None  # 0: off
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=10)] | None = None  # 1: off
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    # A fixed seed makes sampled answers repeatable; a seeded request is
    # served alone, not batched with others.
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    default_max_tokens: Positive | None = None  # a request's length when it gives none
    # Prepended as a system message to a chat whose messages have none (never
    # to a raw prompt).
    system_prompt: Annotated[str, Meta(min_length=1, max_length=100_000)] | None = None

    @property
    def names(self) -> list[str]:
        """The model's name, then its aliases."""
        return [self.name, *self.aliases]


SAMPLING_DEFAULTS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed",
)  # fmt: skip
"""The sampling parameters a model's config may give defaults for (besides
``default_max_tokens``), named as in :class:`ipc.messages.SamplingParams`."""


def spec_problem(spec: ModelConfig, *, places: bool = True) -> str | None:
    """Why ``spec`` may not be supervised, or None: a bad name, model reference
    or runner environment (see ``supervisor.security``), or (``places``) a
    hostfile that cannot place its ranks. The one check of a model's spec,
    wherever it comes from: the config file, a load request, a load on demand,
    the state file. A quantized KV cache (``kv_bits``) is refused in a
    distributed group for now: its load probe would run collectives, untested."""
    problem = (
        model_name_problem(spec.name)
        or model_reference_problem(spec.model)
        or env_problem(spec.env)
    )
    if problem:
        return problem
    for alias in spec.aliases:
        problem = model_name_problem(alias)
        if problem:
            return f"aliases: {problem}"
    if spec.name in spec.aliases or len(set(spec.aliases)) < len(spec.aliases):
        return "aliases: a name or alias repeats"
    if spec.kv_bits is not None and is_group(spec):
        return "kv_bits with a distributed group (ranks, hostfile): not yet"
    problem = adapters_problem(spec.adapters)
    if problem:
        return problem
    if adapter_list(spec.adapters) and is_group(spec):
        return "adapters with a distributed group (ranks, hostfile): not yet"
    if spec.draft_model is not None:
        problem = model_reference_problem(spec.draft_model)
        if problem:
            return f"draft_model: {problem}"
        if is_group(spec):
            return "draft_model with a distributed group (ranks, hostfile): not yet"
    if not places:
        return None
    try:
        group_places(spec)
    except ValueError as exc:
        return str(exc)
    return None


class SupervisorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings of the daemon; see configs/mlx-supervisor.toml for each key."""

    socket_path: str | None = None
    # unload and shutdown escalation
    shutdown_grace_s: GraceSeconds = 5.0
    term_grace_s: GraceSeconds = 3.0
    # SIGKILL not done after this long: the process sleeps uninterruptibly (a
    # hung disk, a wedged driver); it is reported unkillable and nothing waits on it
    sigkill_wait_s: Seconds = 10.0
    handshake_timeout_s: Seconds = 30.0
    max_frame_bytes: FrameBytes = DEFAULT_MAX_FRAME_BYTES
    runner_stderr_lines: Count = 20
    # restart policy (OTP-style restart intensity)
    restart: RestartStrategy = "always"
    max_restarts: Count = 5
    restart_window_s: Seconds = 60.0
    restart_backoff_s: GraceSeconds = 0.5
    restart_backoff_cap_s: GraceSeconds = 30.0
    retry_unstarted: bool = True
    queue_timeout_s: Seconds = 300.0
    # stall watchdog: no progress for this long in a phase means hung; a
    # runner that answers no ping for ping_timeout_s is hung in any phase
    load_stall_s: Seconds = 300.0
    group_join_s: Seconds = 60.0  # a rank joining its mx.distributed group (no pings answered)
    # Ranks on other machines (a model's hostfile): how to reach them, and the
    # first port their ring listens on (rank r: base + r), as mlx.launch does.
    ssh_command: Annotated[list[NonEmpty], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=10"]
    )
    distributed_port_base: Annotated[int, Meta(ge=1024, le=65000)] = 32323
    # A step the runner announces as long (a prefill chunk, a slow decode step)
    # gets STALL_STEP_MULTIPLE times its stated time when that is longer.
    prefill_stall_s: Seconds = 120.0
    decode_stall_s: Seconds = 30.0
    ping_timeout_s: Annotated[float, Meta(ge=0.2, le=86_400)] = 10.0
    stall_kill_grace_s: GraceSeconds = 0.5
    # clients: who may connect and how much load the daemon takes
    allowed_uids: list[Uid] = []  # besides the daemon's own uid
    max_connections: Positive = 256
    max_queue: Count = 64  # waiting requests per model; past it, error busy
    client_idle_timeout_s: Seconds = 10.0  # to send a request (HTTP: each head, then body)
    client_write_timeout_s: Seconds = 10.0  # a client that reads nothing this long is gone
    # the OpenAI-compatible HTTP front (README: "Using it from OpenAI clients")
    http_listen: str = DEFAULT_HTTP_LISTEN  # HOST:PORT, or "off"; checked by parse_listen
    api_key: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None  # Bearer token
    # The management API's key (/admin/*): when set, only it opens those routes
    # (api_key does not); unset: they take api_key like every other route.
    admin_api_key: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    load_on_demand: bool | Literal["any"] = True  # configured models; "any": any reference
    # Web pages (origins) whose scripts may call the HTTP front, as Ollama's OLLAMA_ORIGINS:
    # none by default; ["http://localhost:3000"] for a chat UI served there, ["*"] for any.
    http_cors_origins: list[Annotated[str, Meta(min_length=1, max_length=2048)]] = []
    # Host names (or addresses) the Host header may name besides loopback and the listen
    # address, without a port: a page whose name was rebound to us names its own (DNS
    # rebinding). ["mybox.lan"] to serve a LAN name; ["*"]: any (the check is off).
    http_allowed_hosts: list[HostName] = []
    # Images in chats (README: "Images"): http(s) image URLs are fetched by the daemon only
    # when this is on (data URLs and base64 always work), and only from global addresses
    # unless allow_private_image_hosts (loopback, LAN, link-local: a test's or a lab's own
    # server). One image at most max_image_bytes (default: 10 MiB, less where
    # max_frame_bytes leaves less; never over max_frame_bytes), at most
    # max_images_per_request of them.
    allow_remote_images: bool = False
    allow_private_image_hosts: bool = False
    max_image_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] | None = None
    max_images_per_request: Annotated[int, Meta(ge=1, le=1024)] = 16
    # memory safety (README: "Memory"); sizes in bytes
    memory_poll_s: Annotated[float, Meta(ge=0.05, le=3_600)] = 1.0
    memory_override_mb: Annotated[int, Meta(ge=64, le=1 << 30)] | None = None
    pressure_threshold_pct: Percent | None = None  # default by machine size: 70-85%
    memory_guard_bytes: Bytes | None = None  # free memory the guards keep; default max(10%, 5 GiB)
    memory_headroom_bytes: Bytes | None = None  # added to an estimate; default 10% of the model
    memory_gate_timeout_s: GraceSeconds = 10.0  # wait this long for a dead runner's memory
    max_loaded_models: Count = 0  # 0: no cap; else evict the least recently used idle model
    keep_alive_s: KeepAliveSeconds = 0.0  # idle models unloaded after this long (0: never)
    max_tokens: Positive = 4096  # hard cap on any request's max_tokens (per model: max_tokens)
    # the runner's engine (README: "Serving many requests")
    max_concurrent: Concurrency = 8  # requests a model serves side by side (1: one at a time)
    prefix_cache: bool = True  # reuse the KV cache of earlier requests' shared prefixes
    prefix_cache_entries: Positive = 256  # sequences a runner's prefix cache keeps at most
    # The prefix cache's disk tier: KV blocks kept in files, so that a chat comes
    # back warm after its runner ends (an unload, a crash, a restart); at most
    # this many bytes per model (0: no disk tier; per model:
    # prefix_cache_disk_bytes), under prefix_cache_dir (see kv_cache_dir).
    prefix_cache_disk_bytes: Bytes = 4 << 30
    prefix_cache_dir: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    stream_interval_ms: Annotated[int, Meta(ge=0, le=1_000)] = 25  # text frames at most this often
    # Requests on an idle model wait, from the first one's arrival, up to this
    # share of the prefill they all expect (at most 50 ms; 10 ms before a
    # runner's first prefill) for others to prefill with (vLLM's scheduler
    # delay factor, as a share); a full batch starts at once; 0: never waits.
    batch_wait_share: Annotated[float, Meta(ge=0, le=0.5)] = 0.02
    # After a chat answer, while the model is idle, prefill the start of the
    # chat's next request (the answer as the history will hold it, and the
    # template's next user header) into the prefix cache.
    next_turn_prefill: bool = True
    # Prompts are prefilled in steps of about this long at the rate measured
    # on the model (at most mlx-lm's 2,048 tokens): progress, cancels and
    # other requests' tokens come between steps, and no GPU command stream runs long.
    prefill_chunk_s: Annotated[float, Meta(ge=0.05, le=60)] = 1.0
    # process management
    hot_spare: bool = True
    # The BLAS a local runner's mlx uses on a Linux CPU: "auto" (OpenBLAS where
    # mlx-cpu bundles the reference BLAS and OpenBLAS is installed), "bundled",
    # or the absolute path of a library to preload (supervisor.runners.blas).
    cpu_blas: Annotated[str, Meta(pattern=r"^(auto|bundled|/.+)$", max_length=4096)] = "auto"
    restore_on_start: bool = True
    models: list[ModelConfig] = []

    @property
    def ping_interval_s(self) -> float:
        """How often an idle runner is pinged: a few pings fit in the timeout."""
        return self.ping_timeout_s / 4

    def model_config(self, name: str) -> ModelConfig | None:
        """The configured settings for the model called ``name`` (its name or
        one of its aliases), if any."""
        return next((m for m in self.models if m.name == name), None) or next(
            (m for m in self.models if name in m.aliases), None
        )


def kv_cache_dir(config: SupervisorConfig) -> Path:
    """Where the prefix cache's disk tier keeps its blocks: the config's
    ``prefix_cache_dir``, else $MLX_SUPERVISOR_KV_CACHE_DIR (``~`` expanded in
    either), else ``kv`` in the per-user cache (``modelfiles.cache.cache_root``)."""
    if config.prefix_cache_dir is not None:
        return Path(config.prefix_cache_dir).expanduser()
    from_env = os.environ.get(KV_CACHE_DIR_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return cache_root() / "kv"


def with_http_override(config: SupervisorConfig, flag: str | None) -> SupervisorConfig:
    """``config`` with http_listen from ``serve --http`` (``flag``), else from
    $MLX_SUPERVISOR_HTTP, when either is given.

    Raises:
        ConfigError: the value is not ``off`` nor ``HOST:PORT``, or it opens
            ``load_on_demand = "any"`` beyond loopback without an api_key.
    """
    source, value = ("--http", flag) if flag is not None else (HTTP_ENV, os.environ.get(HTTP_ENV))
    if not value:
        return config
    try:
        parse_listen(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    replaced = msgspec.structs.replace(config, http_listen=value)
    problem = exposure_problem(replaced)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return replaced


def load_config(path: Path | None) -> SupervisorConfig:
    """Read ``path`` (or return the defaults when it is None).

    Raises:
        ConfigError: the file is missing, not UTF-8, not TOML, or has a bad
            or unknown key.
    """
    if path is None:
        return SupervisorConfig()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        config = msgspec.toml.decode(data, type=SupervisorConfig)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid config {path}: {exc}", error_key(str(exc))) from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"invalid config {path}: not UTF-8 (byte {exc.start}: "
                          f"{exc.reason})") from exc  # fmt: skip
    for index, model in enumerate(config.models):
        problem = spec_problem(model) or max_tokens_problem(model, config)
        if problem:
            field = problem.partition(":")[0]  # "aliases: ..." is about that key
            key = f"models[{index}]" + (f".{field}" if field in ModelConfig.__struct_fields__
                                        else "")  # fmt: skip
            raise ConfigError(f"invalid config {path}: [[models]] {model.name!r}: {problem}", key)
    names = [name for m in config.models for name in m.names]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"invalid config {path}: model names or aliases repeated: "
                          f"{', '.join(duplicates)}", "models")  # fmt: skip
    try:
        parse_listen(config.http_listen)
    except ValueError as exc:
        raise ConfigError(f"invalid config {path}: http_listen: {exc}", "http_listen") from None
    problem = exposure_problem(config)
    if problem:
        raise ConfigError(f"invalid config {path}: {problem}", "http_listen")
    if config.max_image_bytes is not None and config.max_image_bytes > config.max_frame_bytes:
        raise ConfigError(f"invalid config {path}: max_image_bytes = {config.max_image_bytes} "
                          f"is over max_frame_bytes = {config.max_frame_bytes}: such an image "
                          "could never reach a runner", "max_image_bytes")  # fmt: skip
    return config


def max_tokens_problem(spec: ModelConfig, config: SupervisorConfig) -> str | None:
    """Why the model's ``default_max_tokens`` is refused (above its cap), or None."""
    cap = spec.max_tokens or config.max_tokens
    if spec.default_max_tokens is not None and spec.default_max_tokens > cap:
        return (f"default_max_tokens: {spec.default_max_tokens} is above the model's cap "
                f"max_tokens = {cap}")  # fmt: skip
    return None
