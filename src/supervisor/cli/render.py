"""What the command line prints: the status table, the memory line, load
progress (bars on a terminal, lines elsewhere), a streaming answer, and a
model's memory estimate."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import msgspec
from tqdm import tqdm

from ipc.messages import CacheCleared, LoadProgress, RankInfo, RunnerInfo, StatusReply
from supervisor.adapters import adapter_name
from supervisor.memory.estimate import OVERHEAD_SOURCE_TEXT, Estimate, describe_kv_cache
from supervisor.units import format_bytes, format_duration

__all__ = [
    "AnswerPrinter",
    "ProgressPrinter",
    "cache_cleared_line",
    "estimate_json",
    "memory_line",
    "render_estimate",
    "status_table",
]


def status_table(status: StatusReply) -> str:
    """The status as a table for people, like ``ollama ps``."""
    sup = status.supervisor
    lines = [
        f"supervisor pid {sup.pid}, version {sup.version}, up {format_duration(sup.uptime_s)}, "
        f"socket {sup.socket}",
        memory_line(status),
    ]
    spare = status.spare
    if spare is not None and spare.state == "failed":
        lines.append(f"hot spare failed: {spare.failure}")
    for stuck in sup.unkillable:
        held = f", holding {format_bytes(stuck.rss_bytes)}" if stuck.rss_bytes else ""
        lines.append(f"unkillable: pid {stuck.pid} (was {stuck.name}) outlived SIGKILL{held}")
    if not status.runners:
        lines.append("no models loaded")
        return "\n".join(lines)
    header = ("NAME", "MODEL", "PID", "STATE", "RSS", "MLX", "BUDGET", "UP", "REQS", "QUEUE",
              "CACHE", "RESTARTS", "LAST EXIT")  # fmt: skip
    now = time.time()
    rows: list[tuple[str, ...]] = [header]
    for r in status.runners:
        rows.append(_runner_row(r, now))
        rows.extend(_rank_row(rank) for rank in r.ranks)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def memory_line(status: StatusReply) -> str:
    """'memory: 12.1 GiB available of 24.0 GiB (49.6% used, threshold 70%), runners 1.2 GiB'."""
    system = status.system
    override = f", override {system.override_mb} MB" if system.override_mb is not None else ""
    return (
        f"memory: {format_bytes(system.memory_available_bytes)} available of "
        f"{format_bytes(system.memory_total_bytes)} ({system.pressure_pct:.1f}% used, "
        f"threshold {system.threshold_pct:g}%{override}), runners "
        f"{format_bytes(system.runners_bytes)}"
    )


def _runner_row(r: RunnerInfo, now: float) -> tuple[str, ...]:
    up = format_duration(now - r.started_at) if r.started_at and r.pid else "-"
    last = r.last_exit.cause if r.last_exit is not None else "-"
    if r.last_exit is not None and r.last_exit.cause_class not in ("unknown", "requested"):
        last = f"[{r.last_exit.cause_class}] {last}"
    if r.failure:
        last = r.failure
    mlx = None
    if r.mlx_active_bytes is not None:
        mlx = r.mlx_active_bytes + (r.mlx_cache_bytes or 0)
    return (
        r.name,
        _model_cell(r),
        str(r.pid) if r.pid is not None else "-",
        r.state,
        format_bytes(r.rss_bytes),
        format_bytes(mlx),
        format_bytes(r.memory_budget_bytes) + (" pinned" if r.pinned else ""),
        up,
        f"{r.active_requests}/{r.max_concurrent}",
        str(r.queue_depth),
        _cache_cell(r),
        str(r.restarts),
        last,
    )


def _rank_row(rank: RankInfo) -> tuple[str, ...]:
    """A line under a sharded model's own: one of its ranks."""
    mlx = format_bytes(rank.mlx_active_bytes) if rank.mlx_active_bytes is not None else "-"
    pid = str(rank.pid) if rank.pid is not None else "-"
    return (f"  rank {rank.rank}", rank.host, pid, rank.state,
            format_bytes(rank.rss_bytes), mlx, *("",) * 7)  # fmt: skip


def _model_cell(r: RunnerInfo) -> str:
    """The model's reference, then its LoRA adapters by name, the default first:
    'builtin:tiny + adapters tiny-adapter*, sql'."""
    if not r.adapters:
        return r.model
    names = [adapter_name(a) + ("*" if i == 0 else "") for i, a in enumerate(r.adapters)]
    return f"{r.model} + adapters {', '.join(names)}"


def _cache_cell(r: RunnerInfo) -> str:
    """'12.0 MiB, 3 (80% hits)': the prefix cache's bytes, entries and hit rate; then
    ', disk 200.0 MiB' when its disk tier is on, and ', kv 8-bit' when the KV
    cache is quantized."""
    kv = f", kv {r.kv_bits}-bit" if r.kv_bits is not None else ""
    cache = r.prefix_cache
    if cache is None:
        return ("off" if r.batching is not None else "-") + kv
    lookups = cache.hits + cache.misses
    rate = f" ({100 * cache.hits / lookups:.0f}% hits)" if lookups else ""
    tier = cache.disk  # None, or off with a reason: nothing to show
    disk = f", disk {format_bytes(tier.bytes)}" if tier is not None and tier.reason is None else ""
    return f"{format_bytes(cache.bytes)}, {cache.entries}{rate}{disk}{kv}"


def cache_cleared_line(cleared: CacheCleared, *, disk_only: bool = False) -> str:
    """What ``cache clear`` prints: 'NAME: prefix cache cleared (3 entries,
    12.0 MiB in RAM; 40 blocks, 200.0 MiB on disk)'; ``disk_only``: the disk
    part alone."""
    disk = f"{cleared.disk_entries} blocks, {format_bytes(cleared.disk_bytes)} on disk"
    ram = f"{cleared.entries} entries, {format_bytes(cleared.bytes)} in RAM; "
    return f"{cleared.name}: prefix cache cleared ({'' if disk_only else ram}{disk})"


_WEIGHTS_SOURCE_TEXT = {
    "safetensors": "exact, from the safetensors headers",
    "gguf": "computed from the GGUF header, dequantized as the runner converts it",
    "disk": "size of the files on disk",
    "builtin": "computed from the builtin recipe (not built yet)",
}


def render_estimate(estimate: Estimate, model: str) -> str:
    """The table ``mlx-supervisor estimate MODEL`` prints: one line per part, the total, and
    where the weights figure comes from."""
    source = OVERHEAD_SOURCE_TEXT.get(estimate.overhead_source, estimate.overhead_source)
    rows = [
        ("weights", estimate.weights_bytes),
        (f"KV cache ({describe_kv_cache(estimate)})", estimate.kv_cache_bytes),
        ("activations", estimate.activation_bytes),
        ("runner overhead", estimate.overhead_bytes),
        (f"  runtime ({source})", estimate.runtime_bytes),
    ]
    if estimate.vision:
        rows.append(("vision encoder", estimate.vision_bytes))
    if estimate.draft_model is not None:
        rows.append((f"draft model ({estimate.draft_model})", estimate.draft_bytes))
    rows += [
        ("total", estimate.total_bytes),
        ("headroom", estimate.headroom_bytes),
        ("planned", estimate.planned_bytes),
    ]
    label_width = max(len(label) for label, _ in rows)
    sizes = [format_bytes(n) for _, n in rows]
    size_width = max(len(size) for size in sizes)
    kind = "vision model" if estimate.vision else "text model"
    lines = [f"{model} ({kind})"]
    for (label, _), size in zip(rows, sizes, strict=True):
        lines.append(f"  {label:<{label_width}}  {size:>{size_width}}")
    source = _WEIGHTS_SOURCE_TEXT.get(estimate.weights_source, estimate.weights_source)
    lines.append(f"weights: {source}")
    if estimate.overhead_source == "default":
        lines.append("runtime: a default; a daemon plans what it measures on its warm spare")
    if estimate.path is not None:
        lines.append(f"path: {estimate.path}")
    return "\n".join(lines)


def estimate_json(estimate: Estimate) -> dict[str, Any]:
    """The estimate as a JSON object (``estimate --json``): every field of ``Estimate``, and
    ``planned_bytes``."""
    return {**msgspec.structs.asdict(estimate), "planned_bytes": estimate.planned_bytes}


PHASE_UNITS = {"weights": "layer", "fetch": "B", "convert": "tensor"}


class ProgressPrinter:
    """Shows load progress on stderr: a progress bar per phase on a terminal
    (tqdm), else a line when a phase starts and when it ends."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last_phase: tuple[int | None, str] = (None, "")
        self._bar: tqdm[Any] | None = None

    def __call__(self, p: LoadProgress) -> None:
        if self.tty:
            self._draw(p)
        elif (p.rank, p.phase) != self._last_phase or (p.done == p.total and p.total > 1):
            self.stream.write(_progress_line(p) + "\n")
            self.stream.flush()
        self._last_phase = (p.rank, p.phase)

    def _draw(self, p: LoadProgress) -> None:
        if self._bar is None or (p.rank, p.phase) != self._last_phase:
            self.finish()
            unit = PHASE_UNITS.get(p.phase, "step")
            self._bar = tqdm(total=p.total, desc=f"{_who(p)}: {p.phase}", unit=unit,
                             unit_scale=unit == "B", file=self.stream, leave=False,
                             dynamic_ncols=True)  # fmt: skip
        bar = self._bar
        if p.total != bar.total:
            bar.total = p.total
        if p.phase == "weights":
            bar.set_postfix_str(_memory_note(p), refresh=False)
        bar.update(p.done - bar.n)
        if p.done >= p.total:
            bar.refresh()  # the last step shows, whatever tqdm's refresh interval

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _memory_note(p: LoadProgress) -> str:
    note = f"MLX {format_bytes(p.active_bytes)}"
    if p.remaining_bytes is not None:
        note += f", {format_bytes(p.remaining_bytes)} left on the machine"
    return note


def _who(p: LoadProgress) -> str:
    return p.name if p.rank is None else f"{p.name} rank {p.rank}"


def _progress_line(p: LoadProgress) -> str:
    if p.phase == "weights":
        return f"loading {_who(p)}: layer {p.done}/{p.total} ({_memory_note(p)})"
    if p.phase == "fetch" and p.total > 1:
        return f"loading {_who(p)}: fetch {format_bytes(p.done)} of {format_bytes(p.total)}"
    return f"loading {_who(p)}: {p.phase}"


THINKING, DONE_THINKING = "[thinking]\n", "[done thinking]\n"
DIM, PLAIN = "\033[2m", "\033[0m"


@dataclass
class AnswerPrinter:
    """Writes an answer as it streams: a thinking model's thought first,
    between ``[thinking]`` and ``[done thinking]`` lines (dimmed on a
    terminal), then the text. The runner keeps the thought out of the text,
    so it is shown here or not at all. The newlines a template puts around
    a thought are left out of the display only (the history keeps them)."""

    out: TextIO
    thinking: bool = False
    line_open: bool = False  # the last thing written does not end its line
    trim: bool = False  # at a thought's start or just after it: leading newlines go

    def write(self, reasoning: str, text: str) -> None:
        """Show one frame's thought (if any), then its text."""
        if reasoning:
            if not self.thinking:
                self.out.write(THINKING + (DIM if self.out.isatty() else ""))
                self.thinking = self.trim = True
            self._write(reasoning)
        if text:
            self.end_thought()
            self._write(text)
        self.out.flush()

    def _write(self, piece: str) -> None:
        if self.trim:
            piece = piece.lstrip("\n")
            self.trim = not piece
        if piece:
            self.out.write(piece)
            self.line_open = not piece.endswith("\n")

    def end_thought(self) -> None:
        """Close the thought, if one is open (the answer ended inside it)."""
        if self.thinking:
            plain = PLAIN if self.out.isatty() else ""
            self.out.write(plain + ("\n" if self.line_open else "") + DONE_THINKING)
            self.thinking = self.line_open = False
            self.trim = True
