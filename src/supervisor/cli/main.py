"""The ``mlx-supervisor`` command line.

Exit codes: 0 success, 1 the operation failed (with a one-line reason, the
error's code first: ``error [unknown_model]: ...``),
2 usage error, 3 no daemon reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ipc.messages import ChatMessage, ReloadReply
from supervisor import __version__
from supervisor.cli.render import (
    AnswerPrinter,
    ProgressPrinter,
    cache_cleared_line,
    status_table,
)
from supervisor.client import Client, ClientError, DaemonUnreachable
from supervisor.config import ConfigError, load_config
from supervisor.daemon.paths import SOCKET_ENV, default_config_path, default_socket_path
from supervisor.units import format_bytes, parse_duration

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def config_file(given: Path | None) -> Path | None:
    """The config file to read: ``--config``, else the default one if it exists."""
    if given is not None:
        return given
    default = default_config_path()
    return default if default.exists() else None


def socket_path(given: Path | None, configured: str | None) -> Path:
    """Where the daemon's socket is, the same for ``serve`` and its clients:
    ``--socket`` (``given``), else ``$MLX_SUPERVISOR_SOCKET``, else the
    config's ``socket_path`` (``configured``), else the per-user runtime dir."""
    if given is not None:
        return given
    if configured and not os.environ.get(SOCKET_ENV):
        return Path(configured).expanduser()
    return default_socket_path()


def client_for(args: argparse.Namespace) -> Client:
    """A client of the daemon that ``serve`` with the same options and config
    would run. Raises ConfigError: the config file cannot be read (for
    ``reload``, only when its socket_path cannot be: the daemon judges the rest)."""
    path = config_file(args.config)
    configured = None
    if path is not None:
        try:
            configured = load_config(path).socket_path
        except ConfigError:
            if args.command != "reload":
                raise
            if args.socket is None and not os.environ.get(SOCKET_ENV):
                configured = configured_socket(path)
    return Client(socket_path(args.socket, configured))


def configured_socket(path: Path) -> str | None:
    """The socket_path of a config file that is otherwise invalid (a reload
    of it is refused by the daemon, with the reason), when its TOML parses.

    Raises:
        ConfigError: the file cannot be read, or is not TOML.
    """
    try:
        data = msgspec.toml.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    value = data.get("socket_path") if isinstance(data, dict) else None
    return value if isinstance(value, str) and value else None


def cmd_serve(args: argparse.Namespace) -> int:
    from supervisor.config import with_http_override
    from supervisor.daemon.logs import configure_logging
    from supervisor.daemon.main import run_daemon
    from supervisor.fronts.control import DaemonAlreadyRunning
    from supervisor.memory.monitor import override_mb
    from supervisor.security import InsecurePath

    path = config_file(args.config)
    if path is not None:
        path = path.expanduser().absolute()  # what `reload` reads again, wherever we are then
    try:
        config = with_http_override(load_config(path), args.http)
        override_mb(config.memory_override_mb)  # a bad OVERRIDE_MEMORY_MB stops us here
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    configure_logging()
    try:
        run_daemon(config, socket_path(args.socket, config.socket_path), path, args.http)
    except (DaemonAlreadyRunning, FileExistsError, InsecurePath) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_load(args: argparse.Namespace, client: Client) -> int:
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --env wants KEY=VALUE, got {item!r}", file=sys.stderr)
            return EXIT_USAGE
        env[key] = value
    progress = ProgressPrinter()
    try:
        loaded = client.load(
            args.model,
            args.name,
            max_tokens=args.max_tokens,
            env=env,
            restart=args.restart,
            keep_alive_s=args.keep_alive,
            pinned=True if args.pin else None,
            context_tokens=args.context,
            max_concurrent=args.max_concurrent,
            prefix_cache=False if args.no_prefix_cache else None,
            ranks=args.ranks,
            hostfile=str(Path(args.hostfile).resolve()) if args.hostfile else None,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            on_progress=progress,
            draft_model=args.draft_model,
            num_draft_tokens=args.num_draft_tokens,
        )
    finally:
        progress.finish()
    print(
        f"{loaded.name} ready: pid {loaded.pid}, {format_bytes(loaded.param_bytes)} of weights, "
        f"loaded in {loaded.load_s:.2f}s"
    )
    return EXIT_OK


def cmd_generate(args: argparse.Namespace, client: Client) -> int:
    messages = [ChatMessage("user", args.prompt)] if args.chat else None
    gen = client.generate(
        args.name,
        None if args.chat else args.prompt,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        cache=not args.no_cache,
        stop=args.stop,
    )
    printer = AnswerPrinter(sys.stdout)  # a thinking model's thought first, marked
    with gen:
        try:
            for text in gen:
                printer.write(gen.chunk.reasoning if gen.chunk else "", text)
        except KeyboardInterrupt:
            gen.cancel()
            for text in gen:
                printer.write(gen.chunk.reasoning if gen.chunk else "", text)
        finally:
            printer.end_thought()
    done = gen.done
    assert done is not None
    sys.stdout.write("\n")
    if args.json:
        summary = {
            "prompt_tokens": done.prompt_tokens,
            "generation_tokens": done.generation_tokens,
            "ttft_s": gen.ttft_s,
            "generation_tps": done.generation_tps,
            "prompt_tps": done.prompt_tps,
            "peak_memory_bytes": done.peak_memory_bytes,
            "finish_reason": done.finish_reason,
            "max_tokens_clamped_to": done.max_tokens_clamped_to,
            "detail": done.detail,
            "cached_tokens": done.cached_tokens,
            "batched": done.batched,
            "reasoning": gen.reasoning,
            "reasoning_tokens": done.reasoning_tokens,
            "draft_tokens": done.draft_tokens,
            "draft_accepted": done.draft_accepted,
        }
        sys.stdout.write(json.dumps(summary) + "\n")
    if done.max_tokens_clamped_to is not None:
        print(f"note: max_tokens clamped to the model's cap, {done.max_tokens_clamped_to}",
              file=sys.stderr)  # fmt: skip
    if done.finish_reason == "memory_pressure":
        print(f"error: stopped by the memory guard: {done.detail}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_unload(args: argparse.Namespace, client: Client) -> int:
    unloaded = client.unload(args.name)
    steps = " -> ".join(unloaded.steps) or "nothing to stop"
    print(
        f"{unloaded.name} unloaded: pid {unloaded.pid} reaped in {unloaded.elapsed_s:.2f}s "
        f"({steps}; {unloaded.exit.cause})"
    )
    return EXIT_OK


def cmd_status(args: argparse.Namespace, client: Client) -> int:
    if args.watch is not None:
        return watch_status(client, args.watch)
    status = client.status()
    if args.json:
        print(msgspec.json.encode(status).decode())
    else:
        print(status_table(status))
    return EXIT_OK


def watch_status(client: Client, interval_s: float) -> int:
    """Redraw the status table every ``interval_s`` until Ctrl-C (a terminal
    is cleared first; elsewhere tables follow each other)."""
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            table = status_table(client.status())
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"{clear}{table}\n(every {interval_s:g}s, {stamp}; Ctrl-C stops)\n")
            sys.stdout.flush()
            time.sleep(interval_s)  # a display refresh, not a wait for an event
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_chat(args: argparse.Namespace, client: Client) -> int:
    from supervisor.cli.chat import ChatSession, run_chat

    session = ChatSession(client, args.name, system=args.system, max_tokens=args.max_tokens,
                          temperature=args.temperature)  # fmt: skip
    return run_chat(session)


def cmd_cache(args: argparse.Namespace, client: Client) -> int:
    cleared = client.clear_cache(args.name, disk_only=args.disk_only)
    print(cache_cleared_line(cleared, disk_only=args.disk_only))
    return EXIT_OK


def cmd_reload(args: argparse.Namespace, client: Client) -> int:
    reply = client.reload()
    if args.json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(reload_lines(reply), file=sys.stdout if reply.ok else sys.stderr)
    return EXIT_OK if reply.ok else EXIT_FAILED


def reload_lines(reply: ReloadReply) -> str:
    """A reload's reply for people, one fact a line."""
    if not reply.ok:
        key = f" (key {reply.key})" if reply.key else ""
        return f"error: reload refused{key}: {reply.error}\nthe running config is unchanged"
    lines = [f"reloaded {reply.path}"]

    def listed(label: str, names: list[str]) -> None:
        if names:
            lines.append(f"{label}: {', '.join(names)}")

    listed("added", reply.added)
    listed("preloading", reply.preloading)
    listed("removed", reply.removed)
    listed("unloaded", reply.unloaded)
    listed("unloading once their requests end", reply.unloading)
    for change in reply.changed:
        if not change.loaded:
            keys = ", ".join(change.now)
            lines.append(f"{change.name} (not loaded): {keys} apply when it loads")
            continue
        if change.now:
            lines.append(f"{change.name}: {', '.join(change.now)} apply to new requests now")
        if change.next_load:
            lines.append(f"{change.name}: {', '.join(change.next_load)} apply at its next load")
    listed("daemon keys applied now", reply.daemon_now)
    listed("daemon keys applied at each model's next load", reply.daemon_next_load)
    listed("daemon keys that need a restart (not applied)", reply.needs_restart)
    if len(lines) == 1:
        lines.append("nothing changed")
    return "\n".join(lines)


def cmd_shutdown(args: argparse.Namespace, client: Client) -> int:
    ack = client.shutdown()
    print(f"daemon stopped ({ack.runners} runner(s) stopped)")
    return EXIT_OK


def cmd_service(args: argparse.Namespace) -> int:
    from supervisor.daemon.service import install_hint, render_service, service_install_path

    config = args.config.resolve() if args.config else None
    try:
        configured = load_config(config).socket_path if config is not None else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sock = socket_path(args.socket, configured)
    command = [sys.executable, "-m", "supervisor", "serve"]
    sys.stdout.write(
        render_service(args.kind, command=command, socket_path=sock, config_path=config)
    )
    print(
        f"\n# save as {service_install_path(args.kind)}, then:\n"
        + "\n".join(f"#   {line}" for line in install_hint(args.kind).splitlines()),
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_estimate(args: argparse.Namespace) -> int:
    from supervisor.cli.render import estimate_json, render_estimate
    from supervisor.memory.estimate import estimate_reference

    try:
        estimate = estimate_reference(args.model, args.context, kv_bits=args.kv_bits,
                                      kv_group_size=args.kv_group_size or 64)  # fmt: skip
    except (OSError, ValueError) as exc:
        print(f"error: cannot estimate {args.model}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if estimate is None:
        print(f"error: {args.model} is not on this machine (nothing to measure)", file=sys.stderr)
        return EXIT_FAILED
    if args.ranks > 1:  # what one rank of a group holds
        from supervisor.memory.ranks import group_estimate

        estimate = group_estimate(estimate, args.ranks, local=1)
    if args.json:
        print(json.dumps(estimate_json(estimate)))
    else:
        print(render_estimate(estimate, args.model))
    return EXIT_OK


def _kv_arguments(p: argparse.ArgumentParser) -> None:
    """``--kv-bits`` and ``--kv-group-size``, as a model's kv_bits and kv_group_size."""
    p.add_argument("--kv-bits", type=int, choices=[4, 8],
                   help="quantize the KV cache to 4 or 8 bits (default: off)")  # fmt: skip
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128],
                   help="values per scale and bias of the quantized KV cache (default 64; "
                        "use 32 with 4-bit on small models)")  # fmt: skip


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"want seconds from 0.1 to 3600, got {text!r}")
    return seconds


def cmd_demo(args: argparse.Namespace) -> int:
    from supervisor.cli.demo import run_demo

    return run_demo(args.model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-supervisor",
        description="Supervise local MLX language models, one runner process per model.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    socket_parent = argparse.ArgumentParser(add_help=False)
    socket_parent.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"daemon socket (default: ${SOCKET_ENV}, else the config's socket_path, else "
        "the per-user runtime dir)",
    )
    socket_parent.add_argument(
        "--config", type=Path, help="TOML config (default: config.toml in the XDG config dir)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", parents=[socket_parent], help="run the daemon in the foreground")
    p.add_argument("--http", metavar="HOST:PORT|off",
                   help="OpenAI-compatible HTTP front (default: $MLX_SUPERVISOR_HTTP, else the "
                   "config's http_listen, 127.0.0.1:11480); port 0 picks a free one")  # fmt: skip

    p = sub.add_parser("load", parents=[socket_parent], help="load a model into a new runner")
    p.add_argument("model", help="Hugging Face repo id, local directory or builtin:tiny")
    p.add_argument("--name", help="name to use for it (default: derived from the model)")
    p.add_argument("--max-tokens", type=int, help="cap on max_tokens of every request")
    p.add_argument("--restart", choices=["always", "on-failure", "never"],
                   help="when to restart a dead runner (default: the daemon's)")  # fmt: skip
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for the runner (repeatable)")  # fmt: skip
    p.add_argument("--keep-alive", type=_duration, metavar="DURATION",
                   help="unload after this long idle: 30s, 5m, 2h; 0 keeps it (default: "
                   "the daemon's keep_alive_s)")  # fmt: skip
    p.add_argument("--max-concurrent", type=int, metavar="N",
                   help="requests served side by side (default: the daemon's, 8)")  # fmt: skip
    p.add_argument("--ranks", type=int, metavar="N",
                   help="shard the model over N processes with mx.distributed (ring over "
                        "loopback), supervised as one unit")  # fmt: skip
    p.add_argument("--hostfile", metavar="FILE",
                   help="shard the model over the hosts of an mlx.launch hostfile (JSON), "
                        "one rank per host; others than this one through ssh")  # fmt: skip
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="keep no KV prefix cache for this model")  # fmt: skip
    p.add_argument("--pin", action="store_true",
                   help="never evict or expire this model")  # fmt: skip
    p.add_argument("--draft-model", metavar="MODEL",
                   help="speculative decoding: a smaller model with the same tokenizer "
                        "(e.g. builtin:small-draft for builtin:small)")  # fmt: skip
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="tokens the draft proposes per step (default 3)")  # fmt: skip
    _kv_arguments(p)
    p.add_argument(
        "--context",
        type=int,
        metavar="TOKENS",
        help="context the memory estimate plans for (default: min(model's, 8192))",
    )

    p = sub.add_parser("estimate", help="how much memory a model needs (no daemon needed)")
    p.add_argument("model", help="Hugging Face repo id, local directory or builtin:tiny")
    p.add_argument("--context", type=int, metavar="TOKENS", help="context tokens to plan for")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="what one rank holds when the model is sharded over N")  # fmt: skip
    _kv_arguments(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("generate", parents=[socket_parent], help="stream a generation")
    p.add_argument("name")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int,
                   help="default: the model's default_max_tokens, else 256")  # fmt: skip
    p.add_argument("--temperature", type=float,
                   help="default: the model's configured temperature, else 0 (greedy)")  # fmt: skip
    p.add_argument("--top-p", type=float, help="default: the model's configured top_p, else 1")
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="send PROMPT as a chat message")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before TEXT (may be given up to 4 times)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--no-cache", action="store_true",
                   help="neither use nor fill the model's prefix cache")  # fmt: skip

    p = sub.add_parser("unload", parents=[socket_parent], help="stop a model's runner")
    p.add_argument("name")

    p = sub.add_parser("status", aliases=["ps"], parents=[socket_parent],
                       help="the daemon and its runners (ps: the same)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", type=_interval, nargs="?", const=2.0, metavar="SECONDS",
                   help="redraw the table every SECONDS (default 2) until Ctrl-C")  # fmt: skip

    p = sub.add_parser("chat", parents=[socket_parent], help="chat with a loaded model")
    p.add_argument("name")
    p.add_argument("--system", help="a system prompt for the conversation")
    p.add_argument("--max-tokens", type=int,
                   help="per answer (default: the model's default_max_tokens, else 256)")
    p.add_argument("--temperature", type=float,
                   help="default: the model's configured temperature, else 0 (greedy)")  # fmt: skip

    sub.add_parser("shutdown", parents=[socket_parent], help="stop all runners and the daemon")

    p = sub.add_parser("reload", parents=[socket_parent],
                       help="read the daemon's config file again (as SIGHUP does)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the reply as JSON")

    p = sub.add_parser("cache", help="manage a model's prefix cache")
    cache_sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    cp = cache_sub.add_parser(
        "clear", parents=[socket_parent], help="drop the model's KV prefix cache (it stays loaded)"
    )
    cp.add_argument("name")
    cp.add_argument("--disk-only", action="store_true",
                    help="drop only the blocks kept on disk (the RAM tier stays)")  # fmt: skip

    p = sub.add_parser("service", help="print a launchd plist or systemd unit")
    service_sub = p.add_subparsers(dest="service_command", required=True)
    sp = service_sub.add_parser("print", parents=[socket_parent])
    sp.add_argument("kind", choices=["launchd", "systemd"])

    p = sub.add_parser("demo", help="a guided tour on a real small model with a private daemon")
    p.add_argument("--model", default="builtin:smollm2",
                   help="builtin:smollm2 (builtin:tiny if it cannot be had)")  # fmt: skip
    return parser


CLIENT_COMMANDS = {
    "load": cmd_load,
    "generate": cmd_generate,
    "unload": cmd_unload,
    "status": cmd_status,
    "ps": cmd_status,
    "chat": cmd_chat,
    "shutdown": cmd_shutdown,
    "reload": cmd_reload,
    "cache": cmd_cache,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "service":
        return cmd_service(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "estimate":
        return cmd_estimate(args)
    try:
        client = client_for(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return CLIENT_COMMANDS[args.command](args, client)
    except DaemonUnreachable as exc:
        print(f"error [{exc.code}]: {exc.message}; is `mlx-supervisor serve` running?",
              file=sys.stderr)  # fmt: skip
        return EXIT_UNREACHABLE
    except ClientError as exc:  # the code first, for scripts: error [insufficient_memory]: ...
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
