// The dashboard of mlx-supervisor: one page, no framework, no build step.
//
// Everything live comes by server-sent events, read with fetch (so that a key
// can go in a header): GET /admin/status/stream (status, memory timeline,
// runner log lines) and GET /admin/events (the daemon's events). A stream that
// ends is opened again after the delay the server asked for; nothing polls.
// Actions are the management API's routes; the chat box streams from
// /v1/chat/completions. All same-origin.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = { admin: "mlx-supervisor.admin-key", api: "mlx-supervisor.api-key" };
const MAX_EVENTS = 200;
const MAX_LOG_LINES = 200;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
                 "#17becf", "#bcbd22", "#7f7f7f", "#d62728"];
const SVG = "http://www.w3.org/2000/svg";

// --- keys ----------------------------------------------------------------------------

const keyInfo = (document.querySelector('meta[name="mlx-supervisor-keys"]')?.content || "")
  .split(/\s+/).filter(Boolean);
const keys = {
  needed: { admin: keyInfo.includes("admin"), api: keyInfo.includes("api") },
  same: keyInfo.includes("same"),  // no admin_api_key: the admin routes take api_key
  asking: null,
};

function storedKey(kind) {
  if (keys.same) kind = "admin";
  return sessionStorage.getItem(KEY_STORE[kind]);
}

// The key for a request of `kind` ("admin" or "api"), asking the user once.
async function keyFor(kind) {
  if (!keys.needed[kind]) return null;
  const stored = storedKey(kind);
  if (stored) return stored;
  return askKey(kind, false);
}

function askKey(kind, wrong) {
  if (keys.same) kind = "admin";
  if (keys.asking && keys.asking.kind === kind) return keys.asking.promise;
  // Another kind is being asked for: this question waits for that answer.
  if (keys.asking) return keys.asking.promise.then(() => askKey(kind, wrong));
  sessionStorage.removeItem(KEY_STORE[kind]);
  let resolve;
  const promise = new Promise((r) => { resolve = r; });
  keys.asking = { kind, promise };
  const which = kind === "admin" && !keys.same ? "admin_api_key" : "api_key";
  $("key-why").textContent = (wrong ? "That key was refused. " : "") +
    `The daemon has an ${which}: give it to watch and manage the models` +
    (kind === "api" ? " (the chat box needs api_key)." : ".");
  $("key-panel").hidden = false;
  $("key-input").value = "";
  $("key-input").focus();
  $("key-form").onsubmit = (e) => {
    e.preventDefault();
    const value = $("key-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(KEY_STORE[kind], value);
    $("key-input").value = "";  // the key does not stay in the page
    $("key-panel").hidden = true;
    keys.asking = null;
    resolve(value);
  };
  return promise;
}

async function headersFor(kind, extra = {}) {
  const key = await keyFor(kind);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// fetch with the key of `kind`; a 401 asks for the key again and retries once.
async function call(kind, path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = await headersFor(kind, options.headers || {});
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401 || !keys.needed[kind] || attempt > 0) return response;
    await askKey(kind, true);
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function notice(text, isError = false) {
  const el = $("notice");
  el.textContent = text;
  el.classList.toggle("error", isError);
  el.hidden = !text;
}

// --- server-sent events over fetch ---------------------------------------------------

// Read the SSE of `response`, calling onEvent({event, data, id}) for each.
// Returns the retry delay the server asked for (ms), or null.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let retry = null;
  let current = { event: "message", data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return retry;
    buffer += value;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, "");
      buffer = buffer.slice(newline + 1);
      if (line === "") {
        if (current.data.length) {
          onEvent({ event: current.event, data: current.data.join("\n"), id: current.id });
        }
        current = { event: "message", data: [], id: null };
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "data") current.data.push(text);
      else if (field === "event") current.event = text;
      else if (field === "id") current.id = text;
      else if (field === "retry" && /^\d+$/.test(text)) retry = Number(text);
    }
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Whether `err` is the network's (fetch or a read failed, the stream was
// aborted) rather than the page's own bug.
function networkError(err) {
  return (err instanceof TypeError && /fetch|network/i.test(err.message)) ||
    err?.name === "AbortError" || err?.name === "NetworkError";
}

const BACKOFF_MAX_MS = 60_000;

// One live stream, opened again when it ends: after the server's retry delay
// (2 s), doubled on each try that got no event, up to a minute, with jitter.
class Feed {
  constructor(name, path, onEvent) {
    this.name = name;
    this.path = path;
    this.onEvent = onEvent;
    this.lastId = null;
    this.connected = false;
  }

  async run() {
    let base = 2000;
    let failures = 0;
    for (;;) {
      try {
        const extra = { Accept: "text/event-stream" };
        if (this.lastId !== null) extra["Last-Event-ID"] = this.lastId;
        const response = await call("admin", this.path(this.lastId), { headers: extra });
        if (response.status === 403) {  // another origin, or not allowed: trying again won't help
          notice(`${this.name}: ${await errorText(response)}`, true);
          this.setConnected(false);
          return;
        }
        if (response.status === 401) {  // the daemon wants a key now (restarted with one)
          keys.needed.admin = true;
          this.setConnected(false);
          await askKey("admin", storedKey("admin") !== null);
          continue;
        }
        if (!response.ok) {
          notice(`${this.name}: ${await errorText(response)}`, true);
        } else {
          this.setConnected(true);
          const retry = await readEvents(response, (ev) => {
            failures = -1;  // this try got through: the next wait is the base one again
            if (ev.id !== null) this.lastId = ev.id;
            try {
              this.onEvent(ev);
            } catch (err) {
              console.error(`${this.name}: the page failed on a ${ev.event} event:`, err);
            }
          });
          if (retry !== null) base = retry;
        }
      } catch (err) {
        // The daemon went away or restarted: try again after the delay. Anything else is a bug.
        if (!networkError(err)) console.error(`${this.name}:`, err);
      }
      this.setConnected(false);
      failures += 1;
      const delay = base * 2 ** Math.max(0, failures - 1) * (0.75 + Math.random() * 0.5);
      await sleep(Math.min(BACKOFF_MAX_MS, delay));
    }
  }

  setConnected(on) {
    this.connected = on;
    showConnection();
  }
}

// --- formatting ----------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(0)} MiB`;
  return `${(n / 1024).toFixed(0)} KiB`;
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
}

function duration(s) {
  if (s < 90) return `${s.toFixed(0)} s`;
  if (s < 5400) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, String(value));
    else node[name] = value;
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

// --- state ---------------------------------------------------------------------------

const state = {
  status: null,
  points: [],
  spanS: 900,
  loading: {},  // model -> its latest model_loading event fields
  feeds: [],
};

function showConnection() {
  const live = state.feeds.length > 0 && state.feeds.every((feed) => feed.connected);
  const conn = $("conn");
  conn.dataset.connected = String(live);
  conn.textContent = live ? "live" : "reconnecting…";
}

// --- the models table ----------------------------------------------------------------

function exitText(exit) {
  if (!exit) return null;
  const how = exit.signal || (exit.code !== null ? `exit ${exit.code}` : "ended");
  return el("span", {},
    el("span", { class: "cause", "data-cause-class": exit.cause_class }, exit.cause_class),
    ` ${how}: ${exit.cause}`);
}

function stateText(runner) {
  const progress = state.loading[runner.name];
  let text = runner.state;
  if (runner.state === "loading" && progress && progress.total) {
    text += ` (${progress.phase} ${progress.done}/${progress.total})`;
  }
  if (runner.failure) text += `: ${runner.failure}`;
  return text;
}

function renderModels() {
  const status = state.status;
  if (!status) return;
  const sup = status.supervisor;
  $("daemon").textContent = `${sup.version} · pid ${sup.pid} · up ${duration(sup.uptime_s)}`;
  const rows = $("model-rows");
  rows.replaceChildren(...status.runners.map(modelRow));
  $("no-models").hidden = status.runners.length > 0;
  fillModelChoice($("log-model"), true);
  fillModelChoice($("chat-model"), false);
}

function modelRow(r) {
  const pids = r.ranks && r.ranks.length ? r.ranks.map((rank) => rank.pid ?? "–").join(", ")
    : (r.pid ?? "–");
  const mlx = r.mlx_active_bytes === null ? "–"
    : `${bytes(r.mlx_active_bytes)} / ${bytes(r.mlx_peak_bytes)}`;
  const actions = el("td", { class: "actions" },
    button("unload", () => act(`/admin/models/${encodeURIComponent(r.name)}`,
                                { method: "DELETE" }, `${r.name} unloaded`)),
    button(r.pinned ? "unpin" : "pin", () => act(
      `/admin/models/${encodeURIComponent(r.name)}/pin`,
      r.pinned ? { method: "DELETE" } : jsonPost({}), `${r.name} ${r.pinned ? "unpinned" : "pinned"}`)),
    button("clear cache", () => act(`/admin/models/${encodeURIComponent(r.name)}/cache/clear`,
                                     jsonPost({}), `${r.name}: prefix cache cleared`)),
    button("log", () => chooseLog(r.name)),
  );
  return el("tr", {
    "data-model": r.name, "data-state": r.state, "data-restarts": r.restarts,
    "data-pid": r.pid ?? "", "data-cause-class": r.last_exit ? r.last_exit.cause_class : "",
  },
    el("td", { title: r.model }, r.name, r.pinned ? el("span", { class: "pin" }, "pinned") : null),
    el("td", { class: `state state-${r.state}` }, stateText(r)),
    el("td", { class: "mono" }, String(pids)),
    el("td", {}, bytes(r.rss_bytes)),
    el("td", {}, mlx),
    el("td", { title: r.estimate_bytes ? `estimate ${bytes(r.estimate_bytes)}` : "" },
       bytes(r.memory_budget_bytes)),
    el("td", {}, String(r.queue_depth)),
    el("td", { title: "in flight / side by side at most" }, `${r.active_requests} / ${r.max_concurrent}`),
    el("td", {}, String(r.restarts)),
    el("td", { class: "exit" }, exitText(r.last_exit)),
    actions,
  );
}

function button(label, onClick) {
  const b = el("button", { type: "button", class: "small" }, label);
  b.addEventListener("click", onClick);
  return b;
}

function jsonPost(body) {
  return { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
}

async function act(path, options, done) {
  try {
    const response = await call("admin", path, options);
    if (response.ok) notice(done);
    else notice(await errorText(response), true);
  } catch (err) {
    notice(`the daemon did not answer: ${err}`, true);
  }
}

function fillModelChoice(select, withGone) {
  const names = state.status.runners.map((r) => r.name);
  if (withGone && select.value && !names.includes(select.value)) names.push(select.value);
  const current = select.value;
  const have = Array.from(select.options).map((o) => o.value);
  if (have.join("\n") !== names.join("\n")) {
    select.replaceChildren(...names.map((name) => el("option", { value: name }, name)));
    if (names.includes(current)) select.value = current;
  }
  if (select === $("log-model") && select.value !== $("log-lines").dataset.model) {
    chooseLog(select.value);
  }
}

// --- loading a model -----------------------------------------------------------------

const PHASES = { resolve: [0, 0.05], weights: [0.05, 0.9], warmup: [0.9, 1] };

async function loadModel(event) {
  event.preventDefault();
  const body = { model: $("load-ref").value.trim() };
  const name = $("load-name").value.trim();
  if (name) body.name = name;
  if ($("load-pin").checked) body.pinned = true;
  const box = $("load-progress");
  const bar = $("load-bar");
  const text = $("load-text");
  box.hidden = false;
  box.dataset.state = "loading";
  box.dataset.events = "0";
  bar.value = 0;
  text.textContent = `loading ${body.model}…`;
  $("load-button").disabled = true;
  try {
    const response = await call("admin", "/admin/models?stream=true", {
      ...jsonPost(body), headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    });
    if (!response.ok) throw new Error(await errorText(response));
    let finished = false;
    await readEvents(response, (ev) => {
      const data = JSON.parse(ev.data);
      if (ev.event === "progress") {
        box.dataset.events = String(Number(box.dataset.events) + 1);
        const [start, end] = PHASES[data.phase] || [0, 1];
        bar.value = start + (end - start) * (data.total ? data.done / data.total : 0);
        text.textContent = `${data.name}: ${data.phase} ${data.done}/${data.total} · ${bytes(data.active_bytes)}`;
      } else if (ev.event === "loaded") {
        finished = true;
        bar.value = 1;
        box.dataset.state = "loaded";
        text.textContent = `${data.name} loaded in ${data.load_s.toFixed(2)} s (pid ${data.pid}, ${bytes(data.param_bytes)} of weights)`;
      } else if (ev.event === "error") {
        finished = true;
        throw new Error(data?.error?.message || ev.data);
      }
    });
    if (!finished) throw new Error("the load's stream ended before its result");
  } catch (err) {
    box.dataset.state = "error";
    text.textContent = `not loaded: ${err.message || err}`;
  } finally {
    $("load-button").disabled = false;
  }
}

// --- the memory chart ----------------------------------------------------------------

const CHART = { width: 800, height: 260, left: 72, right: 12, top: 10, bottom: 24 };

// A round step for about `parts` grid lines up to `top` bytes (1, 2 or 5 times a power of ten GiB or MiB).
function gridStep(top, parts) {
  const unit = top >= 1 << 30 ? 1 << 30 : 1 << 20;
  const rough = top / parts / unit;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough);
  return step * unit;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

const colors = new Map();
function colorOf(model) {
  if (!colors.has(model)) colors.set(model, PALETTE[colors.size % PALETTE.length]);
  return colors.get(model);
}

function renderChart() {
  const chart = $("chart");
  const points = state.points;
  const now = points.length ? Math.max(points[points.length - 1][0], Date.now() / 1000) : Date.now() / 1000;
  const from = now - state.spanS;
  const shown = points.filter((p) => p[0] >= from);
  const { width, height, left, right, top, bottom } = CHART;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  const total = shown.reduce((max, p) => Math.max(max, p[2]), 1);
  const x = (ts) => left + ((ts - from) / state.spanS) * plotW;
  const y = (b) => top + plotH - (b / total) * plotH;
  const nodes = [];
  const step = gridStep(total, 4);
  for (let b = 0; b <= total; b += step) {
    nodes.push(svg("line", { class: "grid", x1: left, x2: width - right, y1: y(b), y2: y(b) }));
    nodes.push(svg("text", { class: "axis", x: left - 6, y: y(b) + 4, "text-anchor": "end" },
                   b ? bytes(b).replace(".00 ", " ") : "0"));
  }
  for (const minutes of [15, 10, 5, 0]) {
    nodes.push(svg("text", { class: "axis", x: x(now - minutes * 60), y: height - 6,
                             "text-anchor": minutes === 15 ? "start" : minutes === 0 ? "end" : "middle" },
                   minutes ? `-${minutes} min` : "now"));
  }
  const models = [];
  for (const p of shown) for (const name of Object.keys(p[4])) if (!models.includes(name)) models.push(name);
  models.sort();
  // Each runner's footprint, stacked from the bottom.
  const below = shown.map(() => 0);
  for (const model of models) {
    const tops = shown.map((p, i) => below[i] + (p[4][model] || 0));
    const upper = shown.map((p, i) => `${x(p[0]).toFixed(1)},${y(tops[i]).toFixed(1)}`);
    const lower = shown.map((p, i) => `${x(p[0]).toFixed(1)},${y(below[i]).toFixed(1)}`).reverse();
    if (shown.length) {
      nodes.push(svg("polygon", { points: [...upper, ...lower].join(" "), fill: colorOf(model),
                                  "fill-opacity": 0.75, "data-model": model }));
    }
    tops.forEach((t, i) => { below[i] = t; });
  }
  if (shown.length) {
    nodes.push(svg("polyline", { class: "used",
      points: shown.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ") }));
    const last = shown[shown.length - 1];
    const limit = (last[2] * last[3]) / 100;
    nodes.push(svg("line", { class: "threshold", x1: left, x2: width - right, y1: y(limit), y2: y(limit) }));
    nodes.push(svg("text", { class: "threshold-label", x: width - right - 4, y: y(limit) - 4,
                             "text-anchor": "end" }, `pressure threshold ${last[3]}%`));
  }
  chart.replaceChildren(...nodes);
  chart.dataset.points = String(shown.length);
  chart.dataset.series = String(models.length);
  const legend = [el("span", {}, el("span", { class: "swatch used-swatch" }), "machine used")];
  legend[0].firstChild.style.background = "currentColor";
  const last = shown[shown.length - 1];
  for (const model of models) {
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = colorOf(model);
    legend.push(el("span", { "data-model": model }, swatch,
                   `${model} ${last && last[4][model] !== undefined ? bytes(last[4][model]) : ""}`));
  }
  $("chart-legend").replaceChildren(...legend);
  if (last) {
    $("machine").textContent = `memory ${bytes(last[1])} of ${bytes(last[2])} used ` +
      `(${((100 * last[1]) / last[2]).toFixed(1)}%, threshold ${last[3]}%)`;
  }
}

let chartQueued = false;
function queueChart() {
  if (chartQueued) return;
  chartQueued = true;
  requestAnimationFrame(() => { chartQueued = false; renderChart(); });
}

// --- the status stream ---------------------------------------------------------------

function onStatusEvent(ev) {
  const data = JSON.parse(ev.data);
  if (ev.event === "history") {
    state.spanS = data.span_s;
    state.points = data.points;
    queueChart();
    // A new stream (a reconnect, maybe to a restarted daemon whose line numbers start
    // again at 0): the selected model's tail again, lines of the gap included.
    const model = $("log-lines").dataset.model;
    if (model) chooseLog(model);
  } else if (ev.event === "memory") {
    state.points.push(...data);
    const from = state.points[state.points.length - 1][0] - state.spanS;
    while (state.points.length && state.points[0][0] < from) state.points.shift();
    queueChart();
  } else if (ev.event === "status") {
    state.status = data;
    renderModels();
  } else if (ev.event === "logs") {
    appendLogs(data.lines, data.skipped);
  }
}

// --- the event list ------------------------------------------------------------------

const TONE = {
  runner_died: "bad", restart_refused: "bad", admission_refused: "bad", memory_pressure_high: "bad",
  restart_scheduled: "warn", model_evicted: "warn", model_expired: "warn", daemon_stopping: "warn",
  model_ready: "good", memory_pressure_normal: "good", daemon_started: "good",
};

function describe(event) {
  const f = event.fields || {};
  switch (event.kind) {
    case "runner_died":
      return [el("span", { class: "cause", "data-cause-class": f.cause_class }, f.cause_class),
              ` pid ${f.pid ?? "–"} ${f.signal || (f.code !== null && f.code !== undefined ? `exit ${f.code}` : "")}: ${f.cause}`];
    case "restart_scheduled":
      return [`in ${Number(f.delay_s || 0).toFixed(1)} s: ${f.reason}`];
    case "model_state":
      return [`${f.old} → ${f.new}${f.pid ? ` (pid ${f.pid})` : ""}`];
    case "model_loading":
      return [`${f.phase} ${f.done}/${f.total} · ${bytes(f.active_bytes)}`];
    case "model_ready":
      return [`pid ${f.pid}, loaded in ${Number(f.load_s || 0).toFixed(2)} s`];
    case "memory_pressure_high":
    case "memory_pressure_normal":
      return [`${f.pressure_pct}% used, threshold ${f.threshold_pct}%`];
    default:
      return [Object.entries(f).filter(([, v]) => v !== null && v !== undefined)
        .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ")];
  }
}

const SERVING = new Set(["ready", "busy"]);

function addEvent(event) {
  const list = $("event-list");
  const f = event.fields || {};
  if (event.kind === "model_loading") state.loading[event.model] = f;
  if (event.kind === "model_ready" || event.kind === "runner_died") delete state.loading[event.model];
  const first = list.firstElementChild;
  const same = first && first.dataset.kind === event.kind && first.dataset.model === (event.model || "");
  // One line per load, brought up to date; one for a run of moves between ready and busy.
  const flip = event.kind === "model_state" && SERVING.has(f.old) && SERVING.has(f.new);
  const merge = same && (event.kind === "model_loading" || (flip && first.dataset.flip === "true"));
  const count = merge && flip ? Number(first.dataset.count) + 1 : 1;
  const detail = describe(event);
  if (count > 1) detail.push(` · ${count} moves between ready and busy`);
  const item = el("li", {
    class: TONE[event.kind] || "", "data-kind": event.kind, "data-model": event.model || "",
    "data-id": event.id, "data-pid": f.pid ?? "", "data-received-ms": Date.now(),
    "data-cause-class": f.cause_class ?? "", "data-flip": flip, "data-count": count,
  },
    el("time", { dateTime: new Date(event.ts * 1000).toISOString() }, clock(event.ts)),
    el("span", { class: "kind" }, event.kind.replaceAll("_", " ")),
    event.model ? el("span", { class: "model" }, event.model) : null,
    el("span", { class: "detail" }, ...detail));
  if (merge) first.replaceWith(item);
  else list.prepend(item);
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  if (event.kind === "model_loading" && state.status) renderModels();
}

function onHubEvent(ev) {
  if (ev.event === "message") addEvent(JSON.parse(ev.data));
  else if (ev.event === "missed") {
    const gone = JSON.parse(ev.data);
    addEvent({ id: 0, ts: Date.now() / 1000, kind: "events_missed", model: null, fields: gone });
  }
}

// --- the log tail --------------------------------------------------------------------

function logText(line) {
  const time = clock(line.ts);
  if (line.line.startsWith("{")) {
    try {
      const record = JSON.parse(line.line);
      const { event, level, timestamp, ...rest } = record;
      if (typeof event === "string") {
        const extra = Object.entries(rest).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`);
        return `${time} ${String(level ?? "info").padEnd(7)} ${event} ${extra.join(" ")}`;
      }
    } catch {
      // not a log record: shown as it is
    }
  }
  return `${time} ${line.line}`;
}

let logPending = null;  // the lines streamed while a tail is fetched, else null

async function chooseLog(model) {
  const pre = $("log-lines");
  $("log-model").value = model;
  pre.dataset.model = model || "";
  delete pre.dataset.seq;
  pre.replaceChildren();
  logPending = null;
  if (!model) return;
  const pending = logPending = [];
  try {
    const response = await call("admin", `/admin/models/${encodeURIComponent(model)}/logs`);
    if (!response.ok) {
      pre.textContent = await errorText(response);
      return;
    }
    const body = await response.json();
    if (pre.dataset.model !== model) return;  // another was chosen meanwhile
    pre.dataset.seq = String(body.last_seq);
    pre.replaceChildren(...body.lines.map((line) => document.createTextNode(`${logText(line)}\n`)));
    pre.scrollTop = pre.scrollHeight;
  } catch (err) {
    pre.textContent = `the daemon did not answer: ${err}`;
  } finally {
    if (logPending === pending) {  // not superseded: the lines that came meanwhile, after the tail
      logPending = null;
      for (const [lines, skipped] of pending) appendLogs(lines, skipped);
    }
  }
}

function appendLogs(lines, skipped) {
  if (logPending !== null) {
    logPending.push([lines, skipped]);
    return;
  }
  const pre = $("log-lines");
  const model = pre.dataset.model;
  const after = Number(pre.dataset.seq || 0);
  const mine = lines.filter((line) => line.model === model && line.seq > after);
  if (!mine.length) return;
  const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  if (skipped) pre.append(document.createTextNode(`… ${skipped} lines not shown\n`));
  for (const line of mine) pre.append(document.createTextNode(`${logText(line)}\n`));
  pre.dataset.seq = String(mine[mine.length - 1].seq);
  while (pre.childNodes.length > MAX_LOG_LINES) pre.firstChild.remove();
  if (stick) pre.scrollTop = pre.scrollHeight;
}

// --- the chat box --------------------------------------------------------------------

const chat = { messages: [], abort: null };

async function sendChat(event) {
  event.preventDefault();
  const model = $("chat-model").value;
  const text = $("chat-input").value.trim();
  if (!model || !text || chat.abort) return;
  const log = $("chat-log");
  const messages = chat.messages;  // this conversation's: "New chat" starts another
  messages.push({ role: "user", content: text });
  log.append(el("div", { class: "message user" }, text));
  const answer = el("div", { class: "message assistant", "data-model": model });
  log.append(answer);
  $("chat-input").value = "";
  log.dataset.state = "streaming";
  const abort = chat.abort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  let reply = "";
  try {
    const response = await call("api", "/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify({ model, messages, stream: true, max_tokens: 256 }),
      signal: abort.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (ev) => {
      if (ev.data === "[DONE]") return;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply += delta;
        answer.textContent = reply;
        log.scrollTop = log.scrollHeight;
      }
    });
    messages.push({ role: "assistant", content: reply });
    if (messages === chat.messages) log.dataset.state = "done";
  } catch (err) {
    if (reply) messages.push({ role: "assistant", content: reply });
    if (messages !== chat.messages) return;  // cleared meanwhile: nothing of it is shown
    answer.classList.add("error");
    answer.textContent = `${reply}${reply ? "\n" : ""}[${err.name === "AbortError" ? "stopped" : err.message || err}]`;
    log.dataset.state = err.name === "AbortError" ? "done" : "error";
  } finally {
    if (chat.abort === abort) {
      chat.abort = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }
}

function clearChat() {
  if (chat.abort) chat.abort.abort();
  chat.messages = [];
  $("chat-log").replaceChildren();
  $("chat-log").dataset.state = "idle";
}

// --- start ---------------------------------------------------------------------------

function start() {
  $("load-form").addEventListener("submit", loadModel);
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-stop").addEventListener("click", () => chat.abort && chat.abort.abort());
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("log-model").addEventListener("change", () => chooseLog($("log-model").value));
  state.feeds = [
    new Feed("status", () => "/admin/status/stream", onStatusEvent),
    // The first time, the events the daemon still holds; then from the last one seen.
    new Feed("events", (lastId) => (lastId === null ? "/admin/events?since=0" : "/admin/events"),
             onHubEvent),
  ];
  showConnection();
  for (const feed of state.feeds) feed.run();
}

start();
