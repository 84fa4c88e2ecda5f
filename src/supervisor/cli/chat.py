"""``mlx-supervisor chat NAME``: a multi-turn chat in the terminal, over the socket.

The history is kept here and sent whole every turn, as chat clients do (the
runner's prefix cache makes that cheap). Ctrl-C while the model answers
cancels the answer, keeping what came so far; Ctrl-C at the prompt clears
the line; Ctrl-D (or ``/bye``) leaves. ``/reset`` forgets the history.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import TextIO

from ipc.messages import ChatMessage, GenerationDone
from supervisor.cli.render import AnswerPrinter
from supervisor.client import Client, ClientError, DaemonUnreachable

PROMPT = ">>> "
COMMANDS_HELP = "/reset forgets the conversation, /bye (or Ctrl-D) leaves, Ctrl-C stops an answer"


@dataclass
class ChatSession:
    """One conversation with a loaded model.

    Args:
        client: the daemon's client.
        name: the model to talk to.
        system: a system prompt for every turn, if any.
        max_tokens, temperature: the sampling of every answer (None: the
            model's configured defaults, else the daemon's).
        out: where answers are written.
    """

    client: Client
    name: str
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    out: TextIO = sys.stdout
    history: list[ChatMessage] = field(default_factory=list)

    def reset(self) -> None:
        self.history = [ChatMessage("system", self.system)] if self.system else []

    def __post_init__(self) -> None:
        self.reset()

    def ask(self, text: str) -> GenerationDone:
        """Send ``text`` as the user's turn and stream the answer to ``out``.

        A KeyboardInterrupt while the answer streams cancels it; what came
        so far stays in the history as the assistant's turn.

        Raises:
            ClientError: the daemon refused or failed the request (the
                user's turn is then not kept).
        """
        self.history.append(ChatMessage("user", text))
        pieces: list[str] = []
        printer = AnswerPrinter(self.out)
        try:
            gen = self.client.generate(
                self.name,
                messages=list(self.history),
                max_tokens=self.max_tokens,
                temperature=self.temperature,
            )
            with gen:
                try:
                    for piece in gen:
                        pieces.append(piece)
                        printer.write(gen.chunk.reasoning if gen.chunk else "", piece)
                except KeyboardInterrupt:
                    gen.cancel()
                    for piece in gen:  # the frames already on their way
                        pieces.append(piece)
                        printer.write(gen.chunk.reasoning if gen.chunk else "", piece)
        except BaseException:
            printer.end_thought()
            self.history.pop()
            raise
        printer.end_thought()
        self.out.write("\n")
        done = gen.done
        assert done is not None
        if done.finish_reason == "cancelled":
            self.out.write("[answer stopped]\n")
        elif done.finish_reason == "length":
            self.out.write(f"[answer cut at {done.generation_tokens} tokens: --max-tokens]\n")
        self.out.flush()
        self.history.append(
            ChatMessage("assistant", "".join(pieces), reasoning=gen.reasoning or None)
        )
        return done


def run_chat(session: ChatSession, read_line: TextIO = sys.stdin) -> int:
    """Read turns from ``read_line`` until end of input; returns the exit code.

    On a terminal the prompt is shown and ``input`` gives line editing. A
    failed turn (the model restarting, a full queue) is reported and
    dropped; the conversation goes on.

    Raises:
        DaemonUnreachable: the daemon went away.
    """
    interactive = read_line.isatty() and session.out.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        session.out.write(f"chatting with {session.name}; {COMMANDS_HELP}\n")
    while True:
        try:
            if interactive:
                line = input(PROMPT)
            else:
                line = read_line.readline()
                if not line:
                    raise EOFError
        except EOFError:
            if interactive:
                session.out.write("\n")
            return 0
        except KeyboardInterrupt:
            session.out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            session.out.write("[conversation forgotten]\n")
            continue
        try:
            session.ask(text)
        except DaemonUnreachable:
            raise
        except ClientError as exc:  # the turn is dropped; the conversation goes on
            session.out.write(f"error: {exc.message}\n")
            session.out.flush()
