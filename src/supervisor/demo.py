"""``mlx-supervisor demo``: a guided tour with a private daemon.

Starts a daemon on a socket in a temp dir, loads a model (``builtin:tiny``
by default), streams a generation, kills the runner with SIGKILL mid-stream
to show the crash being noticed, loads again, unloads and shows the memory
coming back, then shuts the daemon down. Everything is real: processes,
sockets, mlx-lm.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ipc.messages import LoadProgress
from supervisor.cli import status_table
from supervisor.client import Client, ClientError
from supervisor.spawn import DaemonProcess
from supervisor.units import format_bytes


def step(number: int, title: str) -> None:
    print(f"\n\033[1m[{number}] {title}\033[0m" if sys.stdout.isatty() else f"\n[{number}] {title}")


def show_progress(p: LoadProgress) -> None:
    if p.phase == "weights" and p.done == p.total:
        print(f"    evaluated {p.total} layer groups, {format_bytes(p.active_bytes)} active")


def run_demo(model: str = "builtin:tiny") -> int:
    """Run the tour; returns the exit code (0 when every step worked)."""
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-demo-") as tmp:
        socket_path = Path(tmp) / "demo.sock"
        log_path = Path(tmp) / "daemon.log"
        step(1, "Start a private daemon")
        # A private state dir too: the demo's models must not come back in a real daemon.
        env = {"XDG_STATE_HOME": str(Path(tmp) / "state")}
        with DaemonProcess(socket_path, env=env, log_file=log_path) as daemon:
            print(f"    daemon pid {daemon.pid}, socket {socket_path}")
            client = Client(socket_path)
            code = _tour(client, model)
            step(9, "Shut the daemon down")
            ack = client.shutdown()
            exit_code = daemon.wait()
            print(f"    daemon exited with code {exit_code}; {ack.runners} runner(s) stopped")
            left = [p.pid for p in psutil.Process().children(recursive=True)]
            print(f"    child processes left: {len(left)}")
        print("\ndone: every step above ran on real processes." if code == 0 else "\nfailed")
        return code


def _tour(client: Client, model: str) -> int:
    name = "demo"
    available_before = psutil.virtual_memory().available
    step(2, f"Load {model} into its own runner process")
    loaded = client.load(model, name, on_progress=show_progress)
    print(
        f"    ready: runner pid {loaded.pid}, {format_bytes(loaded.param_bytes)} of weights, "
        f"load took {loaded.load_s:.2f}s in the runner"
    )

    step(3, "Stream a generation (random weights: the text is gibberish by design)")
    with client.generate(name, "The supervisor says", max_tokens=24) as gen:
        sys.stdout.write("    ")
        for text in gen:
            sys.stdout.write(text.replace("\n", " "))
            sys.stdout.flush()
    assert gen.done is not None
    print(
        f"\n    {gen.done.generation_tokens} tokens at {gen.done.generation_tps:.0f} tok/s, "
        f"first token after {1000 * (gen.ttft_s or 0):.1f} ms"
    )

    step(4, "Status (like `ollama ps`)")
    print("    " + status_table(client.status()).replace("\n", "\n    "))

    step(5, f"SIGKILL the runner (pid {loaded.pid}) in the middle of a generation")
    with client.generate(name, "Count forever", max_tokens=100_000) as gen:
        next(gen)
        killed_at = time.perf_counter()
        os.kill(loaded.pid, signal.SIGKILL)
        try:
            for _ in gen:
                pass
            print("    unexpected: the generation finished")
            return 1
        except ClientError as exc:
            noticed_ms = 1000 * (time.perf_counter() - killed_at)
            print(f"    the request ended {noticed_ms:.0f} ms after the kill: {exc.message}")
    runner = next(r for r in client.status().runners if r.name == name)
    last = runner.last_exit
    print(f"    state now: {runner.state}; last exit: {last.cause if last else '-'}")

    step(6, "The supervisor restarts it by itself (a request just waits for it)")
    text, done = client.generate_text(name, "Back again", max_tokens=12)
    ready_s = time.perf_counter() - killed_at
    runner = next(r for r in client.status().runners if r.name == name)
    print(
        f"    ready again {ready_s:.2f}s after the kill: new pid {runner.pid}, "
        f"restarts {runner.restarts}"
    )
    print(f"    {done.generation_tokens} tokens: {text!r}")

    step(7, "Unload: the runner exits, and its memory goes back to the system")
    rss = next(r.rss_bytes for r in client.status().runners if r.name == name)
    available_loaded = psutil.virtual_memory().available
    unloaded = client.unload(name)
    available_after = psutil.virtual_memory().available
    print(
        f"    pid {unloaded.pid} reaped in {unloaded.elapsed_s * 1000:.0f} ms "
        f"(steps: {', '.join(unloaded.steps)})"
    )
    alive = psutil.pid_exists(unloaded.pid)
    print(f"    process still there? {alive}; its RSS was {format_bytes(rss)}")
    print(
        "    system available memory: "
        f"before load {format_bytes(available_before)}, loaded {format_bytes(available_loaded)}, "
        f"after unload {format_bytes(available_after)}"
    )

    step(8, "Status after unload")
    print("    " + status_table(client.status()).replace("\n", "\n    "))
    return 0
