"""Fuzzing: hostile frames and random bytes against a live daemon and real runners.

Run it as a test (``tests/fuzz/test_fuzz.py``, a few hundred cases in CI) or
alone: ``python tests/fuzz/fuzz_run.py --cases 10000 [--seed S] [--out fuzz.json]``.

Hypothesis draws the cases (a fixed seed makes a run reproducible):

- daemon: random bytes, hostile Hellos, framing faults (frames announcing
  more than the limit, truncated frames, partial headers, nothing at all,
  an idle connection), frames of valid msgpack with unknown tags, missing
  fields and junk values, well-typed requests with hostile values (absurd
  sampling, names that are too long or not printable, refused environments),
  and generations interrupted by junk. Each goes over a real connection to a
  private daemon serving ``builtin:tiny``; the answer must be an ErrorReply
  other than ``internal``, a normal reply or a clean close, within
  ``CASE_BOUND_S``. After each batch the daemon must answer ``status`` and a
  normal generation must work; in quiet states its fd count must be back at
  the start and its RSS must not grow by more than ``RSS_GROWTH_BOUND`` after
  warm-up.
- runner: a fake supervisor feeds a real runner over its pipe pair. Frames it
  cannot decode must end it with EXIT_PROTOCOL; valid but odd commands must
  get an answer (a Ping a Pong, a Generate its GenerationDone or
  GenerationFailed) and leave it serving; nothing may hang.

Legitimate commands that are no faults (Shutdown, an Unload of the fuzzed
model) are never sent to the daemon, and loads that would spawn a runner are
few (``SPAWN_EVERY``) and always of a model that fails at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ipc import Codec, ProtocolError
from ipc.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, FrameSplitter
from ipc.messages import (
    PROTOCOL_VERSION,
    ClientMessage,
    ErrorReply,
    ExitAudit,
    GenerationDone,
    GenerationFailed,
    Hello,
    LoadFailed,
    LoadRequest,
    Pong,
    Ready,
    RunnerCommand,
    RunnerEvent,
    ServerMessage,
    ShutdownRequest,
    Started,
    UnloadRequest,
)
from runner.main import EXIT_LOAD_FAILED, EXIT_ORPHANED, EXIT_PROTOCOL
from supervisor.client import Client, ClientError
from supervisor.daemon.process import DaemonProcess
from supervisor.figures import render_table
from supervisor.registry.registry import derive_name
from supervisor.security import env_problem, model_name_problem
from supervisor.system import process_rss

FRAME_LIMIT = 65536  # the fuzzed daemon's max_frame_bytes: big strings stay cheap
MODEL = "tiny"  # the model the daemon serves throughout
MODEL_MAX_TOKENS = 8  # its per-request cap, so hostile max_tokens stay fast
CASE_BOUND_S = 15.0  # an answer or a close must come within this
RUNNER_START_BOUND_S = 60.0  # spawn -> Started, and LoadModel -> Ready
RUNNER_BOUND_S = 30.0  # any other wait on a runner
QUIET_BOUND_S = 60.0  # after a batch: the model ready and the spare warm again
RSS_GROWTH_BOUND = 5 * 2**20
SPAWN_EVERY = 100  # at most one runner-spawning load per this many daemon cases
SESSION_COMMANDS = 50  # valid-but-odd commands fed to one runner process
MISSING_MODEL = "/nonexistent-fuzz/"  # models under it fail at once, in the runner

DAEMON_CONFIG = f"""
max_frame_bytes = {FRAME_LIMIT}
client_idle_timeout_s = 0.5
client_write_timeout_s = 5.0
queue_timeout_s = 10.0
restart_backoff_s = 0.1
restore_on_start = false
"""

# What a finding is, in the order the report lists them.
FINDINGS = (
    "daemon died",
    "daemon stopped answering status",
    "generation failed afterwards",
    "no answer or close in time",
    "internal error",
    "bad reply frame",
    "served runner died",
    "daemon not quiet after a batch",
    "daemon fd growth",
    "daemon RSS growth",
    "runner hung",
    "runner crashed",
    "runner wrong exit code",
    "runner unclear error",
)

_ENCODER = msgspec.msgpack.Encoder()
_CLIENT_CODEC: Codec[ClientMessage] = Codec(ClientMessage, FRAME_LIMIT)
_SERVER_CODEC: Codec[ServerMessage] = Codec(ServerMessage)
_RUNNER_COMMANDS: Codec[RunnerCommand] = Codec(RunnerCommand)
_RUNNER_EVENTS: Codec[RunnerEvent] = Codec(RunnerEvent)


def frame(message: Any) -> bytes:
    """``message`` (a dict, a Struct or any msgpack value) as one frame."""
    body = _ENCODER.encode(message)
    return HEADER.pack(len(body)) + body


HELLO_PID = os.getpid()  # the pid our Hellos give: the fuzzing process's (see draw_cases)


def hello(role: str = "client") -> bytes:
    return frame(Hello(PROTOCOL_VERSION, HELLO_PID, role))  # type: ignore[arg-type]


# --- values ------------------------------------------------------------------

EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324, 1e-300]
ODD_CHARS = ["\x00", "\x01", "\x7f", "\n", "/", "é", "\u2028", "\u202e", "\ufeff", "\U0001f600"]
ODD_NAMES = ["", " ", "tiny ", "TINY", "a/b", "../tiny", "tiny\x00", "x" * 64, "x" * 65,
             "\u202e", "builtin:tiny", ".", "..", "\n"]  # fmt: skip


def ints() -> st.SearchStrategy[int]:
    """Any int msgpack carries (int64 and uint64 ranges), edges often."""
    return st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())


def long_texts(max_chars: int = FRAME_LIMIT // 4) -> st.SearchStrategy[str]:
    """One character repeated up to ``max_chars`` times (control characters
    included): big strings for little generation time."""
    chars = st.one_of(st.sampled_from(ODD_CHARS), st.characters())
    return st.builds(lambda c, n: c * n, chars, st.integers(0, max_chars))


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=max_size), long_texts())


def names() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_NAMES), st.text(max_size=70), long_texts())


def junk() -> st.SearchStrategy[Any]:
    """Nested msgpack values of any type."""
    scalars = st.one_of(st.none(), st.booleans(), ints(), floats(), texts(), st.binary(max_size=64))
    keys = st.one_of(st.text(max_size=8), ints())
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)
        ),
        max_leaves=8,
    )


def sampling() -> st.SearchStrategy[dict[str, Any]]:
    """SamplingParams with any field absent or absurd."""
    return st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": ints(),
            "temperature": floats(),
            "top_p": floats(),
            "seed": st.one_of(st.none(), ints()),
        },
    )


def chat(max_content: int = 200) -> st.SearchStrategy[list[dict[str, str]]]:
    role = st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), st.text(max_size=12))
    turn = st.fixed_dictionaries({"role": role, "content": st.text(max_size=max_content)})
    return st.lists(turn, max_size=4)


@st.composite
def prompt_fields(draw: st.DrawFn, bounded: bool) -> dict[str, Any]:
    """prompt and/or messages (or neither); ``bounded`` keeps a real model's
    prefill short."""
    prompt = st.text(max_size=300) if bounded else texts(300)
    if bounded:
        prompt = st.one_of(prompt, long_texts(2000))
    which = draw(st.sampled_from(["prompt", "prompt", "messages", "both", "neither"]))
    out: dict[str, Any] = {}
    if which in ("prompt", "both"):
        out["prompt"] = draw(prompt)
    if which in ("messages", "both"):
        out["messages"] = draw(chat())
    return out


# --- daemon cases --------------------------------------------------------------


@dataclass
class Case:
    """What one connection sends, and how it ends.

    ``end``: ``read`` (read the answer to the close), ``shut`` (half-close,
    then read), ``drop`` (close at once) or ``idle`` (send, then wait for the
    daemon's idle timeout to close it). ``after_reply`` is sent once the
    first frame after the daemon's Hello arrived, then ``after_end`` applies.
    """

    kind: str
    chunks: list[bytes]
    end: str = "read"
    after_reply: bytes | None = None
    after_end: str = "read"

    def sent(self) -> bytes:
        return b"".join(self.chunks) + (self.after_reply or b"")


def request_case(request: dict[str, Any]) -> Case:
    return Case("request", [hello(), frame(request)])


@st.composite
def load_request(draw: st.DrawFn) -> dict[str, Any]:
    """A LoadRequest that is refused before any runner starts (a refused
    environment), or one for a model that fails at once in the runner."""
    out: dict[str, Any] = {"type": "load"}
    if draw(st.booleans()):
        env = draw(st.dictionaries(texts(12), texts(12), max_size=2))
        refused = draw(st.sampled_from([
            ("LD_PRELOAD", "/nonexistent"), ("PYTHONPATH", "/tmp"), ("DYLD_INSERT_LIBRARIES", "x"),
            ("1BAD", "x"), ("", "x"), ("A=B", "x"), ("OK", "nul\x00"),
        ]))  # fmt: skip
        out["env"] = {**env, refused[0]: refused[1]}
        out["model"] = draw(texts())
    else:
        out["model"] = draw(
            st.one_of(
                st.builds(lambda t: MISSING_MODEL + t, st.text(max_size=40)),
                st.builds(lambda t: "builtin:fuzz-" + t, st.text(max_size=40)),
            )
        )
    name = draw(st.one_of(st.none(), names(), st.just(MODEL)))
    if name is not None:
        out["name"] = name
    if draw(st.booleans()):
        out["max_tokens"] = draw(st.one_of(st.none(), ints()))
    out["restart"] = draw(st.sampled_from(["never", "never", "on-failure", "always"]))
    return out


@st.composite
def generate_request(draw: st.DrawFn) -> dict[str, Any]:
    to_model = draw(st.booleans())
    name = MODEL if to_model else draw(names())
    out: dict[str, Any] = {"type": "generate", "name": name, **draw(prompt_fields(to_model))}
    if draw(st.integers(0, 3)):
        out["sampling"] = draw(sampling())
    if not draw(st.integers(0, 3)):
        out["cache"] = draw(st.one_of(st.booleans(), junk()))
    return out


def requests() -> st.SearchStrategy[dict[str, Any]]:
    """Client requests of the right shape with hostile values (never a
    Shutdown, never an Unload of the fuzzed model)."""
    extra = st.dictionaries(st.text(max_size=8), junk(), max_size=2)
    return st.one_of(
        generate_request(),
        generate_request(),
        load_request(),
        st.builds(lambda n: {"type": "unload", "name": n}, names().filter(lambda n: n != MODEL)),
        st.builds(lambda e: {**e, "type": "status"}, extra),
        st.builds(lambda e: {**e, "type": "cancel"}, extra),
        st.builds(lambda n, e: {**e, "type": "cache_clear", "name": n}, names(), extra),
    )


CLIENT_SHAPES: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "load": {"model": texts(), "name": names(), "max_tokens": ints(), "env": junk(),
             "restart": st.text(max_size=12)},
    "unload": {"name": names()},
    "status": {},
    "generate": {"name": names(), "prompt": texts(), "messages": chat(),
                 "sampling": sampling()},
    "cancel": {},
    "hello": {"protocol_version": ints(), "pid": ints(), "role": st.text(max_size=12),
              "software_version": texts()},
}  # fmt: skip
FOREIGN_TAGS = ["error", "chunk", "done", "status_reply", "queued", "load_model", "ping", "pong",
                "shutdown_ack", "LOAD", "", "generate "]  # fmt: skip


@st.composite
def junk_message(
    draw: st.DrawFn, shapes: dict[str, dict[str, st.SearchStrategy[Any]]], foreign: list[str]
) -> Any:
    """A msgpack map with a known or unknown ``type`` tag whose fields are
    each right, junk or missing, plus unknown fields; sometimes no map at all."""
    if not draw(st.integers(0, 9)):
        return draw(junk())
    tag: Any = draw(st.one_of(st.sampled_from([*shapes, *foreign]), junk()))
    out: dict[Any, Any] = {} if not draw(st.integers(0, 9)) else {"type": tag}
    for name, good in shapes.get(tag, {}).items() if isinstance(tag, str) else ():
        how = draw(st.sampled_from(["good", "good", "junk", "missing"]))
        if how != "missing":
            out[name] = draw(good if how == "good" else junk())
    out.update(draw(st.dictionaries(st.one_of(st.text(max_size=8), ints()), junk(), max_size=2)))
    return out


@st.composite
def hostile_hello(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "hello"}
    fields = {
        "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), ints(), junk()),
        "pid": st.one_of(ints(), junk()),
        "role": st.one_of(st.sampled_from(["client", "supervisor", "runner"]), texts(), junk()),
        "software_version": st.one_of(texts(), junk()),
    }
    for name, values in fields.items():
        if draw(st.integers(0, 5)):
            out[name] = draw(values)
    return out


FRAMINGS = [
    *("oversize", "truncated", "partial_header", "nothing", "empty_frame", "two_requests"),
    *("split", "hello_only", "idle", "no_hello", "drop_mid_generate", "announce_more"),
]


@st.composite
def framing_case(draw: st.DrawFn, how: str | None = None) -> Case:
    """Well-formed bodies in broken framing."""
    how = how or draw(st.sampled_from(FRAMINGS))
    status = frame({"type": "status"})
    generate = frame({"type": "generate", "name": MODEL, "prompt": "framing"})
    if how == "oversize":
        length = draw(st.integers(FRAME_LIMIT + 1, 2**32 - 1))
        return Case("framing", [hello(), HEADER.pack(length) + draw(st.binary(max_size=64))])
    if how == "truncated":
        cut = draw(st.integers(1, len(generate) - 1))
        return Case("framing", [hello(), generate[:cut]], end="shut")
    if how == "partial_header":
        return Case("framing", [hello(), draw(st.binary(min_size=1, max_size=3))], end="shut")
    if how == "nothing":
        return Case("framing", [], end=draw(st.sampled_from(["shut", "drop"])))
    if how == "empty_frame":
        return Case("framing", [hello(), HEADER.pack(0)])
    if how == "two_requests":
        return Case("framing", [hello(), status + status])
    if how == "split":
        data = hello() + status
        return Case("framing", [data[i : i + 1] for i in range(len(data))])
    if how == "hello_only":
        return Case("framing", [hello()], end="shut")
    if how == "idle":
        return Case("framing", [hello(), status[: draw(st.integers(0, len(status) - 1))]], "idle")
    if how == "no_hello":
        return Case("framing", [status])
    if how == "drop_mid_generate":
        return Case("framing", [hello(), generate], end="drop")
    # announce_more: a length under the limit, fewer bytes, then the half-close
    length = draw(st.integers(1, FRAME_LIMIT))
    body = draw(st.binary(max_size=min(length - 1, 256)))
    return Case("framing", [hello(), HEADER.pack(length) + body], end="shut")


DAEMON_KINDS = [
    *("raw", "raw", "hello", "framing", "framing", "frame", "frame", "frame"),
    *("request", "request", "request", "midstream"),
]


@st.composite
def daemon_case(draw: st.DrawFn) -> Case:
    """One hostile connection to the daemon."""
    kind = draw(st.sampled_from(DAEMON_KINDS))
    if kind == "raw":
        prefix = [hello()] if draw(st.booleans()) else []
        data = draw(st.binary(max_size=2048))
        return Case(
            "raw", [*prefix, data], end=draw(st.sampled_from(["shut", "shut", "drop", "idle"]))
        )
    if kind == "hello":
        return Case("hello", [frame(draw(hostile_hello())), frame({"type": "status"})])
    if kind == "framing":
        return draw(framing_case())
    if kind == "frame":
        message = draw(junk_message(CLIENT_SHAPES, FOREIGN_TAGS))
        return Case("frame", [hello(), frame(message)])
    if kind == "request":
        return request_case(draw(requests()))
    # midstream: a generation, then junk (or a cancel, or a second request) on its connection
    generate = frame({"type": "generate", "name": MODEL, "prompt": draw(st.text(max_size=60))})
    after = draw(st.one_of(
        st.just(frame({"type": "cancel"})),
        st.just(frame({"type": "status"})),
        st.builds(frame, junk_message(CLIENT_SHAPES, FOREIGN_TAGS)),
        st.binary(max_size=64),
        st.builds(HEADER.pack, st.integers(FRAME_LIMIT + 1, 2**32 - 1)),
    ))  # fmt: skip
    end = draw(st.sampled_from(["read", "shut", "drop"]))
    return Case("midstream", [hello(), generate], after_reply=after, after_end=end)


def explicit_daemon_cases() -> list[Case]:
    """One of each framing fault the issue names, always run first."""
    return [
        Case("framing", [hello(), HEADER.pack(FRAME_LIMIT + 1) + b"x"]),
        Case("framing", [hello(), HEADER.pack(2**32 - 1)]),
        Case("framing", [hello(), frame({"type": "status"})[:-1]], end="shut"),
        Case("framing", [hello(), b"\x00\x00"], end="shut"),
        Case("framing", [], end="shut"),
        Case("framing", [], end="drop"),
        Case("framing", [hello()[:5]], end="drop"),
        Case("framing", [hello(), HEADER.pack(0)]),
        Case("raw", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"], end="shut"),
        Case(
            "hello",
            [
                frame({"type": "hello", "protocol_version": 999, "pid": 1, "role": "client"}),
                frame({"type": "status"}),
            ],
        ),
        Case("hello", [hello("runner"), frame({"type": "status"})]),
        Case("hello", [hello("supervisor"), frame({"type": "status"})]),
        Case("frame", [hello(), frame({"type": "no_such_message"})]),
        Case("frame", [hello(), frame({"type": "pong", "seq": 1, "active_bytes": 0})]),
        Case("frame", [hello(), frame({"type": "generate"})]),
        Case("framing", [hello(), frame({"type": "status"})[:7]], end="idle"),
    ]


def would_spawn(message: LoadRequest) -> bool:
    """The daemon would start (or adopt) a runner for this load."""
    name = message.name or derive_name(message.model)
    return not (model_name_problem(name) or env_problem(message.env) or name == MODEL)


def fails_at_once(message: LoadRequest) -> bool:
    """Its model fails in the runner before anything is read or fetched."""
    return message.model.startswith((MISSING_MODEL, "builtin:fuzz-"))


def decoded_requests(case: Case) -> Iterator[ClientMessage]:
    """Every client request a daemon could decode from what the case sends."""
    splitter = FrameSplitter(DEFAULT_MAX_FRAME_BYTES)
    with contextlib.suppress(ProtocolError):
        for body in splitter.feed(case.sent()):
            with contextlib.suppress(ProtocolError):
                yield _CLIENT_CODEC.decode(body)


def legit_command(case: Case) -> bool:
    """The case holds a command that is no fault: a Shutdown, an Unload of
    the fuzzed model, or a load that would really start a model."""
    for message in decoded_requests(case):
        if isinstance(message, ShutdownRequest):
            return True
        if isinstance(message, UnloadRequest) and message.name == MODEL:
            return True
        if isinstance(message, LoadRequest) and would_spawn(message) and not fails_at_once(message):
            return True
    return False


def budget_spawns(cases: list[Case]) -> list[Case]:
    """Keep at most one runner-spawning load per SPAWN_EVERY cases; the others
    get a refused environment entry (so they are still hostile loads)."""
    allowed = max(1, len(cases) // SPAWN_EVERY)
    out = []
    for case in cases:
        loads = [m for m in decoded_requests(case) if isinstance(m, LoadRequest)]
        if any(would_spawn(m) for m in loads):
            if allowed > 0 and case.kind == "request":
                allowed -= 1
            else:
                request = msgspec.structs.asdict(loads[0]) | {"type": "load"}
                request["env"] = {**loads[0].env, "LD_PRELOAD": "/nonexistent"}
                case = request_case(request)
        out.append(case)
    return out


def draw_examples(strategy: st.SearchStrategy[Any], count: int, seed: int) -> list[Any]:
    """``count`` examples of ``strategy``, the same ones for the same seed."""
    drawn: list[Any] = []
    attempt = 0
    while len(drawn) < count:

        @hypothesis_seed(seed + attempt)
        @settings(
            max_examples=count - len(drawn),
            database=None,
            derandomize=False,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def collect(example: Any) -> None:
            drawn.append(example)

        collect()
        attempt += 1
    return drawn[:count]


def draw_cases(target: str, count: int, seed: int) -> list[Any]:
    """``count`` cases for ``target`` (``daemon``: Case, ``runner``:
    RunnerCase), drawn in a fresh process of this script.

    Hypothesis mixes in constants from the source of every local module
    loaded when it draws, so drawing inside a test session would depend on
    which tests it collected; a fresh process loads the same modules every
    time. The same seed and the same code give the same cases.
    """
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-fuzz-") as tmp:
        out = Path(tmp) / "cases.msgpack"
        command = [
            *(sys.executable, __file__, "--draw", target, "--cases", str(count)),
            *("--seed", str(seed), "--hello-pid", str(HELLO_PID), "--draw-out", str(out)),
        ]
        subprocess.run(command, check=True, timeout=1800, stdout=subprocess.DEVNULL)
        data = out.read_bytes()
    return msgspec.msgpack.decode(data, type=list[Case] if target == "daemon" else list[RunnerCase])


def draw_daemon_cases(count: int, seed: int) -> list[Case]:
    """The explicit cases, then hostile ones drawn by hypothesis."""
    explicit = explicit_daemon_cases()[:count]
    drawn = draw_examples(
        daemon_case().filter(lambda c: not legit_command(c)), count - len(explicit), seed
    )
    return budget_spawns(explicit + drawn)


# --- runner cases ----------------------------------------------------------------


@dataclass
class RunnerCase:
    """Bytes for a runner's command pipe.

    ``kind`` ``command`` (valid but odd: the runner must answer and keep
    serving) carries ``request_id`` for a Generate (its GenerationDone or
    GenerationFailed is awaited). Any other kind ends the runner: ``exit_code``
    is the code it must exit with (None: any clean code), after ``close``
    (our end of the pipe closed after the bytes) where set.
    """

    kind: str
    data: bytes
    request_id: int | None = None
    exit_code: int | None = None
    close: bool = False


RUNNER_SHAPES: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "load_model": {"name": texts(), "model": texts(), "max_tokens_cap": ints(),
                   "faults": st.text(max_size=20)},
    "generate": {"request_id": ints(), "prompt": texts(), "messages": chat(),
                 "sampling": sampling()},
    "cancel": {"request_id": ints()},
    "ping": {"seq": ints()},
    "shutdown": {"reason": texts()},
    "hello": CLIENT_SHAPES["hello"],
}  # fmt: skip
RUNNER_FOREIGN = ["started", "ready", "pong", "status", "load", "", "Generate"]


def runner_decodes(data: bytes) -> bool:
    """The first frame of ``data`` is a RunnerCommand the runner accepts."""
    try:
        bodies = FrameSplitter(DEFAULT_MAX_FRAME_BYTES).feed(data)
        _RUNNER_COMMANDS.decode(bodies[0])
    except (ProtocolError, IndexError):
        return False
    return True


def valid_supervisor_hello(data: bytes) -> bool:
    try:
        bodies = FrameSplitter(DEFAULT_MAX_FRAME_BYTES).feed(data)
        _RUNNER_COMMANDS.decode_hello(bodies[0], "supervisor")
    except (ProtocolError, IndexError):
        return False
    return True


@st.composite
def runner_command(draw: st.DrawFn) -> RunnerCase:
    """A command the runner decodes, with odd values: it must answer it."""
    which = draw(st.sampled_from(["generate", "generate", "generate_cancel", "cancel", "ping"]))
    extra = draw(st.dictionaries(st.text(max_size=8), junk(), max_size=1))
    request_id = draw(ints())
    if which == "cancel":
        return RunnerCase("command", frame({**extra, "type": "cancel", "request_id": request_id}))
    if which == "ping":
        return RunnerCase("command", frame({**extra, "type": "ping", "seq": request_id}))
    generate = {**extra, "type": "generate", "request_id": request_id,
                **draw(prompt_fields(bounded=True))}  # fmt: skip
    if draw(st.integers(0, 3)):
        generate["sampling"] = draw(sampling())
    data = frame(generate)
    if which == "generate_cancel":
        data += frame({"type": "cancel", "request_id": request_id})
    return RunnerCase("command", data, request_id=request_id)


def runner_exit_code(data: bytes) -> int | None:
    """The code a runner must exit with after reading ``data`` and then EOF:
    EXIT_PROTOCOL for an undecodable or truncated frame, EXIT_ORPHANED for
    nothing; None when a valid command comes first."""
    try:
        bodies = FrameSplitter(DEFAULT_MAX_FRAME_BYTES).feed(data)
    except ProtocolError:
        return EXIT_PROTOCOL
    if bodies:
        return None if runner_decodes(data) else EXIT_PROTOCOL
    return EXIT_PROTOCOL if data else EXIT_ORPHANED


@st.composite
def runner_ender(draw: st.DrawFn) -> RunnerCase:
    """Something that must end a runner, with the exit code it must give."""
    how = draw(st.sampled_from(["undecodable", "undecodable", "raw", "hello", "truncated",
                                "oversize", "eof", "shutdown", "load_missing"]))  # fmt: skip
    if how == "undecodable":
        data = frame(draw(junk_message(RUNNER_SHAPES, RUNNER_FOREIGN)))
        return RunnerCase(how, data, exit_code=runner_exit_code(data), close=True)
    if how == "raw":
        data = draw(st.binary(min_size=1, max_size=512))
        return RunnerCase(how, data, exit_code=runner_exit_code(data), close=True)
    if how == "hello":  # sent in place of the supervisor's Hello
        data = draw(st.one_of(st.builds(frame, hostile_hello()), st.binary(max_size=64)))
        code = None if valid_supervisor_hello(data) else EXIT_PROTOCOL
        return RunnerCase(how, data, exit_code=code, close=True)
    if how == "truncated":
        ping = frame({"type": "ping", "seq": draw(ints())})
        return RunnerCase(how, ping[: draw(st.integers(1, len(ping) - 1))], exit_code=EXIT_PROTOCOL,
                          close=True)  # fmt: skip
    if how == "oversize":
        data = HEADER.pack(draw(st.integers(DEFAULT_MAX_FRAME_BYTES + 1, 2**32 - 1)))
        return RunnerCase(how, data, exit_code=EXIT_PROTOCOL)
    if how == "eof":
        return RunnerCase(how, b"", exit_code=EXIT_ORPHANED, close=True)
    if how == "shutdown":
        return RunnerCase(how, frame({"type": "shutdown", "reason": draw(texts())}), exit_code=0)
    load: dict[str, Any] = {
        "type": "load_model",
        "name": draw(texts()),
        "model": MISSING_MODEL + draw(st.text(max_size=40)),
        # junk fault names only: no "_" (every real fault has one) and no "once"
        "faults": draw(st.text(max_size=20).filter(lambda f: "_" not in f and "once" not in f)),
    }
    if draw(st.booleans()):
        load["max_tokens_cap"] = draw(st.one_of(st.none(), ints()))
    return RunnerCase("load_missing", frame(load), exit_code=EXIT_LOAD_FAILED)


def runner_case() -> st.SearchStrategy[RunnerCase]:
    """Mostly odd commands (many fed to one process), some enders."""
    case = st.one_of(runner_command(), runner_command(), runner_command(), runner_ender())
    return case.filter(lambda c: c.kind != "command" or runner_decodes(c.data)).filter(
        lambda c: c.kind == "command" or c.exit_code is not None
    )


def draw_runner_cases(count: int, seed: int) -> list[RunnerCase]:
    """The explicit cases, then hostile ones drawn by hypothesis."""
    explicit = [
        RunnerCase("oversize", HEADER.pack(DEFAULT_MAX_FRAME_BYTES + 1), exit_code=EXIT_PROTOCOL),
        RunnerCase(
            "undecodable", frame({"type": "no_such_command"}), exit_code=EXIT_PROTOCOL, close=True
        ),
        RunnerCase(
            "truncated", frame({"type": "ping", "seq": 1})[:-1], exit_code=EXIT_PROTOCOL, close=True
        ),
        RunnerCase("eof", b"", exit_code=EXIT_ORPHANED, close=True),
        RunnerCase(
            "hello",
            frame({"type": "hello", "protocol_version": 0, "pid": 1, "role": "supervisor"}),
            exit_code=EXIT_PROTOCOL,
            close=True,
        ),
        RunnerCase("shutdown", frame({"type": "shutdown", "reason": "\x00" * 1000}), exit_code=0),
        RunnerCase("command", frame({"type": "cancel", "request_id": 12345})),
        RunnerCase(
            "command",
            frame(
                {
                    "type": "generate",
                    "request_id": 7,
                    "prompt": "hi",
                    "sampling": {"temperature": math.nan, "top_p": -1.0, "max_tokens": 2**64 - 1},
                }
            ),
            request_id=7,
        ),
    ]
    explicit = explicit[:count]
    return explicit + draw_examples(runner_case(), count - len(explicit), seed)


# --- results -----------------------------------------------------------------


@dataclass
class Finding:
    what: str  # one of FINDINGS
    kind: str  # the case's kind ("daemon:raw", "runner:command", ...) or "batch"
    index: int  # the case's number in its list (-1: not one case)
    detail: str
    sent: str = ""  # what was sent, abbreviated (a reproducer)
    sent_hex: str = ""  # the exact bytes (cut at 4 KiB)


@dataclass
class FuzzResult:
    seed: int
    cases: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)  # daemon answers by kind
    runner_outcomes: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)
    quiet: list[tuple[int, int, int]] = field(default_factory=list)  # daemon start, fds, rss
    daemon_starts: int = 0
    runner_processes: int = 0
    batches: int = 0
    wall_s: float = 0.0

    def find(self, what: str, kind: str, index: int, detail: str, sent: bytes = b"") -> None:
        assert what in FINDINGS, what
        self.findings.append(
            Finding(what, kind, index, detail[:2000], describe(sent), sent[:4096].hex())
        )

    @property
    def passed(self) -> bool:
        return not self.findings


def abbreviate(value: Any) -> Any:
    """Long strings and bytes shortened to ``'c' * n`` or a prefix."""
    if isinstance(value, str | bytes) and len(value) > 60:
        if len(set(value)) == 1:
            return f"{value[:1]!r} * {len(value)}"
        return f"{value[:40]!r}... ({len(value)} long)"
    if isinstance(value, list):
        return [abbreviate(v) for v in value]
    if isinstance(value, dict):
        return {abbreviate(k): abbreviate(v) for k, v in value.items()}
    return value


def describe(data: bytes) -> str:
    """Frames as their msgpack values (abbreviated), other bytes as hex."""
    parts = []
    rest = data
    while rest:
        if len(rest) < HEADER.size:
            parts.append(f"bytes {rest.hex()}")
            break
        (length,) = HEADER.unpack_from(rest)
        body = rest[HEADER.size : HEADER.size + length]
        if len(body) < length or length > DEFAULT_MAX_FRAME_BYTES:
            parts.append(f"header {length} + {len(body)} bytes {body[:32].hex()}")
            break
        try:
            parts.append(f"frame {abbreviate(msgspec.msgpack.decode(body))!r}")
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            parts.append(f"frame of {length} undecodable bytes {body[:32].hex()}")
        rest = rest[HEADER.size + length :]
    return "; ".join(parts) or "nothing"


# --- the daemon ----------------------------------------------------------------


def read_answer(sock: socket.socket, case: Case, deadline: float) -> tuple[list[bytes], str]:
    """Frame bodies the daemon sent until it closed; ``how`` is ``closed``,
    ``dropped`` (we closed), ``timeout`` or ``cut`` (closed mid-frame)."""
    splitter = FrameSplitter(DEFAULT_MAX_FRAME_BYTES)
    bodies: list[bytes] = []
    after_sent = case.after_reply is None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bodies, "timeout"
        sock.settimeout(remaining)
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            return bodies, "timeout"
        except ConnectionResetError:
            data = b""
        if not data:
            return bodies, "cut" if splitter.pending else "closed"
        try:
            bodies.extend(splitter.feed(data))
        except ProtocolError:
            return bodies, "cut"
        if not after_sent and len(bodies) >= 2:
            after_sent = True
            with contextlib.suppress(OSError):
                sock.sendall(case.after_reply or b"")
            if case.after_end == "drop":
                return bodies, "dropped"
            if case.after_end == "shut":
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)


def judge_answer(bodies: list[bytes], how: str) -> tuple[str, str | None, str]:
    """(answer label, finding or None, detail) for what the daemon sent."""
    if how == "timeout":
        return "timeout", "no answer or close in time", f"after {len(bodies)} frames"
    if how == "cut":
        return "cut", "bad reply frame", "the daemon closed in the middle of a frame"
    if not bodies:  # the daemon sends its Hello first on every connection it serves
        return f"{how} (no hello)", None, ""
    label = how
    for number, body in enumerate(bodies):
        try:
            if number == 0:
                _SERVER_CODEC.decode_hello(body, "supervisor")
                continue
            message = _SERVER_CODEC.decode(body)
        except ProtocolError as exc:
            return "bad frame", "bad reply frame", f"frame {number}: {exc}"
        if isinstance(message, ErrorReply):
            if message.code == "internal":
                return "error:internal", "internal error", message.message
            if not message.message:
                return f"error:{message.code}", "bad reply frame", "an ErrorReply with no message"
            label = f"error:{message.code}"
        else:
            label = type(message).__name__
    return label, None, ""


class DaemonFuzz:
    """Runs daemon cases in batches against daemons from ``start``.

    Args:
        start: starts a daemon with DAEMON_CONFIG (a new one after a crash).
        result: where counts and findings go.
        batches: how many health checks (status, a generation, fds and RSS).
    """

    def __init__(
        self, start: Callable[[], DaemonProcess], result: FuzzResult, batches: int
    ) -> None:
        self.start = start
        self.result = result
        self.batches = max(1, batches)
        self.daemon: DaemonProcess | None = None
        self.client: Client | None = None
        self.idle: list[tuple[int, Case, socket.socket, float]] = []
        self.previous: tuple[int, Case] | None = None  # the last case served (or dropped)
        self.fds_start = 0
        self.rss_warm: int | None = None
        self.quiet_count = 0

    def run(self, cases: list[Case]) -> None:
        self.start_daemon()
        size = max(1, math.ceil(len(cases) / self.batches))
        for first in range(0, len(cases), size):
            for index in range(first, min(first + size, len(cases))):
                self.run_case(index, cases[index])
            self.end_batch()
        self.check_growth()

    def start_daemon(self) -> None:
        self.daemon = self.start()
        self.result.daemon_starts += 1
        self.client = Client(self.daemon.socket_path, timeout_s=CASE_BOUND_S)
        self.client.load(f"builtin:{MODEL}", MODEL, max_tokens=MODEL_MAX_TOKENS)
        self.rss_warm = None
        self.quiet_count = 0
        self.fds_start = 0
        self.fds_start, rss = self.quiet_state()
        self.result.quiet.append((self.result.daemon_starts, self.fds_start, rss))

    def daemon_died(self, kind: str, index: int, sent: bytes, wait_s: float = 0.0) -> bool:
        """Record a dead daemon (and start another); True if it was dead.

        ``wait_s``: how long a daemon that refuses connections gets to exit
        (one that dies of a bug stops listening first, then stops its runners).
        """
        assert self.daemon is not None and self.daemon.process is not None
        try:
            code = self.daemon.process.wait(wait_s) if wait_s else self.daemon.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return False
        # It has exited: wait() reaps it and joins the log reader, which ends at
        # the log's last line (what the daemon wrote as it died, in the tail below).
        self.daemon.wait(QUIET_BOUND_S)
        tail = " | ".join(line[-300:] for line in list(self.daemon.log_lines)[-4:])
        self.result.find("daemon died", kind, index, f"exit {code}; log: {tail}", sent)
        self.close_idle()
        self.previous = None
        self.start_daemon()
        return True

    def run_case(self, index: int, case: Case, first_try: bool = True) -> None:
        assert self.daemon is not None
        kind = f"daemon:{case.kind}"
        if first_try:
            self.result.cases[kind] += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CASE_BOUND_S)
        try:
            sock.connect(str(self.daemon.socket_path))
        except OSError as exc:
            sock.close()
            self.lost_daemon(str(exc))
            if first_try:  # once more, on the daemon started in its place
                self.run_case(index, case, first_try=False)
            return
        if case.end == "drop":  # no answer to judge: a suspect if the daemon goes down
            self.previous = (index, case)
        try:
            for chunk in case.chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the daemon closed first: what it sent is still to be read
        if case.end == "idle":
            self.idle.append((index, case, sock, time.monotonic()))
            return
        try:
            if case.end == "drop":
                self.result.answers["dropped"] += 1
                return
            if case.end == "shut":
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            bodies, how = read_answer(sock, case, time.monotonic() + CASE_BOUND_S)
        finally:
            sock.close()
        self.judge(index, case, bodies, how)

    def lost_daemon(self, error: str) -> None:
        """The daemon refused a connection or a status: it died (of the last
        case that reached it, most likely) or stopped listening. Either is a
        finding; a new daemon starts."""
        index, kind, sent = -1, "batch", b""
        if self.previous is not None:
            index, case = self.previous
            kind, sent = f"daemon:{case.kind}", case.sent()
        if self.daemon_died(kind, index, sent, wait_s=QUIET_BOUND_S):
            return
        detail = f"alive but not answering ({error}); after case #{index}"
        self.result.find("daemon stopped answering status", kind, index, detail, sent)
        self.restart()

    def judge(self, index: int, case: Case, bodies: list[bytes], how: str) -> None:
        kind = f"daemon:{case.kind}"
        if self.daemon_died(kind, index, case.sent()):
            return
        if not bodies and how == "closed" and not self.answers_status():
            # Not served at all: the daemon is going down, most likely because
            # of the last case it did serve.
            self.lost_daemon("closed a connection without a Hello, then refused status")
            return
        if bodies:
            self.previous = (index, case)
        label, finding, detail = judge_answer(bodies, how)
        if label == "error:runner_died":
            finding, detail = "served runner died", "a request killed the model's runner"
        self.result.answers[label] += 1
        if finding is not None:
            self.result.find(finding, kind, index, detail, case.sent())

    def answers_status(self) -> bool:
        assert self.client is not None
        try:
            self.client.status()
        except ClientError:
            return False
        return True

    def close_idle(self) -> None:
        for _, _, sock, _ in self.idle:
            sock.close()
        self.idle.clear()

    def end_batch(self) -> None:
        """Idle connections must have been closed; then the daemon must answer
        status and generate, and come back to a quiet state."""
        for index, case, sock, started in self.idle:
            try:
                bodies, how = read_answer(sock, case, started + CASE_BOUND_S)
            finally:
                sock.close()
            self.judge(index, case, bodies, how)
        self.idle.clear()
        self.result.batches += 1
        assert self.client is not None
        if self.daemon_died("batch", -1, b""):
            return
        try:
            self.client.status()
        except ClientError as exc:
            self.lost_daemon(f"status: {exc}")
            return
        try:
            fds, rss = self.quiet_state()
        except (TimeoutError, ClientError) as exc:
            self.result.find("daemon not quiet after a batch", "batch", -1, str(exc))
            return
        try:
            _, done = self.client.generate_text(MODEL, "hello", max_tokens=MODEL_MAX_TOKENS)
            if done.generation_tokens < 1:
                raise ClientError("no_tokens", "the generation gave no tokens")
        except ClientError as exc:
            self.result.find("generation failed afterwards", "batch", -1, f"{exc.code}: {exc}")
        self.result.quiet.append((self.result.daemon_starts, fds, rss))
        self.quiet_count += 1
        if self.rss_warm is None and self.quiet_count >= max(1, self.batches // 5):
            self.rss_warm = rss

    def restart(self) -> None:
        assert self.daemon is not None
        self.daemon.kill()
        self.previous = None
        self.close_idle()
        self.start_daemon()

    def quiet_state(self) -> tuple[int, int]:
        """fds and RSS of the daemon once only the model runs (ready), the
        spare is warm and no connection is open.

        Raises:
            TimeoutError: not quiet within QUIET_BOUND_S.
            RuntimeError: the daemon is gone.
        """
        assert self.daemon is not None and self.client is not None
        deadline = time.monotonic() + QUIET_BOUND_S
        last = ""
        while True:
            status = self.client.status()
            runners = [(r.name, r.state) for r in status.runners]
            spare = status.spare.state if status.spare else "none"
            if runners == [(MODEL, "ready")] and spare == "warm":
                break
            last = f"runners {runners}, spare {spare}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"not quiet within {QUIET_BOUND_S:g} s: {last}")
            time.sleep(0.1)
        # Our status connection closes a moment after its reply: wait for a
        # steady count (and one back at the start, if it gets there).
        process = psutil.Process(self.daemon.pid)
        fds, previous = process.num_fds(), -1
        fds_deadline = time.monotonic() + 5.0
        while time.monotonic() < fds_deadline:
            if fds == previous and (not self.fds_start or fds <= self.fds_start):
                break
            time.sleep(0.05)
            fds, previous = process.num_fds(), fds
        rss = process_rss(process.pid)
        if rss is None:
            raise RuntimeError(f"the daemon (pid {process.pid}) is gone")
        return fds, rss

    def check_growth(self) -> None:
        """fds back at the start; RSS within RSS_GROWTH_BOUND of its value
        after warm-up (for the last daemon started)."""
        mine = [(fds, rss) for start, fds, rss in self.result.quiet
                if start == self.result.daemon_starts]  # fmt: skip
        fds_end, rss_end = mine[-1]
        ok = fds_end <= self.fds_start
        self.result.checks["daemon fds back to the start (quiet states)"] = (
            ok, f"{self.fds_start} -> {fds_end}",
        )  # fmt: skip
        if not ok:
            self.result.find("daemon fd growth", "batch", -1, f"{self.fds_start} -> {fds_end}")
        warm = self.rss_warm if self.rss_warm is not None else mine[0][1]
        grown = rss_end - warm
        ok = grown < RSS_GROWTH_BOUND
        detail = (f"{warm / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB ({grown / 2**20:+.2f}, "
                  f"bound {RSS_GROWTH_BOUND / 2**20:g})")  # fmt: skip
        self.result.checks["daemon RSS flat after warm-up"] = (ok, detail)
        if not ok:
            self.result.find("daemon RSS growth", "batch", -1, detail)


# --- the runner ----------------------------------------------------------------


class RunnerPeer:
    """A real runner process driven over its pipes as the supervisor does,
    with every wait bounded."""

    def __init__(self, log_path: Path) -> None:
        command_r, self.command_w = os.pipe()
        self.event_r, event_w = os.pipe()
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "runner", "--read-fd", str(command_r),
                 "--write-fd", str(event_w), "--parent-pid", str(os.getpid())],
                pass_fds=(command_r, event_w), stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        os.close(command_r)
        os.close(event_w)
        os.set_blocking(self.command_w, False)
        self.splitter = FrameSplitter(DEFAULT_MAX_FRAME_BYTES)
        self.bodies: list[bytes] = []
        self.got_hello = False
        self.write_open = True
        self.eof = False
        self.events: list[RunnerEvent] = []  # every event received, in order

    def send(self, data: bytes, bound_s: float = RUNNER_BOUND_S) -> bool:
        """Write all of ``data``; False if the runner closed its end.

        Raises:
            TimeoutError: the runner read nothing for ``bound_s``.
        """
        view = memoryview(data)
        deadline = time.monotonic() + bound_s
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the runner stopped reading its pipe")
            select.select([], [self.command_w], [], remaining)
            try:
                view = view[os.write(self.command_w, view) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return False
        return True

    def close_write(self) -> None:
        if self.write_open:
            self.write_open = False
            os.close(self.command_w)

    def recv(self, deadline: float) -> RunnerEvent | Hello | None:
        """The next frame (the runner's Hello first); None at EOF.

        Raises:
            TimeoutError: nothing by ``deadline``.
            ProtocolError: the runner sent something undecodable.
        """
        while not self.bodies:
            if self.eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no frame from the runner in time")
            ready, _, _ = select.select([self.event_r], [], [], remaining)
            if not ready:
                continue
            data = os.read(self.event_r, 1 << 16)
            if not data:
                self.eof = True
                self.splitter.check_clean_eof()
                return None
            self.bodies.extend(self.splitter.feed(data))
        body = self.bodies.pop(0)
        if not self.got_hello:
            self.got_hello = True
            return _RUNNER_EVENTS.decode_hello(body, "runner")
        event = _RUNNER_EVENTS.decode(body)
        self.events.append(event)
        return event

    def wait_for(
        self, done: Callable[[RunnerEvent | Hello], bool], bound_s: float
    ) -> list[RunnerEvent | Hello]:
        """Frames until ``done`` says so. Raises TimeoutError, EOFError."""
        deadline = time.monotonic() + bound_s
        seen: list[RunnerEvent | Hello] = []
        while True:
            event = self.recv(deadline)
            if event is None:
                raise EOFError("the runner closed its pipe")
            seen.append(event)
            if done(event):
                return seen

    def drain_until_exit(self, bound_s: float) -> int | None:
        """Read frames to EOF and reap; the exit code, or None if it did not
        exit within ``bound_s`` (then it is killed)."""
        deadline = time.monotonic() + bound_s
        try:
            with contextlib.suppress(ProtocolError):
                while self.recv(deadline) is not None:
                    pass
            return self.proc.wait(max(0.1, deadline - time.monotonic()))
        except (TimeoutError, subprocess.TimeoutExpired):
            return None

    def stderr_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line[-300:] for line in lines[-3:])

    def close(self) -> None:
        """Kill (if still running), reap and close our pipe ends (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close_write()
        if self.event_r >= 0:
            os.close(self.event_r)
            self.event_r = -1


def exit_description(code: int | None) -> str:
    if code is None:
        return "no exit"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit {code}"


class RunnerFuzz:
    """Feeds runner cases to real runner processes.

    Valid but odd commands go to serving runners (model loaded), up to
    SESSION_COMMANDS each, and each such runner is ended by one of the
    enders; the other enders each get a fresh runner right after its
    handshake (a hostile Hello replaces ours).
    """

    def __init__(self, result: FuzzResult, workdir: Path) -> None:
        self.result = result
        self.workdir = workdir
        self.seq = 10**15  # our pings; far from most hostile seqs

    def run(self, cases: list[RunnerCase]) -> None:
        indexed = list(enumerate(cases))
        commands = [(i, c) for i, c in indexed if c.kind == "command"]
        enders = [(i, c) for i, c in indexed if c.kind != "command"]
        # Enders that need the mlx import anyway end the serving sessions first.
        enders.sort(key=lambda item: item[1].kind not in ("shutdown", "load_missing"))
        while commands:
            session, commands = commands[:SESSION_COMMANDS], commands[SESSION_COMMANDS:]
            ender = enders.pop(0) if enders else None
            self.serve_session(session, ender)
        for index, case in enders:
            self.protocol_session(index, case)

    def spawn(self) -> RunnerPeer:
        self.result.runner_processes += 1
        return RunnerPeer(self.workdir / f"runner-{self.result.runner_processes}.log")

    def protocol_session(self, index: int, case: RunnerCase) -> None:
        """A fresh runner fed ``case`` right after the handshake (or in place
        of our Hello)."""
        kind = f"runner:{case.kind}"
        self.result.cases[kind] += 1
        peer = self.spawn()
        try:
            if case.kind == "hello":
                peer.send(case.data)
            else:
                peer.send(hello("supervisor") + case.data)
            if case.close:
                peer.close_write()
            self.expect_exit(peer, index, case)
        except TimeoutError as exc:
            self.result.find("runner hung", kind, index, str(exc), case.data)
        finally:
            peer.close()

    def expect_exit(self, peer: RunnerPeer, index: int, case: RunnerCase) -> None:
        kind = f"runner:{case.kind}"
        bound = (
            RUNNER_START_BOUND_S if case.kind in ("shutdown", "load_missing") else RUNNER_BOUND_S
        )
        code = peer.drain_until_exit(bound)
        self.result.runner_outcomes[exit_description(code)] += 1
        if code is None:
            self.result.find("runner hung", kind, index, f"no exit within {bound:g} s", case.data)
        elif code != case.exit_code:
            what = "runner crashed" if code < 0 or code == 1 else "runner wrong exit code"
            detail = f"{exit_description(code)}, expected exit {case.exit_code}; "
            self.result.find(what, kind, index, detail + peer.stderr_tail(), case.data)
        # A runner that exits on purpose says why: LoadFailed, then its exit audit.
        said = {
            type(e)
            for e in peer.events
            if (isinstance(e, LoadFailed) and e.error) or (isinstance(e, ExitAudit) and e.cause)
        }
        wanted: dict[str, set[type]] = {
            "load_missing": {LoadFailed, ExitAudit},
            "shutdown": {ExitAudit},
        }
        if not wanted.get(case.kind, set()) <= said:
            detail = f"events before the exit: {[type(e).__name__ for e in peer.events[-5:]]}"
            self.result.find("runner unclear error", kind, index, detail, case.data)

    def start_serving(self) -> RunnerPeer:
        """A runner with the model loaded (capped at MODEL_MAX_TOKENS)."""
        peer = self.spawn()
        try:
            peer.send(hello("supervisor"))
            peer.wait_for(lambda e: isinstance(e, Started), RUNNER_START_BOUND_S)
            load = {"type": "load_model", "name": MODEL, "model": f"builtin:{MODEL}",
                    "max_tokens_cap": MODEL_MAX_TOKENS}  # fmt: skip
            peer.send(frame(load))
            events = peer.wait_for(
                lambda e: isinstance(e, Ready | LoadFailed), RUNNER_START_BOUND_S
            )
        except BaseException:
            peer.close()
            raise
        if not isinstance(events[-1], Ready):
            peer.close()
            raise RuntimeError(f"the runner could not load {MODEL}: {events[-1]}")
        return peer

    def serve_session(
        self, commands: list[tuple[int, RunnerCase]], ender: tuple[int, RunnerCase] | None
    ) -> None:
        peer: RunnerPeer | None = None
        try:
            for index, case in commands:
                peer = peer or self.start_serving()
                if not self.command(peer, index, case):
                    peer.close()
                    peer = None
            peer = peer or self.start_serving()
            if ender is None:
                peer.send(frame({"type": "shutdown", "reason": "fuzz done"}))
                peer.drain_until_exit(RUNNER_BOUND_S)
                return
            index, case = ender
            self.result.cases[f"runner:{case.kind}"] += 1
            try:
                peer.send(case.data)
                if case.close:
                    peer.close_write()
                self.expect_exit(peer, index, case)
            except TimeoutError as exc:
                self.result.find("runner hung", f"runner:{case.kind}", index, str(exc), case.data)
        finally:
            if peer is not None:
                peer.close()

    def command(self, peer: RunnerPeer, index: int, case: RunnerCase) -> bool:
        """Send one valid-but-odd command and a Ping; the runner must answer
        both (a Generate with its GenerationDone or GenerationFailed). False
        when the runner is gone (a finding unless it exited cleanly)."""
        kind = f"runner:{case.kind}"
        self.result.cases[kind] += 1
        self.seq += 1
        seq = self.seq
        waiting = {"pong"} | ({"request"} if case.request_id is not None else set())
        outcome = "answered"

        def done(event: RunnerEvent | Hello) -> bool:
            nonlocal outcome
            if isinstance(event, Pong) and event.seq == seq:
                waiting.discard("pong")
            if isinstance(event, GenerationDone) and event.request_id == case.request_id:
                waiting.discard("request")
                outcome = f"GenerationDone ({event.finish_reason})"
            if isinstance(event, GenerationFailed) and event.request_id == case.request_id:
                waiting.discard("request")
                outcome = f"GenerationFailed ({event.error.partition(':')[0][:40]})"  # its type
                if not event.error:
                    detail = "GenerationFailed with no error"
                    self.result.find("runner unclear error", kind, index, detail, case.data)
            return not waiting

        try:
            sent = peer.send(case.data) and peer.send(frame({"type": "ping", "seq": seq}))
            if not sent:
                raise EOFError("the runner closed its pipe")
            peer.wait_for(done, RUNNER_BOUND_S)
        except TimeoutError as exc:
            self.result.find("runner hung", kind, index, f"{exc} (waiting for {waiting})",
                             case.data)  # fmt: skip
            return False
        except (EOFError, ProtocolError) as exc:
            code = peer.drain_until_exit(RUNNER_BOUND_S)
            clean = code in (0, EXIT_LOAD_FAILED)
            self.result.runner_outcomes[f"exit on a command: {exit_description(code)}"] += 1
            if not clean:
                detail = f"{exc}; {exit_description(code)}; {peer.stderr_tail()}"
                self.result.find("runner crashed", kind, index, detail, case.data)
            return False
        self.result.runner_outcomes[outcome] += 1
        return True


# --- the run -------------------------------------------------------------------


def fuzz_daemon(
    start: Callable[[], DaemonProcess], cases: int, seed: int, result: FuzzResult
) -> None:
    """``cases`` hostile connections to daemons from ``start``, health checked
    in batches of about 250 (at least 4 batches)."""
    started = time.monotonic()
    drawn = draw_cases("daemon", cases, seed)
    DaemonFuzz(start, result, batches=max(4, math.ceil(cases / 250))).run(drawn)
    result.wall_s += time.monotonic() - started


def fuzz_runner(cases: int, seed: int, result: FuzzResult, workdir: Path) -> None:
    """``cases`` hostile frames for real runner processes."""
    started = time.monotonic()
    RunnerFuzz(result, workdir).run(draw_cases("runner", cases, seed))
    result.wall_s += time.monotonic() - started


def run_fuzz(cases: int, seed: int, runner_share: float = 0.1) -> FuzzResult:
    """The long run: a private daemon, then runners; ``runner_share`` of the
    cases go to runners."""
    result = FuzzResult(seed)
    started = time.monotonic()
    runner_count = round(cases * runner_share)
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-fuzz-") as tmp:
        workdir = Path(tmp)
        config = workdir / "fuzz.toml"
        config.write_text(DAEMON_CONFIG)
        daemons: list[DaemonProcess] = []

        def start() -> DaemonProcess:
            index = len(daemons)
            env = {"XDG_STATE_HOME": str(workdir / "state"), "MLX_SUPERVISOR_HTTP": "off"}
            daemon = DaemonProcess(workdir / f"d{index}.sock", config, env=env,
                                   log_file=workdir / f"daemon-{index}.log")  # fmt: skip
            daemons.append(daemon.start())
            return daemon

        try:
            fuzz_daemon(start, cases - runner_count, seed, result)
            fuzz_runner(runner_count, seed, result, workdir)
        finally:
            for daemon in daemons:
                if daemon.process is not None and daemon.process.poll() is None:
                    try:
                        daemon.terminate(timeout_s=30)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
    result.wall_s = time.monotonic() - started
    return result


def report(result: FuzzResult) -> str:
    """Cases by kind, findings by class, checks, and the first findings."""
    total = sum(result.cases.values())
    found = Counter(f.what for f in result.findings)
    checks = [(name, "PASS" if ok else "FAIL", detail)
              for name, (ok, detail) in result.checks.items()]  # fmt: skip
    quiet = result.quiet
    if quiet:
        checks.append((
            "daemon quiet states (fds, RSS)", "-",
            f"first {quiet[0][1]}, {quiet[0][2] / 2**20:.1f} MiB; "
            f"last {quiet[-1][1]}, {quiet[-1][2] / 2**20:.1f} MiB",
        ))  # fmt: skip
    lines = [
        f"fuzz: {total} cases (seed {result.seed}) in {result.wall_s:.1f} s; "
        f"{result.daemon_starts} daemon start(s), {result.runner_processes} runner processes, "
        f"{result.batches} health-checked batches",
        "",
        render_table(("cases by kind", "count"),
                     [(kind, str(count)) for kind, count in sorted(result.cases.items())],
                     markdown=True),
        "",
        render_table(("finding", "count"), [(what, str(found[what])) for what in FINDINGS],
                     markdown=True),
        "",
        render_table(("check", "result", "detail"), checks, markdown=True),
        "",
    ]  # fmt: skip
    if result.answers:
        lines.append(f"daemon answers: {tally(result.answers)}")
    if result.runner_outcomes:
        lines.append(f"runner outcomes: {tally(result.runner_outcomes)}")
    for finding in result.findings[:10]:
        lines.append(
            f"- {finding.what} ({finding.kind} #{finding.index}): {finding.detail[:400]}"
            + (f"\n  sent: {finding.sent[:400]}" if finding.sent else "")
        )
    if len(result.findings) > 10:
        lines.append(f"- ... and {len(result.findings) - 10} more")
    return "\n".join(lines)


def tally(counts: Counter[str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.most_common())


def to_json(result: FuzzResult) -> dict[str, Any]:
    return {
        "seed": result.seed,
        "passed": result.passed,
        "wall_s": result.wall_s,
        "cases": dict(result.cases),
        "cases_total": sum(result.cases.values()),
        "findings_by_class": {w: sum(f.what == w for f in result.findings) for w in FINDINGS},
        "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in result.checks.items()},
        "daemon_quiet_states": [
            {"daemon": d, "fds": f, "rss_bytes": r} for d, f, r in result.quiet
        ],
        "daemon_starts": result.daemon_starts,
        "runner_processes": result.runner_processes,
        "batches": result.batches,
        "daemon_answers": dict(result.answers),
        "runner_outcomes": dict(result.runner_outcomes),
        "findings": [finding.__dict__ for finding in result.findings],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases in all")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--runner-share", type=float, default=0.1,
                        help="the share of the cases fed to runners")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--draw", choices=["daemon", "runner"], help=argparse.SUPPRESS)
    parser.add_argument("--draw-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hello-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.draw:  # the child process of draw_cases
        global HELLO_PID
        HELLO_PID = args.hello_pid
        draw = draw_daemon_cases if args.draw == "daemon" else draw_runner_cases
        args.draw_out.write_bytes(msgspec.msgpack.encode(draw(args.cases, args.seed)))
        return 0
    print(f"fuzz: {args.cases} cases (seed {args.seed}) ...", flush=True)
    result = run_fuzz(args.cases, args.seed, args.runner_share)
    print(report(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(to_json(result), indent=2))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
