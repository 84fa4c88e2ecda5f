"""Fault injection for tests and the soak: make a runner misbehave on purpose.

Test tooling, off by default. Set ``MLX_SUPERVISOR_FAULTS`` in the runner's
environment (a load request's ``env`` or a model's config) to a
comma-separated list of ``NAME`` or ``NAME=ARG``:

- ``ignore_shutdown``: read a Shutdown message and carry on as if not.
- ``ignore_sigterm``: SIGTERM is ignored (the supervisor must SIGKILL).
- ``fail_load=MESSAGE``: raise an exception while loading.
- ``crash_at_load=SIGNAL``: kill ourselves with SIGNAL before the weights.
- ``crash_at_token=N:SIGNAL``: kill ourselves with SIGNAL at token N.
- ``crash_random=P:SIGNAL``: at each token, with probability P, kill ourselves.
- ``hang_at_token=N[:c|:gil]``: at token N stop making progress forever: a
  busy Python loop, or with ``:c`` a blocking C call with SIGTERM masked (what a
  hung ``mx.eval`` looks like: only SIGKILL ends it; the GIL is released, so
  pings are still answered), or with ``:gil`` a C call that holds the GIL with
  SIGTERM masked (a deadlock: the process answers nothing, not even pings).
- ``hang_random=P[:c]``: at each token, with probability P, hang as above.
- ``hang_at_load[=c]``: hang before the weights are evaluated.
- ``hang_when_idle[=c]``: hang right after Ready (pings go unanswered).
- ``write_at_token=N:PATH``: at token N write to PATH and sync it. On a
  frozen filesystem (``fsfreeze``) the write sleeps uninterruptibly: the
  process cannot be killed, even by SIGKILL, until it is thawed.
- ``slow_prefill=S``: each prefill chunk takes S seconds more per prompt token
  it computes: a model that prefills slowly, on a fast one.
- ``hang_in_prefill=N[:c]``: hang as above at the start of a request's N-th
  prefill chunk (from 1).
- ``exit_in_handshake``: exit(1) before sending our Hello.
- ``exit_at_import``: exit(1) right after the handshake, as a broken mlx
  install would (a hot spare that can never start).
- ``garbage_at_token=N``: at token N write bytes that are no frame to the pipe.
- ``hog_at_token=N:MB``: at token N allocate and evaluate an mlx array of MB
  MiB and hold it until the request ends: a runaway request's memory, which
  the generation guard must catch.
- ``hog_at_load=MB``: before the weights, allocate MB MiB and hold it for the
  runner's life (a load the load guard must stop).
- ``script_text=BASE64``: every generation emits exactly the tokens of this
  text (standard base64 of UTF-8), then the model's EOS: the text is encoded
  by the model's tokenizer as a prompt is (no BOS; a tag that is one token in
  the vocabulary, ``<tool_call>``, becomes that token), and a logits
  processor forces each token in turn (:class:`ScriptedTokens`). The real
  decode path, detokenizer, output splitter and front all run on it: a random
  model writes a tool call, a think block, a broken call, on cue. Only a
  processor after it (the reasoning budget) may put another token in; the
  script then goes on after that token's next place in it (a think block the
  budget closes resumes after the script's own ``</think>``).
- ``script_prefix=BASE64``: the same, but after the text the model goes on
  as it would (a random model then thinks at random inside a ``<think>`` the
  prefix opened, where it would never open one itself).
- ``kill_in_disk_write=STAGE``: SIGKILL ourselves in the prefix cache's disk
  writer at STAGE of a block's write: ``tmp_written`` (the file complete
  under its temporary name), ``renamed`` (in place, not yet in the index) or
  ``recorded`` (in the index).
- ``once=PATH``: fire at most once across runners: a runner finding PATH
  injects nothing; the first fault to fire creates it. Lets a test crash a
  model's first runner but not the one restarted in its place.
"""

from __future__ import annotations

import base64
import binascii
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from ipc.messages import FAULTS_ENV

log = structlog.get_logger("runner.faults")


class InjectedFault(Exception):
    """Raised by ``fail_load``: a load failure on purpose."""


class Faults:
    """The faults this runner was asked to inject, parsed once at start."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._items: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, arg = item.partition("=")
            self._items[key] = arg
        self._held: list[Any] = []  # hog_at_load's memory, for the runner's life
        self._request_held: list[Any] = []  # hog_at_token's, until the request ends
        self._garbage_sent = False
        self._script: list[int] | None = None  # script_text's tokens, once encoded

    @classmethod
    def from_env(cls) -> Faults:
        faults = cls(os.environ.get(FAULTS_ENV, ""))
        once = faults.arg("once")
        if once and os.path.exists(once):
            return cls("")
        return faults

    def merged(self, spec: str) -> Faults:
        """These faults plus those in ``spec`` (honouring ``once`` again)."""
        if not spec:
            return self
        merged = Faults(",".join(filter(None, (self.spec, spec))))
        once = merged.arg("once")
        if once and os.path.exists(once):
            return Faults("")
        return merged

    def _fire(self) -> None:
        """Mark a ``once`` fault as spent, just before it acts."""
        once = self.arg("once")
        if once:
            with open(once, "a"):
                pass

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def arg(self, name: str) -> str:
        return self._items.get(name, "")

    def disk_write(self, stage: str) -> None:
        """The disk writer reached ``stage`` of a block's write."""
        if self.arg("kill_in_disk_write") == stage:
            self._fire()
            log.warning("fault_kill_in_disk_write", stage=stage)
            kill_self("SIGKILL")

    def at_load(self) -> None:
        """Apply the load-time faults (called before weights are read)."""
        if "crash_at_load" in self:
            self._fire()
            kill_self(self.arg("crash_at_load") or "SIGKILL")
        if "fail_load" in self:
            self._fire()
            raise InjectedFault(self.arg("fail_load") or "injected load failure")
        if "hang_at_load" in self:
            self._fire()
            hang(self.arg("hang_at_load"))
        if "hog_at_load" in self:
            self._fire()
            self._held.append(hog(int(self.arg("hog_at_load"))))

    def when_idle(self) -> None:
        """Apply the faults meant for an idle runner (called after Ready)."""
        if "hang_when_idle" in self:
            self._fire()
            hang(self.arg("hang_when_idle"))

    def garbage_due(self, n: int) -> bool:
        """Whether to write garbage to the pipe now that ``n`` tokens went out
        (``garbage_at_token``: once, with the first frame that reaches it; text
        frames may carry several tokens)."""
        at = self.arg("garbage_at_token")
        if not at or self._garbage_sent or n < int(at):
            return False
        self._garbage_sent = True
        self._fire()
        return True

    def at_token(self, n: int) -> None:
        """Apply the per-token faults; ``n`` counts generated tokens from 1."""
        if not self._items:  # the usual case, every token
            return
        if "crash_at_token" in self:
            at, _, sig = self.arg("crash_at_token").partition(":")
            if n == int(at):
                self._fire()
                kill_self(sig or "SIGKILL")
        if "crash_random" in self:
            chance, _, sig = self.arg("crash_random").partition(":")
            if random.random() < float(chance):
                self._fire()
                kill_self(sig or "SIGKILL")
        if "hang_at_token" in self:
            at, _, how = self.arg("hang_at_token").partition(":")
            if n == int(at):
                self._fire()
                hang(how)
        if "hang_random" in self:
            chance, _, how = self.arg("hang_random").partition(":")
            if random.random() < float(chance):
                self._fire()
                hang(how)
        if "write_at_token" in self:
            at, _, path = self.arg("write_at_token").partition(":")
            if n == int(at):
                self._fire()
                with open(path, "a") as file:  # appends: never truncates a file
                    file.write("written by a runner")
                    file.flush()
                    os.fsync(file.fileno())
        if "hog_at_token" in self:
            at, _, mebibytes = self.arg("hog_at_token").partition(":")
            if n == int(at):
                self._fire()
                self._request_held.append(hog(int(mebibytes)))

    def prefill_chunk(self, index: int, tokens: int) -> None:
        """Apply the prefill faults to a request's ``index``-th chunk (from 1)
        of ``tokens`` prompt tokens, before it is computed."""
        if not self._items:  # the usual case
            return
        if "hang_in_prefill" in self:
            at, _, how = self.arg("hang_in_prefill").partition(":")
            if index == int(at):
                self._fire()
                hang(how)
        if "slow_prefill" in self:
            time.sleep(float(self.arg("slow_prefill")) * tokens)

    def script_processor(self, tokenizer: Any) -> Callable[[Any, Any], Any] | None:
        """A new request's processor that forces ``script_text``'s tokens
        and then EOS, or ``script_prefix``'s and then nothing (None without
        either). The text is encoded once, on the first request; that
        request logs the tokens and the thinking and tool-call markup mlx-lm
        found for the model (its tool parser's name), which is what a test of
        a tool-call family checks it got.

        Raises:
            ValueError: both are set, or the text is not base64 of UTF-8."""
        names = [name for name in ("script_text", "script_prefix") if name in self]
        if not names:
            return None
        if len(names) > 1:
            raise ValueError("script_text and script_prefix exclude each other")
        (name,) = names
        if self._script is None:
            try:
                text = base64.b64decode(self.arg(name), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError) as exc:
                raise ValueError(f"{name} is not base64 of UTF-8 text: {exc}") from exc
            self._script = list(tokenizer.encode(text, add_special_tokens=False))
            log.warning(
                "scripted_output",
                tokens=len(self._script),
                tool_parser=tool_parser_name(tokenizer),
                tool_call_start=getattr(tokenizer, "tool_call_start", None),
                think_start=getattr(tokenizer, "think_start", None),
            )
        self._fire()
        if name == "script_prefix":
            return ScriptedTokens(self._script, None)
        ends = tokenizer.eos_token_ids
        return ScriptedTokens(self._script, tokenizer.eos_token_id if tokenizer.eos_token_id in ends
                              else min(ends))  # fmt: skip

    def end_request(self) -> None:
        """Drop what ``hog_at_token`` held for the request that ended."""
        self._request_held.clear()


def tool_parser_name(tokenizer: Any) -> str | None:
    """The name of the tool parser mlx-lm chose for ``tokenizer`` (its
    ``tool_parser_type``, which ``mlx_lm.tokenizer_utils.load`` writes into
    the tokenizer's config; laguna's parser is glm47's function, so the
    function's module would not tell), or None."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    config = getattr(tokenizer, "init_kwargs", None)
    name = config.get("tool_parser_type") if isinstance(config, dict) else None
    return str(name) if name else str(parser.__module__).rpartition(".")[2]


class ScriptedTokens:
    """A logits processor (mlx-lm's signature) that makes one generation
    emit ``script`` and then ``end`` (an EOS token; None: after the script
    the logits pass unchanged): every logit but the next token's is -inf,
    whatever the processors before it did (so a grammar that would not allow
    the token fails the request, loudly).

    It follows the tokens that actually came (mlx-lm shows the whole
    sequence each call; the first call shows the prompt, as far as this run
    sees it). One that is not the scripted one (a later processor forced it)
    moves the script on to just after that token's next place in it, or
    leaves the script where it was if it has none. Reading the tokens stalls
    the decode pipeline a step: fine for test tooling."""

    def __init__(self, script: Sequence[int], end: int | None) -> None:
        self.script = list(script)
        self.end = end
        self._prompt_len: int | None = None
        self._seen = 0  # generated tokens followed so far
        self._next = 0  # the index in ``script`` of the token to force next

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx  # not at import: faults are parsed before mlx is imported

        if self._prompt_len is None:
            self._prompt_len = tokens.size
        if self.end is None and self._next >= len(self.script):
            return logits  # a prefix, written: the model is free (and not followed)
        start = self._prompt_len + self._seen
        if tokens.size > start:
            for token in tokens[start:].tolist():
                self._follow(int(token))
            self._seen = tokens.size - self._prompt_len
        if self._next < len(self.script):
            target = self.script[self._next]
        elif self.end is not None:
            target = self.end
        else:
            return logits
        return mx.where(
            mx.arange(logits.shape[-1]) == target,
            mx.zeros_like(logits),
            mx.array(-float("inf"), dtype=logits.dtype),
        )

    def _follow(self, token: int) -> None:
        """Take one token that came out."""
        if self._next < len(self.script) and self.script[self._next] == token:
            self._next += 1
            return
        rest = self.script[self._next :]
        if token in rest:  # else the script goes on where it was
            self._next += rest.index(token) + 1


def hog(mebibytes: int) -> Any:
    """An evaluated mlx array of ``mebibytes`` MiB, every page written."""
    import mlx.core as mx  # not at import: faults are parsed before mlx is imported

    array = mx.ones((mebibytes << 20,), dtype=mx.uint8)
    mx.eval(array)
    return array


def hang(how: str) -> None:
    """Never return. ``c``: block in C with SIGTERM masked; ``gil``: the same
    while holding the GIL (no other thread runs); else spin."""
    if how in ("c", "gil"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        if how == "gil":
            import ctypes

            libc = ctypes.PyDLL(None)  # PyDLL calls keep the GIL
            while True:
                libc.sleep(3600)
        while True:
            time.sleep(3600)
    while True:  # a busy loop that makes no progress; SIGTERM still works here
        pass


def kill_self(signal_name: str) -> None:
    """Deliver ``signal_name`` to this process, with no handler in the way."""
    signum = signal.Signals[signal_name]
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
