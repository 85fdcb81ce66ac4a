// The waterfall page. Asking a question picks a trace id here, subscribes to that trace's
// stage-event stream (GET /debug/stages, SSE), then sends the query with a traceparent naming
// the trace, so every span of the request arrives live: bars grow while their spans run, token
// ticks appear under decode, injected faults are marked. Recent requests come from the trace
// buffer (GET /ui/traces) and open their own waterfall (GET /ui/traces/{id}, the same events).
// Bars carry data-* attributes with their exact times, which the browser test reads.
"use strict";

const $ = (id) => document.getElementById(id);
const page = { config: null, trace: null, recent: null, frame: 0 };

// ---------------------------------------------------------------- one trace's spans

class Trace {
  constructor(id, live) {
    this.id = id;
    this.live = live;
    this.spans = new Map();
    this.ended = false;
    this.dropped = 0;
    this.events = 0;
    this.clock = null; // {now: server ms, at: performance.now()} from `subscribed`
    this.ending = new Promise((resolve) => (this.resolveEnd = resolve));
  }

  span(id) {
    let s = this.spans.get(id);
    if (!s) {
      s = { id, parent: "", name: null, stage: null, service: null, start: null, end: null,
        duration: null, startNano: null, endNano: null, attrs: {}, events: [], error: null };
      this.spans.set(id, s);
    }
    return s;
  }

  describe(s, ev) {
    s.parent = ev.parent_span_id;
    s.name = ev.name;
    s.stage = ev.stage;
    s.service = ev.service;
    s.start = ev.start_ms;
    s.startNano = ev.start_unix_nano;
  }

  apply(ev) {
    this.events++;
    switch (ev.type) {
      case "span_start": {
        const s = this.span(ev.span_id);
        this.describe(s, ev);
        Object.assign(s.attrs, ev.attributes);
        break;
      }
      case "span_update": {
        const s = this.span(ev.span_id);
        Object.assign(s.attrs, ev.attributes);
        if (ev.error) s.error = ev.error;
        break;
      }
      case "span_event":
        this.span(ev.span_id).events.push({ name: ev.name, at: ev.at_ms, attrs: ev.attributes });
        break;
      case "span_end": {
        const s = this.span(ev.span_id);
        this.describe(s, ev);
        s.end = ev.end_ms;
        s.duration = ev.duration_ms;
        s.endNano = ev.end_unix_nano;
        break;
      }
      case "trace_end":
        this.ended = true;
        this.dropped = ev.dropped;
        this.resolveEnd();
        break;
    }
  }

  // The server's clock now, estimated from `subscribed` and the time since it arrived.
  now() {
    return this.clock ? this.clock.now + (performance.now() - this.clock.at) : null;
  }

  // Spans in tree order (children after their parent, siblings by start), with their depth.
  rows() {
    const known = [...this.spans.values()].filter((s) => s.start !== null);
    const children = new Map();
    const roots = [];
    for (const s of known) {
      if (this.spans.has(s.parent) && this.spans.get(s.parent).start !== null) {
        if (!children.has(s.parent)) children.set(s.parent, []);
        children.get(s.parent).push(s);
      } else {
        roots.push(s);
      }
    }
    const out = [];
    const walk = (list, depth) => {
      list.sort((a, b) => a.start - b.start);
      for (const s of list) {
        out.push({ span: s, depth });
        walk(children.get(s.id) || [], depth + 1);
      }
    };
    walk(roots, 0);
    return out;
  }

  root() {
    const rows = this.rows();
    return rows.length ? rows[0].span : null;
  }
}

// ---------------------------------------------------------------- drawing

const ROW = 22;
const AXIS = 22;

function colour(service) {
  const c = page.config;
  return (c && service && c.colours[service]) || (c ? c.other_colour : "#6b7280");
}

function faultsOf(s) {
  return Object.entries(s.attrs).filter(([k]) => k.startsWith("rag.fault.") && k !== "rag.fault.plan");
}

function fmtMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "";
  if (ms >= 1000) return (ms / 1000).toFixed(ms >= 10000 ? 1 : 2) + " s";
  if (ms >= 100) return ms.toFixed(0) + " ms";
  if (ms >= 10) return ms.toFixed(1) + " ms";
  if (ms >= 1) return ms.toFixed(2) + " ms";
  return (ms * 1000).toFixed(0) + " µs";
}

function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function draw(trace) {
  const svg = $("waterfall");
  const rows = trace.rows();
  const width = Math.max(svg.parentNode.clientWidth || 900, 480);
  const labelW = Math.min(250, Math.round(width * 0.28));
  const durW = 104;
  const plotW = width - labelW - durW - 8;
  const now = trace.live && !trace.ended ? trace.now() : null;
  let origin = Infinity;
  let last = -Infinity;
  for (const { span } of rows) {
    origin = Math.min(origin, span.start);
    last = Math.max(last, span.end !== null ? span.end : now !== null ? now : span.start);
  }
  const total = rows.length ? Math.max(last - origin, 0.001) : 1;
  const px = plotW / total;
  const height = AXIS + rows.length * ROW + 6;
  const x = (ms) => labelW + (ms - origin) * px;
  const out = [];
  out.push(`<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">` +
    `<line x1="0" y1="0" x2="0" y2="6" stroke="#ffd54f" stroke-width="2.5" opacity=".8"/></pattern></defs>`);
  // Time axis.
  const step = niceStep(total / Math.max(plotW / 90, 1));
  out.push(`<g class="axis">`);
  for (let t = 0; t <= total + 1e-9; t += step) {
    const gx = labelW + t * px;
    out.push(`<line class="grid" x1="${gx}" x2="${gx}" y1="${AXIS - 4}" y2="${height}"/>`);
    out.push(`<text x="${gx + 3}" y="${AXIS - 8}">${t === 0 ? "0" : fmtMs(t)}</text>`);
  }
  out.push(`</g>`);
  let openBars = 0;
  rows.forEach(({ span: s, depth }, i) => {
    const y = AXIS + i * ROW;
    const end = s.end !== null ? s.end : now !== null ? Math.max(now, s.start) : s.start;
    const open = s.end === null;
    if (open) openBars++;
    const duration = s.end !== null ? s.duration : end - s.start;
    const bx = x(s.start);
    const bw = (end - s.start) * px;
    const paint = colour(s.service);
    const faults = faultsOf(s);
    const error = s.error || s.attrs["error.type"];
    const name = s.name.length > 34 - depth * 2 ? s.name.slice(0, 33 - depth * 2) + "…" : s.name;
    const cls = ["bar", open ? "open" : "", error ? "error" : "", faults.length ? "fault" : ""].join(" ").trim();
    out.push(`<g class="row" data-row="${esc(s.id)}">`);
    out.push(`<rect class="band" x="0" y="${y}" width="${width}" height="${ROW}"/>`);
    out.push(`<text x="${6 + depth * 12}" y="${y + 15}"><title>${esc(s.name)}</title>${esc(name)}</text>`);
    out.push(`<rect class="${cls}" x="${bx}" y="${y + 4}" width="${bw}" height="${ROW - 10}" fill="${paint}"` +
      ` data-span-id="${esc(s.id)}" data-parent-span-id="${esc(s.parent)}" data-name="${esc(s.name)}"` +
      ` data-stage="${esc(s.stage || "")}" data-service="${esc(s.service || "")}"` +
      ` data-start-ms="${s.start - origin}" data-duration-ms="${duration}" data-open="${open}"` +
      ` data-fault="${esc(faults.map(([k, v]) => `${k}=${v}`).join(" "))}" data-error="${esc(error || "")}"/>`);
    // Spans too short to see still get a visible stub; the bar itself keeps its true width.
    if (bw < 2) out.push(`<rect class="stub" x="${bx}" y="${y + 4}" width="2" height="${ROW - 10}" fill="${paint}"/>`);
    if (faults.length) {
      out.push(`<rect class="hatch" x="${bx}" y="${y + 4}" width="${Math.max(bw, 2)}" height="${ROW - 10}" fill="url(#hatch)"/>`);
    }
    const tokens = s.events.filter((e) => e.name === "token");
    for (const e of tokens) {
      const tx = x(e.at);
      out.push(`<line class="tick" x1="${tx}" x2="${tx}" y1="${y + ROW - 5}" y2="${y + ROW - 1}"/>`);
    }
    let mx = bx + Math.max(bw, 2) + 3;
    if (faults.length) {
      out.push(`<text class="mark fault" x="${mx}" y="${y + 14}"><title>${esc(faults.map(([k, v]) => `${k} = ${v}`).join("\n"))}</title>⚡</text>`);
      mx += 14;
    }
    if (error) out.push(`<text class="mark error" x="${mx}" y="${y + 14}"><title>${esc(error)}</title>✕</text>`);
    const label = fmtMs(duration) + (tokens.length ? ` · ${tokens.length} tok` : "");
    out.push(`<text class="dur" x="${width - 4}" y="${y + 15}" text-anchor="end">${label}</text>`);
    out.push(`</g>`);
  });
  if (now !== null && rows.length) out.push(`<line class="now" x1="${x(now)}" x2="${x(now)}" y1="${AXIS - 4}" y2="${height}"/>`);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.innerHTML = out.join("");
  svg.dataset.traceId = trace.id;
  svg.dataset.pxPerMs = px;
  svg.dataset.originMs = origin;
  svg.dataset.totalMs = total;
  svg.dataset.bars = rows.length;
  if (openBars) svg.dataset.openFrames = String(Number(svg.dataset.openFrames || 0) + 1);
  const root = trace.root();
  $("wf-foot").textContent = rows.length
    ? `${rows.length} spans · ${trace.events} events` + (trace.dropped ? ` · ${trace.dropped} dropped` : "") +
      (trace.live ? " · live from the stage-event stream" : " · from the trace buffer") +
      (root && root.attrs["rag.fault.plan"] ? ` · fault plan: ${root.attrs["rag.fault.plan"]}` : "")
    : "";
  drawLinks(trace);
}

function fill(template, trace, span) {
  const seconds = (nanos) => (nanos ? Number(BigInt(nanos) / 1000000000n) : Math.floor(Date.now() / 1000));
  const root = trace.root();
  const from = seconds((span || root || {}).startNano) - 60;
  const until = seconds((span || root || {}).endNano) + 60;
  return template
    .replaceAll("{trace_id}", trace.id)
    .replaceAll("{span_id}", span ? span.id : root ? root.id : "")
    .replaceAll("{service}", encodeURIComponent(page.config.service_name))
    .replaceAll("{from}", String(from))
    .replaceAll("{until}", String(until));
}

function drawLinks(trace) {
  const links = (page.config && page.config.links) || {};
  const out = [];
  if (links.jaeger) out.push(`<a target="_blank" rel="noopener" href="${esc(fill(links.jaeger, trace))}">Jaeger ↗</a>`);
  if (links.tempo) out.push(`<a target="_blank" rel="noopener" href="${esc(fill(links.tempo, trace))}">Tempo ↗</a>`);
  const html = out.join("");
  if ($("wf-links").innerHTML !== html) $("wf-links").innerHTML = html;
  $("wf-title").textContent = `trace ${trace.id}`;
}

function showDetail(trace, id) {
  const s = trace.spans.get(id);
  if (!s) return;
  const links = (page.config && page.config.links) || {};
  const rows = Object.entries(s.attrs)
    .map(([k, v]) => `<tr class="${k.startsWith("rag.fault.") ? "fault" : ""}"><td>${esc(k)}</td><td>${esc(v)}</td></tr>`)
    .join("");
  const tokens = s.events.filter((e) => e.name === "token").length;
  const duration = s.end !== null ? s.duration : null;
  const flame = links.pyroscope && s.end !== null
    ? ` · <a target="_blank" rel="noopener" href="${esc(fill(links.pyroscope, trace, s))}">flame graph ↗</a>` : "";
  const box = $("detail");
  box.hidden = false;
  box.innerHTML = `<div><b>${esc(s.name)}</b> <span class="muted">${esc(s.service || "")} · span ${esc(s.id)}</span>` +
    ` · ${duration !== null ? fmtMs(duration) : "running"}${tokens ? ` · ${tokens} tokens` : ""}${flame}</div>` +
    (s.error ? `<div class="fault">error: ${esc(s.error)}</div>` : "") +
    `<table>${rows}</table>`;
}

function drawLegend() {
  const c = page.config;
  $("legend").innerHTML = c.services
    .map((s) => `<span><i style="background:${c.colours[s]}"></i>${esc(s)}</span>`)
    .concat([`<span><i style="background:${c.other_colour}"></i>request</span>`, `<span>⚡ injected fault</span>`, `<span>┃ token</span>`])
    .join("");
}

function animate() {
  cancelAnimationFrame(page.frame);
  const tick = () => {
    const t = page.trace;
    if (!t) return;
    draw(t);
    if (t.live && !t.ended) page.frame = requestAnimationFrame(tick);
  };
  tick();
}

// ---------------------------------------------------------------- asking

function hex(bytes) {
  const b = crypto.getRandomValues(new Uint8Array(bytes));
  return [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
}

// Opens the trace's stage stream; resolves true once the server has subscribed us. Read with
// fetch rather than EventSource, which cannot send the API key.
function subscribe(trace) {
  return new Promise((resolve) => {
    let settled = false;
    const settle = (ok) => {
      if (!settled) {
        settled = true;
        resolve(ok);
      }
    };
    const ctl = new AbortController();
    trace.source = { close: () => ctl.abort() };
    const stop = () => {
      ctl.abort();
      trace.resolveEnd();
    };
    setTimeout(() => settle(false), 4000);
    const spanEvents = ["span_start", "span_update", "span_event", "span_end"];
    api(`/debug/stages?trace_id=${trace.id}`, { signal: ctl.signal })
      .then(async (r) => {
        if (!r.ok) throw new Error(`HTTP ${r.status}`);
        await readSse(r.body, (name, data) => {
          if (name === "subscribed") {
            trace.clock = { now: data.now_ms, at: performance.now() };
            settle(true);
          } else if (spanEvents.includes(name)) trace.apply(data);
          else if (name === "trace_end") {
            trace.apply(data);
            stop();
          } else if (name === "timeout") stop();
        });
        stop();
      })
      .catch(() => {
        stop();
        settle(false);
      });
  });
}

// ---------------------------------------------------------------- API keys

// With API keys on (README "Security"), every call but the probes needs `Authorization`; the
// page asks once for a key (an admin key also shows traces) and keeps it in this browser.
const KEY_STORE = "ragscope.apiKey";
const declined = new Set();

function keyHeader() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { authorization: `Bearer ${key}` } : {};
}

function askForKey(status) {
  if (declined.has(status)) return false;
  const question = status === 401 ? "This server needs an API key:" : "This needs an admin API key (traces, stage events):";
  const key = (window.prompt(question, "") || "").trim();
  if (!key) {
    declined.add(status);
    return false;
  }
  localStorage.setItem(KEY_STORE, key);
  return true;
}

// fetch with the stored key, asking for one (and retrying once) when the server refuses.
async function api(url, opts = {}) {
  const send = () => fetch(url, { ...opts, headers: { ...(opts.headers || {}), ...keyHeader() } });
  const r = await send();
  return (r.status === 401 || r.status === 403) && askForKey(r.status) ? send() : r;
}

// Reads an SSE response body, calling `on(event, data)` per event.
async function readSse(body, on) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    text += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = text.search(/\r?\n\r?\n/)) >= 0) {
      const block = text.slice(0, cut);
      text = text.slice(cut).replace(/^\r?\n\r?\n/, "");
      let event = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) on(event, JSON.parse(data.join("\n")));
    }
  }
}

function faultPlan() {
  const v = $("fault").value;
  if (!v || $("fault-box").hidden) return null;
  return v === "custom" ? $("fault-json").value.trim() || null : v;
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function setState(state, outcome) {
  document.body.dataset.state = state;
  if (outcome) document.body.dataset.outcome = outcome;
  $("go").disabled = state === "running";
}

function showSources(sources) {
  $("sources").innerHTML = sources
    .map((s) => `<li><span class="doc">${esc(s.doc_id)}</span><span class="score">score ${Number(s.score).toFixed(3)}</span>` +
      `<div class="snippet">${esc(s.text)}</div></li>`)
    .join("");
}

async function ask(event) {
  event.preventDefault();
  if (document.body.dataset.state === "running") return;
  const query = $("question").value.trim();
  if (!query) return;
  const trace = new Trace(hex(16), true);
  page.trace = trace;
  document.body.dataset.traceId = trace.id;
  $("waterfall").dataset.openFrames = "0";
  $("detail").hidden = true;
  $("answer").textContent = "";
  $("answer").classList.remove("muted");
  $("sources").innerHTML = "";
  $("usage").textContent = "";
  $("finish").textContent = "";
  setState("running");
  const live = await subscribe(trace);
  animate();
  const headers = { "content-type": "application/json", traceparent: `00-${trace.id}-${hex(8)}-01` };
  const plan = faultPlan();
  if (plan) headers["x-ragscope-fault"] = plan;
  const body = { query, stream: true, max_tokens: numberField("max-tokens"), top_k: numberField("top-k"),
    rerank_top_n: numberField("rerank-top-n") };
  let outcome = "ok";
  const fail = (message) => {
    outcome = "error";
    $("finish").textContent = "· failed";
    $("usage").innerHTML = `<span class="bad">${esc(message)}</span>`;
  };
  try {
    const r = await api("/v1/rag/query", { method: "POST", headers, body: JSON.stringify(body) });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      fail((e.error && e.error.message) || `HTTP ${r.status}`);
    } else {
      await readSse(r.body, (name, data) => {
        if (name === "sources") showSources(data);
        else if (name === "token") $("answer").textContent += data.text;
        else if (name === "done") {
          $("finish").textContent = `· ${data.finish_reason}`;
          const t = data.timings || {};
          $("usage").textContent = `${data.usage.prompt_tokens} prompt + ${data.usage.completion_tokens} completion tokens` +
            (t.total_ms !== undefined ? ` · ${fmtMs(t.total_ms)} total` : "");
        } else if (name === "error") fail(data.error.message);
      });
    }
  } catch (e) {
    fail(String(e));
  }
  // The request span ends just after the last byte: wait for its trace_end, briefly.
  await Promise.race([trace.ending, new Promise((r) => setTimeout(r, 5000))]);
  if (trace.source) trace.source.close();
  if (!live || !trace.ended || trace.dropped > 0) {
    // Missed events (no stream, or a slow one): draw the stored trace instead.
    await showStored(trace.id, true);
  } else {
    draw(trace);
  }
  setState("done", outcome);
  loadRecent();
}

// ---------------------------------------------------------------- stored traces

async function showStored(id, quiet) {
  const r = await api(`/ui/traces/${id}`);
  if (!r.ok) {
    if (!quiet) $("wf-foot").textContent = `trace ${id}: not in the trace buffer`;
    return;
  }
  const stored = await r.json();
  const trace = new Trace(id, false);
  for (const ev of stored.events) trace.apply(ev);
  trace.ended = true;
  page.trace = trace;
  cancelAnimationFrame(page.frame);
  $("detail").hidden = true;
  draw(trace);
  for (const tr of document.querySelectorAll("#recent tbody tr")) tr.classList.toggle("selected", tr.dataset.traceId === id);
}

async function loadRecent() {
  const table = $("recent");
  const r = await api("/ui/traces?limit=30").catch(() => null);
  if (!r || !r.ok) {
    table.innerHTML = `<tr><td class="muted">the trace buffer is off</td></tr>`;
    return;
  }
  const d = await r.json();
  const serviceOf = Object.fromEntries(page.config.stages.map((s) => [s.stage, s.service]));
  const cols = d.stages.map((s) => s.stage);
  const head = cols
    .map((c) => `<th>${serviceOf[c] ? `<i style="background:${colour(serviceOf[c])}"></i>` : ""}${esc(c)}</th>`)
    .join("");
  const stat = (label, key) => {
    const by = Object.fromEntries(d.stages.map((s) => [s.stage, s[key]]));
    return `<tr class="stat"><td></td><td>${label} of ${d.end_to_end.count} answered</td><td></td><td>${fmtMs(d.end_to_end[key])}</td>` +
      cols.map((c) => `<td>${fmtMs(by[c])}</td>`).join("") + `</tr>`;
  };
  // End to end per route and status: bad-input probes and failures are not pooled with answers.
  const groups = (d.end_to_end.by_route_and_status || [])
    .map((g) => `<tr class="stat"><td></td><td>${esc(g.request)} × ${g.count}</td>` +
      `<td class="${g.status >= 400 ? "bad" : ""}">${g.status === null ? "" : g.status}</td>` +
      `<td>${fmtMs(g.p50_ms)} / ${fmtMs(g.p95_ms)}</td><td colspan="${cols.length}" class="muted">p50 / p95</td></tr>`)
    .join("");
  const rows = d.requests
    .map((q) => {
      const when = new Date(Number(BigInt(q.start_unix_nano) / 1000000n)).toLocaleTimeString();
      const status = q.status === null ? "" : q.status;
      const flt = q.faults.length ? ` <span class="flt" title="${esc(q.faults.join("\n"))}">⚡</span>` : "";
      return `<tr data-trace-id="${q.trace_id}"><td>${when}</td><td>${esc(q.name)}${flt}</td>` +
        `<td class="${q.status >= 400 ? "bad" : ""}">${status}</td><td>${fmtMs(q.duration_ms)}</td>` +
        cols.map((c) => `<td>${fmtMs(q.stages[c])}</td>`).join("") + `</tr>`;
    })
    .join("");
  table.innerHTML = `<thead><tr><th>time</th><th>request</th><th>status</th><th>total</th>${head}</tr>` +
    `${stat("p50", "p50_ms")}${stat("p95", "p95_ms")}${groups}</thead><tbody>${rows ||
      `<tr><td colspan="4" class="muted">no finished requests yet</td></tr>`}</tbody>`;
  for (const tr of table.querySelectorAll("tbody tr[data-trace-id]")) {
    tr.addEventListener("click", () => showStored(tr.dataset.traceId));
    if (page.trace && tr.dataset.traceId === page.trace.id) tr.classList.add("selected");
  }
}

// ---------------------------------------------------------------- start

async function checkServer() {
  const r = await fetch("/ready").catch(() => null);
  const d = r ? await r.json().catch(() => ({})) : {};
  const ready = d.status === "ready";
  $("server").innerHTML = `<span class="dot ${ready ? "ready" : "loading"}"></span>` +
    esc(ready ? `${d.models.generator} · ${d.models.embedder} · ${d.store.points} chunks` : d.status || "unreachable");
  if (!ready) setTimeout(checkServer, 2000);
}

async function start() {
  page.config = await (await api("/ui/config")).json();
  $("fault-box").hidden = !page.config.fault_header;
  drawLegend();
  $("ask").addEventListener("submit", ask);
  $("refresh").addEventListener("click", loadRecent);
  $("fault").addEventListener("change", () => ($("fault-json").hidden = $("fault").value !== "custom"));
  $("waterfall").addEventListener("click", (e) => {
    const id = e.target.dataset && e.target.dataset.spanId;
    if (id && page.trace) showDetail(page.trace, id);
  });
  window.addEventListener("resize", () => page.trace && draw(page.trace));
  const q = new URLSearchParams(location.search);
  if (q.get("q")) $("question").value = q.get("q");
  checkServer();
  await loadRecent();
  if (q.get("trace")) showStored(q.get("trace"));
  document.body.dataset.ready = "true";
}

start();
