"""Family 1a of ``bench_http.py``: decode tokens/s of one stream through HTTP, ours /
mlx_lm.server, beside the same request through our socket, with CPU seconds per token.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from common import (
    cpu_s_each,
    cpu_time,
    note,
    quotient,
    verdict,
)
from http_common import (
    DECODE_USER,
    OURS,
    SHORT_NAMES,
    SOCKET,
    THEIRS,
    Sides,
    agreement,
    counts,
    messages_for,
    pair_record,
)
from supervisor.figures import median, render_table

DECODE_TARGET = 1.0  # ours / theirs, tokens/s: at least


# Every order of the three sides, arranged so that ours and theirs take turns at going
# first of the two (even rounds: ours before theirs); the socket's place moves too.
DECODE_ORDERS = (
    (OURS, THEIRS, SOCKET), (THEIRS, OURS, SOCKET), (OURS, SOCKET, THEIRS),
    (THEIRS, SOCKET, OURS), (SOCKET, OURS, THEIRS), (SOCKET, THEIRS, OURS),
)  # fmt: skip


def decode_family(sides: Sides, rounds: int, max_tokens: int) -> dict[str, Any]:
    """``rounds`` rounds of one long streamed request on each side (ours over HTTP,
    mlx_lm.server, and ours through the socket, to tell the HTTP layer from the runner),
    in the orders of DECODE_ORDERS; a fresh prompt per round, the same for every side.
    Around each request, the CPU seconds of our runner, our daemon and mlx_lm.server."""
    pairs = []
    for r in range(rounds):
        messages = messages_for("Story", r, DECODE_USER)
        order = DECODE_ORDERS[r % len(DECODE_ORDERS)]
        samples = {}
        for side in order:
            at_first = functools.partial(cpu_s_each, sides.pids)
            if side == OURS:
                sample = sides.ours(messages, max_tokens, at_first=at_first)
            elif side == THEIRS:
                sample = sides.theirs(messages, max_tokens, at_first=at_first)
            else:
                sample = sides.path(SOCKET, messages, max_tokens, at_first=at_first)
            after = cpu_s_each(sides.pids)
            first = sample.extra.pop("at_first", {})
            sample.extra["decode_cpu_s"] = {k: after[k] - first[k] for k in after if k in first}
            samples[side] = sample
        ours, theirs, via_socket = samples[OURS], samples[THEIRS], samples[SOCKET]
        pair = pair_record(r, ours, theirs)
        pair["order"] = list(order)
        pair[SOCKET] = via_socket.record()
        pair["same_tokens_socket"] = via_socket.completion_tokens == ours.completion_tokens
        pair["same_text_socket"] = via_socket.text == ours.text
        pair["tps_ratio"] = quotient(ours.decode_tps, theirs.decode_tps)
        pair["http_over_socket"] = quotient(ours.decode_tps, via_socket.decode_tps)
        pairs.append(pair)
        note(
            f"  decode {sides.name} round {r} ({', '.join(order)}): "
            + ", ".join(
                f"{side} {samples[side].decode_tps or 0:.1f} tok/s "
                f"({samples[side].completion_tokens} tok, {samples[side].content_chunks} chunks)"
                for side in (OURS, THEIRS, SOCKET)
            )
        )
    ratios = [p["tps_ratio"] for p in pairs if p["tps_ratio"] is not None]
    result: dict[str, Any] = {
        "rounds": rounds,
        "max_tokens": max_tokens,
        "tps_ratio": median(ratios),
        "tps_ratio_min": min(ratios, default=None),
        "tps_ratio_max": max(ratios, default=None),
        "http_over_socket": median(
            p["http_over_socket"] for p in pairs if p["http_over_socket"] is not None
        ),
        "same_tokens_socket": sum(p["same_tokens_socket"] for p in pairs),
        "same_text_socket": sum(p["same_text_socket"] for p in pairs),
    }
    for side in (OURS, THEIRS, SOCKET):
        result[f"tps_{side}"] = median(
            p[side]["decode_tps"] for p in pairs if p[side]["decode_tps"]
        )
        result[f"chunks_{side}"] = median(p[side]["content_chunks"] for p in pairs)
        for process in sides.pids:
            result[f"cpu_per_token_{side}_{process}_s"] = median(
                p[side]["decode_cpu_s"].get(process, math.nan) / (p[side]["completion_tokens"] - 1)
                for p in pairs
            )
        worker = "server" if side == THEIRS else "runner"
        result[f"busy_{side}"] = median(
            p[side]["decode_cpu_s"].get(worker, math.nan) / p[side]["decode_s"] for p in pairs
        )
    result.update(agreement(pairs))
    result["samples"] = pairs
    return result


def decode_table(results: dict[str, dict[str, Any]]) -> str:
    header = [
        "model", "rounds", "max tok", "tok/s ours", "theirs", "ours/theirs", "(min-max)",
        f"target>={DECODE_TARGET:g}", "ours via socket", "HTTP/socket", "tokens ours", "theirs",
        "same tokens", "same text", "chunks ours", "theirs", "CPU/token ours", "theirs",
        "busy ours", "theirs", "socket",
    ]  # fmt: skip
    rows = []
    for model, d in results.items():
        ours_cpu = d[f"cpu_per_token_{OURS}_runner_s"] + d[f"cpu_per_token_{OURS}_daemon_s"]
        rows.append([
            SHORT_NAMES[model], str(d["rounds"]), str(d["max_tokens"]),
            f"{d[f'tps_{OURS}']:.1f}", f"{d[f'tps_{THEIRS}']:.1f}", f"{d['tps_ratio']:.3f}",
            f"{d['tps_ratio_min']:.2f}-{d['tps_ratio_max']:.2f}",
            verdict(d["tps_ratio"] >= DECODE_TARGET),
            f"{d[f'tps_{SOCKET}']:.1f}", f"{d['http_over_socket']:.2f}",
            counts(d["completion_tokens_ours"]), counts(d["completion_tokens_theirs"]),
            f"{d['same_tokens']}/{d['pairs']}", f"{d['same_text']}/{d['pairs']}",
            f"{d[f'chunks_{OURS}']:.0f}", f"{d[f'chunks_{THEIRS}']:.0f}",
            cpu_time(ours_cpu), cpu_time(d[f"cpu_per_token_{THEIRS}_server_s"]),
            f"{d[f'busy_{OURS}']:.2f}", f"{d[f'busy_{THEIRS}']:.2f}", f"{d[f'busy_{SOCKET}']:.2f}",
        ])  # fmt: skip
    title = (
        "1a. Decode, one stream through HTTP: POST /v1/chat/completions, stream: true, greedy, "
        "ours (the daemon's HTTP front) vs mlx_lm.server on the same model directory; beside "
        "them ours through the socket (Client.generate). tok/s client-side = (completion "
        "tokens - 1) / (last content chunk - first content chunk); medians over rounds, "
        "ratios: medians of per-round ratios; ours and theirs take turns at going first; a "
        "fresh prompt per round. CPU/token: user + system CPU seconds from the first content "
        "chunk to the end, per token after the first; ours = runner + daemon, theirs = "
        "mlx_lm.server. busy: the runner's (theirs: mlx_lm.server's) CPU seconds over the "
        "same span / its wall time (1.00 = one core all the time)."
    )
    return title + "\n" + render_table(header, rows)
