"""The runner process: one model, driven over a pipe pair by the supervisor.

Started as ``python -m runner --read-fd R --write-fd W --parent-pid P``. The
fds are inherited pipe ends; stdout and stderr stay free for logs, which the
supervisor captures. A reader thread owns the incoming pipe: it reacts to
Cancel and Shutdown at once and exits the process the moment the pipe
reaches EOF, so a runner never outlives its supervisor.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import psutil
import structlog

from ipc import DEFAULT_MAX_FRAME_BYTES, BlockingChannel, ChannelClosed, Codec, ProtocolError
from ipc.messages import (
    GROUP_STEP_FAILED,
    NO_MODEL_LOADED,
    CacheCleared,
    Cancel,
    CauseClass,
    ClearCache,
    CountTokens,
    Embed,
    Embeddings,
    Environment,
    ExitAudit,
    Generate,
    GenerationFailed,
    LoadFailed,
    LoadModel,
    LoadProgress,
    Ping,
    Pong,
    Ready,
    RunnerCommand,
    Shutdown,
    Started,
    TextChunk,
    TokenCount,
)
from runner import import_cache
from runner.faults import Faults
from runner.guard import MemoryGuard, MemoryGuardError
from runner.logs import configure_logging

if TYPE_CHECKING:
    from pathlib import Path

    from runner.adapters import Adapters
    from runner.embeddings import EmbeddingQueue
    from runner.engine import Engine

EXIT_ORPHANED = 70  # the supervisor went away
EXIT_PROTOCOL = 71  # the supervisor sent something we cannot read
EXIT_LOAD_FAILED = 72
EXIT_MEMORY_GUARD = 73  # the load guard stopped the load (the supervisor's classifier knows 73)
EXIT_GROUP_BROKEN = 74  # a rank of a distributed group cannot go on (a peer lost, a step failed)

log = structlog.get_logger("runner")


class RunnerExit(Exception):
    """Leave the main loop and exit with ``code``, reporting ``cause`` (and its
    ``cause_class`` when the runner knows it)."""

    def __init__(self, code: int, cause: str, cause_class: CauseClass | None = None) -> None:
        super().__init__(cause)
        self.code = code
        self.cause = cause
        self.cause_class = cause_class


def set_parent_death_signal(parent_pid: int) -> None:
    """On Linux, have the kernel SIGKILL us when our parent dies (0: whoever
    it is now; over ssh, the session's process)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(EXIT_ORPHANED)


def disable_core_dumps() -> None:
    """A runner's core file is as big as its model: don't write one unless asked
    (``MLX_SUPERVISOR_CORE_DUMPS=1``)."""
    if os.environ.get("MLX_SUPERVISOR_CORE_DUMPS") == "1":
        return
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Runner:
    """State of the runner process: the model, its engine, the pipe."""

    def __init__(self, channel: BlockingChannel[RunnerCommand], faults: Faults) -> None:
        self.channel = channel
        self.faults = faults
        # The largest frame either way (--max-frame-bytes): a reply must fit in it.
        self.max_frame_bytes = channel.codec.max_frame_bytes
        # SimpleQueue: the busy loop looks at it every token, and its empty() takes no lock.
        self.commands: queue.SimpleQueue[RunnerCommand] = queue.SimpleQueue()
        # Requests received but not finished, and which of them were cancelled:
        # a Cancel that overtakes its request's start is kept, never lost.
        self.pending: dict[int, float] = {}  # request id -> when it came (perf_counter)
        self.cancelled_ids: set[int] = set()
        self.shutting_down = False
        self.name = "?"
        self.model: Any = None
        self.tokenizer: Any = None
        self.engine: Engine | None = None
        self.embeddings: EmbeddingQueue | None = None  # an embedding model's requests
        self.max_tokens_cap: int | None = None
        # Limits and guards; its ``figures`` are what the reader thread's Pongs carry.
        self.guard = MemoryGuard()
        self.tokens_served = 0
        self.requests_served = 0
        self._lock = threading.Lock()

    # --- the reader thread ---------------------------------------------------

    def read_commands(self) -> None:
        """Reader thread: route each command; exit the process on EOF.

        Pings are answered here, whatever the main thread is doing: a runner
        that stops answering is frozen (stopped, or deadlocked holding the GIL).
        """
        while True:
            try:
                command = self.channel.recv()
            except ChannelClosed:
                log.warning("supervisor_gone", action="exiting")
                self.exit_audit("orphaned: the supervisor closed the pipe")
                os._exit(EXIT_ORPHANED)
            except (ProtocolError, OSError) as exc:
                log.error("protocol_error", error=str(exc))
                # Logged, not sent: the main thread may hold the send lock on a full pipe.
                self.exit_audit(f"protocol error: {exc}")
                os._exit(EXIT_PROTOCOL)
            if isinstance(command, Ping):
                # No mlx call here: liveness must not depend on what mlx is doing.
                # The figures are those the main thread measured last.
                engine = self.engine
                stats = engine.live_stats() if engine is not None else None
                with contextlib.suppress(OSError):
                    self.channel.send(Pong(command.seq, self.guard.figures, stats))
                continue
            if isinstance(command, Cancel):
                with self._lock:
                    if command.request_id in self.pending:
                        self.cancelled_ids.add(command.request_id)
                continue
            if isinstance(command, Generate | Embed):  # an Embed can be cancelled too
                with self._lock:
                    self.pending[command.request_id] = time.perf_counter()
            if isinstance(command, Shutdown):
                if "ignore_shutdown" in self.faults:
                    log.warning("fault_ignoring_shutdown")
                    continue
                with self._lock:  # finish the requests in flight, and any queued, early
                    self.shutting_down = True
            self.commands.put(command)

    # --- the main thread -----------------------------------------------------

    def serve(self) -> str:
        """Handle commands and step the engine until Shutdown; return the exit cause.

        With requests in flight, the commands that came in are taken between
        two engine steps (a step is one token of every running request, or
        a prefill chunk); otherwise the loop sleeps until the next command.
        """
        while True:
            engine = self.engine
            embeddings = self.embeddings
            busy = engine is not None and engine.has_work
            busy = busy or (embeddings is not None and embeddings.has_work)
            command: RunnerCommand | None = None
            try:
                if not busy:
                    command = self.commands.get()
                elif engine is not None and (wait_s := engine.admission_wait_s()) > 0:
                    command = self.commands.get(timeout=wait_s)  # company for a lone request
                elif not self.commands.empty():
                    command = self.commands.get_nowait()
            except queue.Empty:
                command = None
            if isinstance(command, Shutdown):
                if embeddings is not None:
                    embeddings.cancel_all()  # a clean error for each, not a runner gone
                if engine is not None and not engine.idle:
                    self.step(engine)  # the requests in flight end as cancelled first
                    self.commands.put(command)
                    continue
                if engine is not None:
                    engine.close()  # the disk tier writes what is queued
                return f"shutdown: {command.reason}"
            if isinstance(command, LoadModel):
                self.load(command)
            elif isinstance(command, Generate):
                self.generate(command)
            elif isinstance(command, ClearCache):
                cleared = None
                try:
                    cleared = engine.clear_cache(command.disk_only) if engine else None
                except Exception:  # the caches are the runner's to lose, not the runner
                    log.exception("prefix_cache_clear_failed")
                entries, nbytes, blocks, disk_bytes = cleared or (0, 0, 0, 0)
                log.info("prefix_cache_cleared", entries=entries, bytes=nbytes, disk_entries=blocks,
                         disk_bytes=disk_bytes, disk_only=command.disk_only)  # fmt: skip
                self.channel.send(CacheCleared(self.name, entries, nbytes, blocks, disk_bytes))
            elif isinstance(command, CountTokens):
                self.count_tokens(command)
            elif isinstance(command, Embed):
                self.embed(command)
            if command is None and embeddings is not None and embeddings.has_work:
                self.embed_step(embeddings)  # one batch; commands are taken between two
                if engine is not None and not engine.has_work:
                    continue  # only embeddings to compute: an idle engine has no step
            if command is None and engine is not None:
                self.step(engine)

    def step(self, engine: Engine) -> None:
        """One engine step, as a fault boundary: an error no one request owns
        fails the requests in the engine, not the runner.

        A rank of a distributed group exits instead: its peers are gone, or
        a collective behind, and the group is restarted as a whole.

        Raises:
            RunnerExit: a rank's step failed.
        """
        try:
            engine.step()
        except Exception as exc:
            if engine.group is not None:
                from runner.distributed import is_peer_lost

                lost = is_peer_lost(exc)
                log.error("group_broken", error=str(exc), peer_lost=lost)
                raise RunnerExit(
                    EXIT_GROUP_BROKEN,
                    f"{'peer lost' if lost else GROUP_STEP_FAILED}: {type(exc).__name__}: {exc}",
                    "peer_lost" if lost else "step_failed",
                ) from exc
            log.exception("engine_step_failed")
            engine.fail_all(exc)

    def embed_step(self, embeddings: EmbeddingQueue) -> None:
        """One batch of embeddings, as a fault boundary (as :meth:`step`): an
        error there fails the queued embeds, not the runner."""
        try:
            embeddings.step()
        except Exception as exc:
            log.exception("embedding_step_failed")
            embeddings.fail_all(f"{type(exc).__name__}: {exc}")

    def load(self, command: LoadModel) -> None:
        """Load the model of ``command`` under its memory plan; send Ready.

        Raises:
            RunnerExit: the load failed (exit 72), or the memory guard
                stopped it (exit 73, cause class ``memory_guard``).
        """
        from runner.loading import load_model, load_sharded

        self.name = command.name
        self.max_tokens_cap = command.max_tokens_cap
        self.faults = self.faults.merged(command.faults)
        if "ignore_sigterm" in self.faults:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        structlog.contextvars.bind_contextvars(model=command.name)

        def progress(phase: str, done: int, total: int) -> None:
            # On "weights" the guard has just measured the layer (load_model's contract).
            active = self.guard.figures.active_bytes
            view = self.guard.last_view if phase == "weights" else None
            remaining = None if view is None else view.remaining_bytes
            rank = command.distributed.rank if command.distributed is not None else None
            self.channel.send(
                LoadProgress(command.name, phase, done, total, active, remaining, rank)
            )
            if view is not None:
                log.info(
                    "load_progress",
                    layer=done,
                    layers=total,
                    active_bytes=active,
                    remaining_bytes=remaining,
                    footprint_bytes=view.footprint_bytes,
                )

        log.info("load_started", source=command.model, max_tokens_cap=command.max_tokens_cap)
        try:
            self.guard.plan = command.memory
            self.guard.apply_limits()
            self.faults.at_load()
            if command.distributed is not None:
                from runner.distributed import join

                progress("join", 0, 1)
                group = join(command.distributed)
                progress("join", 1, 1)
                structlog.contextvars.bind_contextvars(rank=group.rank)
                loaded = load_sharded(command.model, progress, group.group, self.guard)
                group.same_seed()
            else:
                group = None
                loaded = load_model(command.model, progress, self.guard)
            if command.engine.kv_bits is not None:  # fails the load, not a request later
                from runner.kv_quant import check_quantizable

                check_quantizable(loaded.model, command.engine.kv_bits,
                                  command.engine.kv_group_size)  # fmt: skip
            embeddings = self.embedding_queue(command, loaded.model, loaded.tokenizer, loaded.path)
            adapters = self.adapters(command, loaded.model)
            if command.engine.draft_model is not None:  # the model's, then the draft's weights
                from runner.speculative import load_draft

                draft = load_draft(command.model, loaded, command.engine, progress, self.guard)
            else:
                draft = None
        except MemoryGuardError as exc:
            log.error(
                "memory_guard_abort",
                model=command.model,
                layer=exc.layer,
                layers=exc.layers,
                remaining_bytes=exc.remaining,
                guard_bytes=exc.threshold,
                footprint_bytes=exc.footprint,
                budget_bytes=exc.budget,
                total_bytes=exc.total,
                error=str(exc),
            )
            self.channel.send(LoadFailed(str(exc)))
            raise RunnerExit(
                EXIT_MEMORY_GUARD, f"memory_guard: {exc.reason}", "memory_guard"
            ) from exc
        except Exception as exc:
            log.error("load_failed", model=command.model, error=repr(exc))
            error = f"{type(exc).__name__}: {exc}"
            self.channel.send(LoadFailed(error))
            raise RunnerExit(EXIT_LOAD_FAILED, f"load failed: {error}") from exc
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.embeddings = embeddings
        self.guard.refresh()
        from runner.engine import Engine

        self.engine = Engine(
            self.model,
            self.tokenizer,
            command.engine,
            guard=self.guard,
            faults=self.faults,
            send=self.send_generation,
            is_cancelled=self.is_cancelled,
            on_finished=self.request_finished,
            max_tokens_cap=self.max_tokens_cap,
            group=group,
            model_path=loaded.path,
            adapters=adapters,
            draft=draft,
        )
        stats = self.engine.stats_snapshot
        active, peak = self.guard.figures.active_bytes, self.guard.figures.peak_bytes
        log.info(
            "ready",
            path=str(loaded.path),
            param_bytes=loaded.param_bytes,
            load_s=loaded.load_s,
            max_concurrent=stats.max_concurrent,
            batching=stats.batching,
            batching_reason=stats.batching_reason,
            prefix_cache_bytes=stats.prefix_cache.budget_bytes if stats.prefix_cache else None,
        )
        self.channel.send(
            Ready(str(loaded.path), loaded.param_bytes, active, peak, loaded.load_s, stats)
        )
        self.faults.when_idle()

    def adapters(self, command: LoadModel, model: Any) -> Adapters | None:
        """The model's LoRA adapters, each applied once (None: it has none).

        Raises:
            ValueError: an adapter that is not there or does not fit the model
                (the message names it), or adapters on a sharded model.
        """
        if not command.engine.adapters:
            return None
        if command.distributed is not None:
            raise ValueError("adapters on a model sharded over ranks: not supported")
        from runner.adapters import Adapters

        return Adapters.load(model, command.engine.adapters)

    def embedding_queue(
        self, command: LoadModel, model: Any, tokenizer: Any, path: Path
    ) -> EmbeddingQueue | None:
        """The embed requests' queue when the model in ``path`` is an embedding
        model (its sentence-transformers pooling); None for a chat model.

        Raises:
            ValueError: its pooling is one the runner does not apply, or it is
                sharded over ranks.
        """
        from runner.embeddings import EmbeddingQueue, read_embedding_config

        config = read_embedding_config(path)
        if config is None:
            return None
        if command.distributed is not None:
            raise ValueError("an embedding model is served by one process, not sharded")
        log.info("embedding_model", pooling=config.pooling, normalize=config.normalize,
                 dimensions=config.dimensions, max_tokens=config.max_tokens)  # fmt: skip
        return EmbeddingQueue(model, tokenizer, config, command.name, self.send_embeddings,
                              max_reply_bytes=self.max_frame_bytes, is_cancelled=self.is_cancelled,
                              guard=self.guard, faults=self.faults)  # fmt: skip

    def embed(self, command: Embed) -> None:
        """Queue ``command``'s inputs (answered by a later step), or refuse it:
        no model, or not an embedding model."""
        from runner.embeddings import not_an_embedding_model

        if self.embeddings is not None:
            try:
                self.embeddings.submit(command)
            except Exception as exc:  # the request's to fail, not the runner's
                log.exception("embed_refused")
                self.send_embeddings(Embeddings(command.request_id, error=f"{type(exc).__name__}: "
                                                f"{exc}"))  # fmt: skip
            return
        error = NO_MODEL_LOADED if self.engine is None else not_an_embedding_model(self.name)
        self.send_embeddings(Embeddings(command.request_id, error=error,
                                        invalid_request=self.engine is not None))  # fmt: skip

    def send_embeddings(self, answer: Embeddings) -> None:
        """An embed's answer (its last frame: forget its cancel)."""
        if answer.error is None:
            self.requests_served += 1
        self.request_finished(answer.request_id, None)
        self.channel.send(answer)

    def generate(self, request: Generate) -> None:
        """Hand ``request`` to the engine (which answers for it from then on)."""
        if self.embeddings is not None:  # an embedding model writes no text
            from runner.embeddings import not_a_chat_model

            error = not_a_chat_model(self.name, self.embeddings.config)
            self.channel.send(GenerationFailed(request.request_id, error, invalid_request=True))
            self.request_finished(request.request_id, None)
            return
        if self.engine is None:
            self.channel.send(GenerationFailed(request.request_id, "RuntimeError: no model loaded"))
            self.request_finished(request.request_id, None)
            return
        with self._lock:
            received = self.pending.get(request.request_id)
        self.engine.submit(request, received)  # its wait counts from its arrival

    def count_tokens(self, command: CountTokens) -> None:
        """Answer how many prompt tokens these fields make (a template that
        cannot render them is the answer's ``error``)."""
        if self.engine is None:
            self.channel.send(TokenCount(command.request_id, 0, NO_MODEL_LOADED))
            return
        request = Generate(command.request_id, command.prompt, command.messages,
                           chat=command.chat)  # fmt: skip
        try:
            tokens = self.engine.prompt_length(request)  # images expanded, as they would run
        except Exception as exc:  # the client's messages, not the runner, are wrong
            self.channel.send(TokenCount(command.request_id, 0, f"{type(exc).__name__}: {exc}"))
            return
        self.channel.send(TokenCount(command.request_id, tokens))

    def send_generation(self, message: msgspec.Struct) -> None:
        """The engine's way out: frames of its requests (and fault injection)."""
        if isinstance(message, TextChunk):
            tokens = message.generation_tokens
            if tokens and self.faults.garbage_due(tokens):
                # A length prefix, then a body no msgpack decoder accepts.
                os.write(self.channel.write_fd, b"\x00\x00\x00\x04\xc1\xc1\xc1\xc1")
        self.channel.send(message)

    def is_cancelled(self, request_id: int) -> bool:
        return self.shutting_down or request_id in self.cancelled_ids

    def request_finished(self, request_id: int, tokens: int | None) -> None:
        """A request's last frame went out (``tokens`` generated; None: it
        failed): count it, forget its cancel."""
        if tokens is not None:
            self.requests_served += 1
            self.tokens_served += tokens
        with self._lock:
            self.pending.pop(request_id, None)
            self.cancelled_ids.discard(request_id)

    def exit_audit(self, cause: str, cause_class: CauseClass | None = None) -> ExitAudit:
        """Log and return the runner's last words, from the latest figures
        (no mlx call: the reader thread uses it too)."""
        figures = self.guard.figures
        audit = ExitAudit(
            cause=cause,
            active_bytes=figures.active_bytes,
            peak_bytes=figures.peak_bytes,
            cache_bytes=figures.cache_bytes,
            tokens_served=self.tokens_served,
            requests_served=self.requests_served,
            cause_class=cause_class,
        )
        log.info("exit_audit", **msgspec.structs.asdict(audit))
        return audit

    def release(self) -> None:
        """Drop the model and return MLX's cached buffers (best effort)."""
        self.engine = self.model = self.tokenizer = None
        gc.collect()
        mx = sys.modules.get("mlx.core")
        if mx is not None:
            mx.clear_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runner", description=__doc__)
    parser.add_argument("--read-fd", type=int, required=True)
    parser.add_argument("--write-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--env-first", action="store_true",
                        help="read the environment from the first frame on --read-fd")  # fmt: skip
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                        help="largest frame read or written on the pipes")  # fmt: skip
    return parser.parse_args(argv)


def take_environment(channel: BlockingChannel[RunnerCommand]) -> None:
    """Set the environment the supervisor sends as its first frame (a rank
    on another machine: not on ssh's command line). Exits on anything else."""
    try:
        first = channel.recv()
    except (ProtocolError, ChannelClosed, OSError) as exc:
        print(f"runner: no environment from the supervisor: {exc}", file=sys.stderr)
        os._exit(EXIT_PROTOCOL)
    if not isinstance(first, Environment):
        print(f"runner: expected the environment first, got {type(first).__name__}",
              file=sys.stderr)  # fmt: skip
        os._exit(EXIT_PROTOCOL)
    os.environ.update(first.env)


def mapped_blas() -> str | None:
    """The BLAS library mapped into this process (mlx's bundled reference BLAS,
    or one the supervisor preloaded: supervisor.runners.blas), from
    /proc/self/maps; None where there is no such file (macOS) or no BLAS."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    # numpy's own copy (libscipy_openblas64_) has prefixed symbols: never mlx's.
    names = [p for p in paths if os.path.basename(p).startswith(("libblas", "libopenblas"))]
    return min(names, key=lambda path: "openblas" not in path, default=None)  # a preload wins


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point of ``python -m runner``."""
    args = parse_args(argv)
    set_parent_death_signal(args.parent_pid)
    channel: BlockingChannel[RunnerCommand] = BlockingChannel(
        args.read_fd, args.write_fd, Codec(RunnerCommand, args.max_frame_bytes)
    )
    if args.env_first:
        take_environment(channel)
    disable_core_dumps()
    configure_logging()
    structlog.contextvars.bind_contextvars(runner_pid=os.getpid())
    faults = Faults.from_env()
    if faults.spec:
        log.warning("fault_injection_enabled", faults=faults.spec)
    if "ignore_sigterm" in faults:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the daemon, who decides

    if "exit_in_handshake" in faults:
        os._exit(1)
    try:
        channel.handshake("runner", expect_role="supervisor")
    except (ProtocolError, ChannelClosed, OSError) as exc:
        log.error("handshake_failed", error=str(exc))
        os._exit(EXIT_PROTOCOL)

    runner = Runner(channel, faults)
    threading.Thread(target=runner.read_commands, name="pipe-reader", daemon=True).start()
    if "exit_at_import" in faults:
        log.error("fault_exit_at_import")
        os._exit(1)
    started = time.perf_counter()
    import_cache.install()  # transformers' import table from disk: half the import
    import mlx.core as mx
    import mlx_lm  # noqa: F401  (paid once here, before a LoadModel arrives)

    mx.eval(mx.zeros((1,)))  # the device set up, as a model's first evaluation would
    import_s = time.perf_counter() - started
    log.info("runner_started", import_s=round(import_s, 3), blas=mapped_blas())
    machine = psutil.virtual_memory()
    runner.guard.refresh()
    rss = psutil.Process().memory_info().rss
    channel.send(Started(import_s, machine.total, machine.available, runner.guard.figures, rss))

    cause = "unknown"
    cause_class: CauseClass | None = None
    code = 0
    try:
        cause = runner.serve()
    except RunnerExit as exc:
        code, cause, cause_class = exc.code, exc.cause, exc.cause_class
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        cause = "SIGTERM" if code == 128 + signal.SIGTERM else f"exit {code}"
    except BaseException as exc:
        code = 1
        cause = f"{type(exc).__name__}: {exc}"
        log.exception("runner_crashed")
    finally:
        # Last words go out even if measuring fails; the figures are then the last ones.
        # Measured before the model is dropped: what it held is what the audit is for.
        with contextlib.suppress(Exception):
            runner.guard.refresh()
        audit = runner.exit_audit(cause, cause_class)
        runner.release()
        with contextlib.suppress(OSError):
            channel.send(audit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
