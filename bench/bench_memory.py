"""The memory-safety layer: how good its estimate is and what admission costs.

Usage::

    python bench/bench_memory.py [--reps 5] [--out bench/results/memory.json]

Figures, each measured side by side in this one run (see bench/README.md):

1. Estimator error: the pre-load estimate / the runner's measured peak, after a
   load and one 512-token generation, for builtin:tiny, builtin:small and
   builtin:smollm2, on a daemon with its hot spare (whose measured footprint is
   the estimate's runtime). The peak is the process's VmHWM (peak RSS, /proc)
   and, separately, MLX's peak (from the runner's pongs, as ``status`` reports
   it). Two estimates: the daemon's (its ``model_estimate`` log record: KV cache
   planned for up to 8192 tokens) and the same planned for the context actually
   used (prompt + generated tokens), each alone and planned (+ headroom). The
   target: at the used context, estimate >= peak and planned <= 1.3 x peak.
2. Memory gate: client.unload of builtin:small returns -> the next load is
   ``admitted`` (the daemon's log), / the same load with nothing unloaded
   before it; and the share of the departed runner's memory back by then
   (``returned_share`` of ``memory_gate_passed``). Medians over --reps; the
   ratio is the median of the per-rep ratios.
3. Admission with eviction: a load that fits only once an idle model is evicted
   (a simulated machine: ``memory_override_mb``) -> ready, / the same load on a
   daemon whose simulated machine has room for both. Medians over --reps (the
   ratio: of the per-rep ratios); the log must show exactly one eviction per
   load on the first, none on the other.
4. The daemon's own RSS with 4 builtin:tiny runners loaded, against 100 MB,
   beside the same daemon's RSS with no runner (at its start) and the mean
   runner RSS.
5. Refusal of a load that cannot fit even with every idle model gone (two idle
   builtin:tiny under ``memory_override_mb``): client.load -> its
   ``insufficient_memory`` error, / an unknown model's ``unknown_model`` error
   from the same daemon, in alternating order. Medians over --reps (the ratio:
   of the per-rep ratios); nothing may be evicted, both pids unchanged.

Times on the daemon side come from its own JSON log (UTC, microseconds),
against the wall clock read here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    Daemon,
    alternate,
    first_record,
    load_average,
    machine_info,
    mlx_device,
    ms,
    note,
    runner_info,
    verdict,
    write_json,
)
from ipc.messages import RunnerInfo
from supervisor.client import Client, ClientError
from supervisor.daemon.logs import log_time
from supervisor.figures import median, render_table
from supervisor.memory.estimate import Estimate, estimate_reference, with_runtime
from supervisor.system import process_peak_rss, process_rss
from supervisor.units import format_bytes

DEFAULT_OUT = RESULTS_DIR / "memory.json"
MiB = 1 << 20
MODELS = ("builtin:tiny", "builtin:small", "builtin:smollm2")
TARGET_MAX_RATIO = 1.3  # figure 1: planned / peak at the used context; the estimate >= peak
PROMPT = "Hello"
DECODE_TOKENS = 512  # figure 1: the generation before the peak is read
SHORT_TOKENS = 4  # figures 3-4: a generation on each model, so it has served once
PING_TIMEOUT_S = 1.0  # figure 1: pongs (with the MLX figures) every 0.25 s
UNLOADED_MODEL = "builtin:small"  # figure 2: real memory to give back
NEXT_MODEL = "builtin:tiny"  # figure 2: the load that waits on the gate (quick to start)
EVICT_MODEL = "builtin:tiny"  # figure 3: quick to start, so eviction's own cost shows
TIGHT_FACTOR = 1.5  # figure 3: simulated machine = this x the estimate: room for one
ROOMY_FACTOR = 3.0  # the anchor's: room for two
RSS_RUNNERS = ("a", "b", "c", "d")  # figure 4
RSS_TARGET_BYTES = 100_000_000
NEVER_FITS_CONTEXT = 200_000  # figure 5: builtin:small planned for this: far over the machine
CLIENT_TIMEOUT_S = 600  # the 512-token generation on builtin:small takes up to ~4 min here


# --- figure 1: the estimate against the measured peak ---------------------------


def after_pongs(client: Client, name: str, intervals: int = 3) -> list[RunnerInfo]:
    """``status`` of ``name`` read every 50 ms over ``intervals`` ping periods.

    The runner refreshes its MLX figures just after it sends ``done``, and only a later pong
    carries them. Pongs are not logged, so ``DaemonProcess.wait_until`` (which re-checks on
    each log line) cannot see one come: this waits three ping periods (0.75 s), enough for at
    least two pongs sent after the refresh.
    """
    period_s = PING_TIMEOUT_S / 4
    deadline = time.monotonic() + intervals * period_s
    readings = [runner_info(client, name)]
    while time.monotonic() < deadline:
        time.sleep(0.05)
        readings.append(runner_info(client, name))
    return readings


def estimator_error(stack: ExitStack, tmp: Path) -> list[dict[str, Any]]:
    """Per model, on a daemon with its hot spare: settle (the spare warm, so admission measures
    it), load, generate, read the peaks; the daemon's estimate is its own log record, and the
    used-context one the same model's estimate with the runtime that record carries."""
    config = f"ping_timeout_s = {PING_TIMEOUT_S}\n"
    d = Daemon.start(stack, tmp, "estimate", config, client_timeout_s=CLIENT_TIMEOUT_S)
    daemon, client = d.process, d.client
    rows = []
    for model in MODELS:
        name = model.removeprefix("builtin:")
        note(f"figure 1: {model}, load + {DECODE_TOKENS} tokens")
        d.settle(timeout_s=CLIENT_TIMEOUT_S)
        client.load(model, name)
        daemon_estimate = Estimate(**{
            key: value for key, value in first_record(daemon, "model_estimate", model=name).items()
            if key in Estimate.__struct_fields__
        })  # fmt: skip
        _, done = client.generate_text(name, PROMPT, max_tokens=DECODE_TOKENS)
        readings = after_pongs(client, name)
        info = readings[-1]
        assert info.pid is not None and info.mlx_peak_bytes is not None
        hwm = process_peak_rss(info.pid)  # VmHWM: the runner must still be alive
        if hwm is None:
            raise RuntimeError(f"no VmHWM for pid {info.pid}")
        client.unload(name)
        context = done.prompt_tokens + done.generation_tokens
        reference = estimate_reference(model, context)
        assert reference is not None
        used = with_runtime(reference, daemon_estimate.runtime_bytes,
                            daemon_estimate.overhead_source)  # fmt: skip
        rows.append({
            "model": model,
            "prompt_tokens": done.prompt_tokens,
            "generation_tokens": done.generation_tokens,
            "vm_hwm_bytes": hwm,
            "mlx_peak_bytes": info.mlx_peak_bytes,
            "mlx_peak_before_pong_bytes": readings[0].mlx_peak_bytes,
            "generation_peak_bytes": done.peak_memory_bytes,  # mx peak of the request alone
            "rss_bytes": info.rss_bytes,
            "daemon_estimate_bytes": info.estimate_bytes,
            "runtime_bytes": daemon_estimate.runtime_bytes,
            "overhead_source": daemon_estimate.overhead_source,
            "estimate_default": estimate_row(daemon_estimate),
            "estimate_used_context": estimate_row(used),
            "ratio_default_vs_hwm": daemon_estimate.total_bytes / hwm,
            "ratio_default_planned_vs_hwm": daemon_estimate.planned_bytes / hwm,
            "ratio_default_vs_mlx_peak": daemon_estimate.total_bytes / info.mlx_peak_bytes,
            "ratio_used_vs_hwm": used.total_bytes / hwm,
            "ratio_used_planned_vs_hwm": used.planned_bytes / hwm,
            "ratio_used_vs_mlx_peak": used.total_bytes / info.mlx_peak_bytes,
            "target_met": used.total_bytes >= hwm
            and used.planned_bytes <= TARGET_MAX_RATIO * hwm,
        })  # fmt: skip
    daemon.terminate()
    return rows


def estimate_row(estimate: Estimate) -> dict[str, Any]:
    return {
        "context_tokens": estimate.context_tokens,
        "estimate_bytes": estimate.total_bytes,
        "headroom_bytes": estimate.headroom_bytes,
        "planned_bytes": estimate.planned_bytes,
        "parts": {
            "weights": estimate.weights_bytes,
            "kv_cache": estimate.kv_cache_bytes,
            "activations": estimate.activation_bytes,
            "overhead": estimate.overhead_bytes,
            "runtime": estimate.runtime_bytes,
        },
    }


# --- figure 2: the memory gate ----------------------------------------------------


def memory_gate(stack: ExitStack, tmp: Path, reps: int) -> list[dict[str, Any]]:
    """Per rep: builtin:small loaded (s), then two loads of the next model, in alternating
    order: one with nothing unloaded since the last admission (the anchor, n), one issued
    as soon as unloading s returns (gated, m). Both timed to their ``admitted`` line."""
    d = Daemon.start(stack, tmp, "gate", "hot_spare = false\n", client_timeout_s=CLIENT_TIMEOUT_S)
    daemon, client = d.process, d.client
    reps_out = []
    for i in range(reps):
        note(f"figure 2: rep {i + 1}/{reps}")
        unloaded, anchor, gated = f"s{i}", f"n{i}", f"m{i}"
        client.load(UNLOADED_MODEL, unloaded)
        footprint = runner_info(client, unloaded).rss_bytes
        rep: dict[str, Any] = {"order": [], "unloaded_rss_bytes": footprint}
        for kind in alternate(i, "anchor", "gated"):
            rep["order"].append(kind)
            if kind == "gated":
                unload_started = time.perf_counter()
                client.unload(unloaded)
                rep["unload_s"] = time.perf_counter() - unload_started
            name = gated if kind == "gated" else anchor
            started = time.time()
            client.load(NEXT_MODEL, name)
            admitted = log_time(first_record(daemon, "admitted", model=name))
            rep[f"{kind}_to_admitted_s"] = admitted - started
            # The daemon's part alone: the request logged -> admitted.
            requested = log_time(first_record(daemon, "load_requested", model=name))
            rep[f"{kind}_requested_to_admitted_s"] = admitted - requested
        gates = [
            {**r, "passed": r["event"] == "memory_gate_passed"}
            for r in daemon.records()
            if str(r.get("event", "")).startswith("memory_gate_")
            and unloaded in list(r["departed"])  # type: ignore[call-overload]
        ]
        rep["gate"] = gates[0] if gates else None
        admitted_at = log_time(first_record(daemon, "admitted", model=gated))
        rep["gate_before_admitted"] = bool(gates) and log_time(gates[0]) <= admitted_at
        client.unload(anchor)
        client.unload(gated)
        reps_out.append(rep)
    daemon.terminate()
    return reps_out


# --- figure 3: admission with eviction ---------------------------------------------


def eviction(stack: ExitStack, tmp: Path, reps: int) -> dict[str, Any]:
    """Two daemons, each with one idle model loaded; per rep, on each (alternating which goes
    first): one short generation on the idle model, then a load of a new one, timed from the
    call to ready. On "tight" the new model fits only once the idle one is evicted; on
    "roomy" both fit, and the idle one is unloaded afterwards, so that each measured load
    starts from the same state: one idle model loaded."""
    estimate = estimate_reference(EVICT_MODEL)
    assert estimate is not None
    base = "hot_spare = false\npressure_threshold_pct = 100\nmemory_headroom_bytes = 0\n"
    override_mb = {
        "tight": math.ceil(TIGHT_FACTOR * estimate.total_bytes / MiB) + 16,
        "roomy": math.ceil(ROOMY_FACTOR * estimate.total_bytes / MiB) + 16,
    }
    daemons = {
        label: Daemon.start(stack, tmp, f"evict-{label}", base + f"memory_override_mb = {mb}\n",
                            client_timeout_s=CLIENT_TIMEOUT_S)
        for label, mb in override_mb.items()
    }  # fmt: skip
    for d in daemons.values():
        d.client.load(EVICT_MODEL, "m0")
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label in daemons}
    for i in range(reps):
        note(f"figure 3: rep {i + 1}/{reps}")
        for label in alternate(i, "tight", "roomy"):
            daemon, client = daemons[label].process, daemons[label].client
            idle, new = f"m{i}", f"m{i + 1}"
            client.generate_text(idle, PROMPT, max_tokens=SHORT_TOKENS)
            started = time.perf_counter()
            client.load(EVICT_MODEL, new)
            ready_s = time.perf_counter() - started
            requested = first_record(daemon, "load_requested", model=new)
            admitted = first_record(daemon, "admitted", model=new)
            evicting = [
                r for r in daemon.events("model_evicting")
                if str(r.get("reason", "")).endswith(f"to make room for {new}")
            ]  # fmt: skip
            loaded = sorted(r.name for r in client.status().runners)
            samples[label].append({
                "ready_s": ready_s,
                "admission_s": log_time(admitted) - log_time(requested),
                "evicted": admitted.get("evicted"),
                "evicting_events": [str(r["model"]) for r in evicting],
                "evicting_reasons": [str(r["reason"]) for r in evicting],
                "loaded_after": loaded,
            })  # fmt: skip
            if label == "roomy":
                client.unload(idle)
    for d in daemons.values():
        d.process.terminate()
    return {
        "mode": "memory_override_mb",
        "model": EVICT_MODEL,
        "estimate_bytes": estimate.total_bytes,
        "override_mb": override_mb,
        "config": base,
        "samples": samples,
    }


# --- figure 4: the daemon's own RSS -------------------------------------------------


def daemon_rss(stack: ExitStack, tmp: Path) -> dict[str, Any]:
    d = Daemon.start(stack, tmp, "rss", "hot_spare = false\n", client_timeout_s=CLIENT_TIMEOUT_S)
    daemon, client = d.process, d.client
    client.status()
    empty = process_rss(daemon.pid)
    note(f"figure 4: {len(RSS_RUNNERS)} x builtin:tiny")
    for name in RSS_RUNNERS:
        client.load("builtin:tiny", name)
        client.generate_text(name, PROMPT, max_tokens=SHORT_TOKENS)
    status = client.status()
    loaded = process_rss(daemon.pid)
    runners = [r.rss_bytes or 0 for r in status.runners]
    for name in RSS_RUNNERS:
        client.unload(name)
    after = process_rss(daemon.pid)
    daemon.terminate()
    return {
        "daemon_rss_empty_bytes": empty,
        "daemon_rss_loaded_bytes": loaded,
        "daemon_rss_after_unload_bytes": after,
        "runner_rss_bytes": runners,
        "runner_rss_mean_bytes": statistics.mean(runners),
        "target_bytes": RSS_TARGET_BYTES,
        "ratio_to_target": loaded / RSS_TARGET_BYTES,
        "ratio_loaded_vs_empty": loaded / empty,
    }


# --- figure 5: a load that can never fit is refused at once ----------------------------------


def never_fits(stack: ExitStack, tmp: Path, reps: int) -> dict[str, Any]:
    """Two idle models on a simulated machine with room for about three; per rep, in
    alternating order: a load far over the whole machine (refused before any eviction) and a
    request for a model that does not exist (the anchor: a refusal's round trip)."""
    estimate = estimate_reference(EVICT_MODEL)
    assert estimate is not None
    override_mb = math.ceil(3 * estimate.planned_bytes / MiB) + 64
    config = f"hot_spare = false\nmemory_override_mb = {override_mb}\n"
    d = Daemon.start(stack, tmp, "never-fits", config, client_timeout_s=CLIENT_TIMEOUT_S)
    daemon, client = d.process, d.client
    for name in ("a", "b"):
        client.load(EVICT_MODEL, name)
    pids = {r.name: r.pid for r in client.status().runners}

    def refusal(call: Any, *args: Any, **kwargs: Any) -> tuple[float, str]:
        started = time.perf_counter()
        try:
            call(*args, **kwargs)
        except ClientError as exc:
            return time.perf_counter() - started, exc.code
        raise RuntimeError("not refused")

    samples = []
    for i in range(reps):
        note(f"figure 5: rep {i + 1}/{reps}")
        rep: dict[str, Any] = {}
        for kind in alternate(i, "never_fits", "unknown"):
            if kind == "never_fits":
                rep["never_fits_s"], rep["never_fits_code"] = refusal(
                    client.load, UNLOADED_MODEL, f"big{i}", context_tokens=NEVER_FITS_CONTEXT
                )
            else:
                rep["unknown_s"], rep["unknown_code"] = refusal(
                    client.generate_text, f"nosuch{i}", PROMPT, max_tokens=1
                )
        samples.append(rep)
    message = next(str(r["reason"]) for r in daemon.events("admission_refused"))
    unchanged = {r.name: r.pid for r in client.status().runners} == pids
    evictions = len(daemon.events("model_evicting"))
    daemon.terminate()
    return {"override_mb": override_mb, "model": UNLOADED_MODEL,
            "context_tokens": NEVER_FITS_CONTEXT, "samples": samples,
            "message": message, "pids_unchanged": unchanged, "evictions": evictions}  # fmt: skip


# --- the run and its tables -----------------------------------------------------------


def paired(measured: list[float], anchor: list[float]) -> dict[str, float]:
    """Medians of each side and of the per-rep ratios and differences (each rep's two samples
    were taken next to each other; the machine drifts between reps)."""
    pairs = list(zip(measured, anchor, strict=True))
    return {
        "measured": median(measured),
        "anchor": median(anchor),
        "ratio": median([m / a for m, a in pairs]),
        "ratio_of_medians": median(measured) / median(anchor),
        "difference": median([m - a for m, a in pairs]),
    }


def summarize(results: dict[str, Any]) -> None:
    gate = results["gate"]["reps"]
    gates = [r["gate"] for r in gate if r["gate"] is not None]
    shares = [g["returned_share"] for g in gates]
    results["gate"]["summary"] = {
        "to_admitted_s": paired([r["gated_to_admitted_s"] for r in gate],
                                [r["anchor_to_admitted_s"] for r in gate]),
        "requested_to_admitted_s": paired([r["gated_requested_to_admitted_s"] for r in gate],
                                          [r["anchor_requested_to_admitted_s"] for r in gate]),
        "returned_share": median(shares),
        "returned_share_min_max": [min(shares), max(shares)] if shares else None,
        # By order: unloaded as soon as its load returned, or after the anchor's load (~4 s).
        "returned_share_unloaded_at_once": median(
            [r["gate"]["returned_share"] for r in gate if r["gate"] and r["order"][0] == "gated"]
        ),
        "returned_share_unloaded_later": median(
            [r["gate"]["returned_share"] for r in gate if r["gate"] and r["order"][0] == "anchor"]
        ),
        "waited_s": median([g["waited_s"] for g in gates]),
        "unload_s": median([r["unload_s"] for r in gate]),
        "gate_events": len(gates),
        "gate_timeouts": sum(not g["passed"] for g in gates),
        "gate_missed": sum(not r["gate_before_admitted"] for r in gate),
    }  # fmt: skip
    tight, roomy = results["eviction"]["samples"]["tight"], results["eviction"]["samples"]["roomy"]
    results["eviction"]["summary"] = {
        "ready_s": paired([r["ready_s"] for r in tight], [r["ready_s"] for r in roomy]),
        "admission_s": paired([r["admission_s"] for r in tight], [r["admission_s"] for r in roomy]),
        "evictions": {label: [len(r["evicting_events"]) for r in rows]
                      for label, rows in (("tight", tight), ("roomy", roomy))},
        "exactly_one_eviction_each": all(
            len(r["evicting_events"]) == 1 and r["evicted"] == r["evicting_events"] for r in tight
        ) and all(not r["evicting_events"] and not r["evicted"] for r in roomy),
    }  # fmt: skip
    nf = results["never_fits"]
    results["never_fits"]["summary"] = {
        "refusal_s": paired([r["never_fits_s"] for r in nf["samples"]],
                            [r["unknown_s"] for r in nf["samples"]]),
        "codes_ok": all(r["never_fits_code"] == "insufficient_memory"
                        and r["unknown_code"] == "unknown_model" for r in nf["samples"]),
        "nothing_evicted": nf["evictions"] == 0 and nf["pids_unchanged"],
    }  # fmt: skip


def run(reps: int) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": machine_info(mlx_device()),
        "reps": reps,
        "settings": {"prompt": PROMPT, "decode_tokens": DECODE_TOKENS,
                     "short_tokens": SHORT_TOKENS, "ping_timeout_s": PING_TIMEOUT_S},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mlx-bench-memory-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        results["rss"] = daemon_rss(stack, tmp)
        results["never_fits"] = never_fits(stack, tmp, reps)
        results["eviction"] = eviction(stack, tmp, reps)
        results["gate"] = {"unloaded_model": UNLOADED_MODEL, "next_model": NEXT_MODEL,
                           "reps": memory_gate(stack, tmp, reps)}  # fmt: skip
        results["estimate"] = estimator_error(stack, tmp)
    summarize(results)
    results["machine"]["loadavg_end"] = load_average()
    results["elapsed_s"] = time.perf_counter() - started
    return results


def table(r: dict[str, Any]) -> str:
    estimate_rows = []
    for row in r["estimate"]:
        for label, key, ratio in (("daemon's", "estimate_default", "default"),
                                  ("used context", "estimate_used_context", "used")):  # fmt: skip
            est = row[key]
            estimate_rows.append((
                row["model"], f"{label} ({est['context_tokens']} tok)",
                format_bytes(est["estimate_bytes"]), format_bytes(est["planned_bytes"]),
                format_bytes(row["vm_hwm_bytes"]), format_bytes(row["mlx_peak_bytes"]),
                f"{row[f'ratio_{ratio}_vs_hwm']:.2f}",
                f"{row[f'ratio_{ratio}_planned_vs_hwm']:.2f}",
                f"{row[f'ratio_{ratio}_vs_mlx_peak']:.2f}",
                verdict(row["target_met"]) if ratio == "used" else "-",
            ))  # fmt: skip
    runtime = r["estimate"][0]
    g = r["gate"]["summary"]
    lo, hi = g["returned_share_min_max"] or (math.nan, math.nan)
    gate_rows = []
    for label, fig in (
        ("load called / unload returned -> admitted", g["to_admitted_s"]),
        ("  the daemon's part: load_requested -> admitted", g["requested_to_admitted_s"]),
    ):
        gate_rows.append(
            (
                label,
                ms(fig["anchor"], ".1f"),
                ms(fig["measured"], ".1f"),
                f"{fig['ratio']:.2f}",
                ms(fig["difference"], "+.1f"),
            )
        )
    gate_rows += [
        ("gate waited", "-", ms(g["waited_s"], ".0f"), "", ""),
        ("share of the departed runner back (min, max)", "-",
         f"{g['returned_share']:.2f} ({lo:.2f}, {hi:.2f})", "", ""),
        ("  small unloaded as soon as its load returned", "-",
         f"{g['returned_share_unloaded_at_once']:.2f}", "", ""),
        ("  small unloaded after the anchor's load", "-",
         f"{g['returned_share_unloaded_later']:.2f}", "", ""),
        ("gate events / timeouts / missed", "-",
         f"{g['gate_events']} / {g['gate_timeouts']} / {g['gate_missed']}", "", ""),
        ("client.unload of small", "-", ms(g["unload_s"], ".0f"), "", ""),
    ]  # fmt: skip
    e = r["eviction"]["summary"]
    ev = r["eviction"]
    ready, admission = e["ready_s"], e["admission_s"]
    evict_rows = [
        ("load -> ready", f"{ready['anchor']:.2f} s", f"{ready['measured']:.2f} s",
         f"{ready['ratio']:.2f}", ms(ready["difference"], "+.0f")),
        ("load_requested -> admitted", ms(admission["anchor"], ".1f"),
         ms(admission["measured"], ".0f"), f"{admission['ratio']:.1f}",
         ms(admission["difference"], "+.0f")),
        ("evictions per load", " ".join(map(str, e["evictions"]["roomy"])),
         " ".join(map(str, e["evictions"]["tight"])),
         "ok" if e["exactly_one_eviction_each"] else "MISMATCH", ""),
    ]  # fmt: skip
    s = r["rss"]
    rss_rows = [
        ("daemon RSS, 4 tiny runners loaded", format_bytes(s["daemon_rss_loaded_bytes"]),
         f"{s['ratio_to_target']:.2f} of 100 MB"),
        ("daemon RSS, 0 runners (at start)", format_bytes(s["daemon_rss_empty_bytes"]),
         f"loaded / empty {s['ratio_loaded_vs_empty']:.2f}"),
        ("daemon RSS, after unloading all 4", format_bytes(s["daemon_rss_after_unload_bytes"]), ""),
        ("runner RSS (mean of 4)", format_bytes(int(s["runner_rss_mean_bytes"])), ""),
    ]  # fmt: skip
    nf = r["never_fits"]
    refusal = nf["summary"]["refusal_s"]
    never_rows = [
        ("client call -> refusal", ms(refusal["anchor"], ".1f"), ms(refusal["measured"], ".1f"),
         f"{refusal['ratio']:.2f}", ms(refusal["difference"], "+.1f")),
        ("codes / nothing evicted, pids unchanged", "unknown_model", "insufficient_memory",
         verdict(nf["summary"]["codes_ok"]), verdict(nf["summary"]["nothing_evicted"])),
    ]  # fmt: skip
    m = r["machine"]
    tokens = r["settings"]["decode_tokens"]
    return "\n\n".join([
        f"mlx {m['mlx']} / mlx-lm {m['mlx_lm']} on {m['mlx_device']}, {m['cpu_count']} cores, "
        f"{r['reps']} reps, {r['elapsed_s']:.0f} s",
        f"1. estimate / measured peak, after load + one {tokens}-token generation\n"
        "   (daemon's: its model_estimate record, KV planned for min(8192, the model's limit)\n"
        "   tokens; used context: the same for prompt + generated tokens; runtime "
        f"{format_bytes(runtime['runtime_bytes'])}, {runtime['overhead_source']};\n"
        f"   target: estimate >= VmHWM, planned <= {TARGET_MAX_RATIO} x VmHWM)\n"
        + render_table(("model", "estimate", "bytes", "planned", "VmHWM", "MLX peak",
                        "est/VmHWM", "planned/VmHWM", "est/MLX peak", "target"),
                       estimate_rows),
        f"2. memory gate: unload {UNLOADED_MODEL} -> next load ({NEXT_MODEL}) admitted\n"
        + render_table((f"median of {r['reps']} reps",
                        "nothing unloaded (anchor)", "after unload", "ratio", "difference"),
                       gate_rows),
        f"3. admission with eviction ({ev['model']}, "
        f"estimate {format_bytes(ev['estimate_bytes'])}; "
        f"memory_override_mb {ev['override_mb']['tight']} vs {ev['override_mb']['roomy']})\n"
        + render_table((f"median of {r['reps']} reps", "fits (anchor)", "evicts one", "ratio",
                        "difference"), evict_rows),
        "4. the supervisor's own memory (hot_spare = false)\n"
        + render_table(("figure", "RSS", ""), rss_rows),
        f"5. a load that cannot fit even with every idle model gone ({nf['model']}, "
        f"{nf['context_tokens']} tokens; two idle tiny; memory_override_mb {nf['override_mb']})"
        "\n" + render_table((f"median of {r['reps']} reps", "unknown model (anchor)",
                             "never fits", "ratio", "difference"), never_rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of figures 2 and 3")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args(argv)
    results = run(args.reps)
    write_json(results, args.out)
    print(table(results))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
