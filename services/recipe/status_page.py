"""The ``/status`` page: one self-contained HTML document (inline CSS and JS, charts drawn on
``<canvas>`` by hand, nothing fetched but ``/status.json``), polled every 1.5 s.

Kept as a Python string rather than a ``.html`` file so that it ships wherever the package
does (the image installs ``services`` as a package, which carries no data files).

Hooks the browser test reads (``tests/integration/test_status_page.py``): ``body[data-rendered]``
counts successful renders, ``body[data-error]`` holds the last fetch error, each panel is
``section.panel#panel-*``, instance rows are ``tr.instance``, instances loading their model are
``tr.loading`` rows (``data-state``: loading, loaded, failed, silent), and each chart canvas has
``data-points``: the data points it drew.
"""

from __future__ import annotations

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>deepserve status</title>
<style>
  :root { --bg:#f5f6f8; --panel:#fff; --ink:#1f2937; --muted:#6b7280; --line:#e5e7eb;
          --ok:#16a34a; --warn:#d97706; --bad:#dc2626; --blue:#2563eb; }
  * { box-sizing: border-box; }
  body { margin:0; background:var(--bg); color:var(--ink);
         font:14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
  header { display:flex; align-items:center; gap:16px; padding:12px 20px; background:#111827;
           color:#f9fafb; flex-wrap:wrap; }
  header h1 { font-size:18px; margin:0; font-weight:600; }
  header .updated { color:#9ca3af; font-size:12px; margin-left:auto; }
  .chips { display:flex; gap:6px; flex-wrap:wrap; }
  .chip { font-size:12px; padding:2px 8px; border-radius:10px; background:#374151; }
  .chip.ok::before, .chip.bad::before { content:"\25CF "; }
  .chip.ok::before { color:#4ade80; } .chip.bad::before { color:#f87171; }
  #banner { display:none; padding:8px 20px; background:#fee2e2; color:#991b1b; }
  main { display:grid; gap:16px; padding:16px 20px;
         grid-template-columns: minmax(0,1fr) minmax(0,1fr);
         grid-template-areas: "inst inst" "hit kv" "err err"; }
  @media (max-width: 900px) {
    main { grid-template-columns: minmax(0,1fr); grid-template-areas: "inst" "hit" "kv" "err"; }
  }
  .panel { background:var(--panel); border:1px solid var(--line); border-radius:8px;
           padding:12px 16px; min-height:120px; }
  .panel h2 { font-size:15px; margin:0 0 8px; display:flex; gap:8px; align-items:baseline; }
  .panel h2 small { color:var(--muted); font-weight:400; font-size:12px; }
  #panel-instances { grid-area:inst; } #panel-hit { grid-area:hit; }
  #panel-kvstore { grid-area:kv; } #panel-errors { grid-area:err; }
  table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
  th, td { text-align:right; padding:4px 8px; border-bottom:1px solid var(--line); }
  th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align:left; }
  th { font-size:12px; color:var(--muted); font-weight:500; }
  tr.group td { background:#f3f4f6; font-weight:600; }
  tr.instance td:first-child { padding-left:20px; font-family:ui-monospace, monospace;
                               font-size:12px; }
  .state { font-size:11px; padding:1px 6px; border-radius:8px; color:#fff; }
  .state.live { background:var(--ok); } .state.draining { background:var(--warn); }
  .state.silent, .state.failed { background:var(--bad); }
  .state.loading { background:var(--blue); } .state.loaded { background:var(--ok); }
  #loading-box h3 { font-size:13px; margin:12px 0 4px; font-weight:600; }
  td.error { color:var(--bad); text-align:left; font-size:12px; }
  .bar { display:inline-block; width:80px; height:8px; background:#e5e7eb; border-radius:4px;
         vertical-align:middle; margin-right:6px; overflow:hidden; }
  .bar > span { display:block; height:100%; background:var(--blue); }
  .bar.hot > span { background:var(--warn); } .bar.full > span { background:var(--bad); }
  .big { font-size:26px; font-weight:600; }
  .muted { color:var(--muted); }
  .row { display:flex; gap:24px; align-items:baseline; flex-wrap:wrap; margin-bottom:6px; }
  canvas { width:100%; height:180px; display:block; }
  .legend { display:flex; gap:14px; font-size:12px; color:var(--muted); margin-top:4px; }
  .legend i { display:inline-block; width:10px; height:10px; border-radius:2px;
              margin-right:4px; vertical-align:-1px; }
  .badge { font-size:12px; padding:2px 8px; border-radius:10px; color:#fff; }
  .badge.ok { background:var(--ok); } .badge.degraded { background:var(--warn); }
  .badge.unreachable { background:var(--bad); } .badge.none { background:#9ca3af; }
  .targets { display:grid; grid-template-columns:repeat(auto-fill, minmax(22px, 1fr));
             gap:4px; margin:8px 0; }
  .target { height:22px; border-radius:4px; background:var(--ok); }
  .target.down { background:var(--bad); }
  .errors { color:var(--bad); font-size:12px; }
  .empty { color:var(--muted); padding:12px 0; }
</style>
</head>
<body data-rendered="0">
<header>
  <h1>deepserve status</h1>
  <div class="chips" id="sources"></div>
  <div class="updated" id="updated">waiting for data</div>
</header>
<div id="banner"></div>
<main>
  <section class="panel" id="panel-instances">
    <h2>Instances <small id="inst-summary"></small></h2>
    <table id="instances">
      <thead><tr><th>instance</th><th>state</th><th>running</th><th>waiting</th>
        <th>queued tokens</th><th>KV use</th><th>KV blocks</th></tr></thead>
      <tbody></tbody>
    </table>
    <div class="empty" id="inst-empty">No heartbeats yet.</div>
    <div id="loading-box" style="display:none">
      <h3>Loading their model</h3>
      <table id="loading">
        <thead><tr><th>instance</th><th>state</th><th>loaded</th><th>shards</th>
          <th>read</th><th>rate</th><th>time left</th><th>took</th></tr></thead>
        <tbody></tbody>
      </table>
    </div>
  </section>
  <section class="panel" id="panel-hit">
    <h2>Prompt cache hit rate <small id="hit-window"></small></h2>
    <div class="row"><span class="big" id="hit-now">&ndash;</span>
      <span class="muted" id="hit-total"></span></div>
    <canvas id="chart-hit" data-points="0"></canvas>
    <div class="legend"><span><i style="background:#2563eb"></i>cached / prompt tokens</span></div>
  </section>
  <section class="panel" id="panel-kvstore">
    <h2>kvstore <span class="badge none" id="kv-state">&ndash;</span></h2>
    <div class="row"><span class="big" id="kv-use">&ndash;</span>
      <span class="muted" id="kv-size"></span></div>
    <div><span class="bar" id="kv-bar" style="width:100%"><span style="width:0"></span></span></div>
    <div class="muted" style="margin-top:8px">storage targets
      <span id="kv-targets-summary"></span></div>
    <div class="targets" id="kv-targets"></div>
    <div class="row"><span>degraded reads: <b id="kv-degraded">&ndash;</b></span>
      <span>lost blocks: <b id="kv-lost">&ndash;</b></span></div>
    <div class="errors" id="kv-errors"></div>
  </section>
  <section class="panel" id="panel-errors">
    <h2>Errors and retries <small id="err-window"></small></h2>
    <div class="row">
      <span>requests <b id="rate-requests">&ndash;</b></span>
      <span>errors (5xx) <b id="rate-errors">&ndash;</b></span>
      <span>error ratio <b id="rate-ratio">&ndash;</b></span>
      <span>rejected (429) <b id="rate-rejected">&ndash;</b></span>
      <span>entrypoint retries <b id="rate-retries">&ndash;</b></span>
    </div>
    <canvas id="chart-errors" data-points="0"></canvas>
    <div class="legend">
      <span><i style="background:#dc2626"></i>errors/s</span>
      <span><i style="background:#d97706"></i>retries/s</span>
      <span><i style="background:#7c3aed"></i>rejected/s</span>
    </div>
  </section>
</main>
<script>
"use strict";
const POLL_MS = 1500;
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function num(v, digits) {
  if (v === null || v === undefined) return "\u2013";
  return Number(v).toLocaleString(undefined, {maximumFractionDigits: digits ?? 0});
}
function pct(v) { return v === null || v === undefined ? "\u2013" : (100 * v).toFixed(1) + "%"; }
function perS(v) { return v === null || v === undefined ? "\u2013" : num(v, 2) + "/s"; }
function bytes(v) {
  if (v === null || v === undefined) return "\u2013";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
function bar(frac) {
  const b = el("span", "bar" + (frac >= 0.95 ? " full" : frac >= 0.8 ? " hot" : ""));
  const fill = el("span");
  fill.style.width = Math.max(0, Math.min(1, frac || 0)) * 100 + "%";
  b.appendChild(fill);
  return b;
}

function renderSources(s) {
  const box = $("sources");
  box.replaceChildren();
  const add = (name, ok, title) => {
    const c = el("span", "chip " + (ok ? "ok" : "bad"), name);
    c.title = title || "";
    box.appendChild(c);
  };
  add("NATS", s.nats.ok, s.nats.detail);
  for (const kind of ["balancer", "entrypoint", "kvstore"]) {
    const list = s[kind] || [];
    if (!list.length) { box.appendChild(el("span", "chip", kind + ": not configured")); continue; }
    const bad = list.filter((x) => !x.ok);
    add(kind + (list.length > 1 ? " \u00d7" + list.length : ""), bad.length === 0,
        bad.map((x) => x.address + ": " + x.error).join("\n"));
  }
}

function renderInstances(rows) {
  const body = document.querySelector("#instances tbody");
  body.replaceChildren();
  $("inst-empty").style.display = rows.length ? "none" : "block";
  const groups = new Map();
  for (const r of rows) {
    const key = r.role + (r.bucket ? " \u00b7 bucket " + r.bucket : "");
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(r);
  }
  let live = 0;
  for (const [name, list] of groups) {
    const sum = (f) => list.reduce((a, r) => a + (r[f] || 0), 0);
    const used = sum("kv_used_blocks"), total = sum("kv_total_blocks");
    const g = el("tr", "group");
    g.dataset.role = list[0].role;
    g.dataset.bucket = list[0].bucket;
    g.append(el("td", "", name + " (" + list.length + ")"), el("td"),
             el("td", "", num(sum("running"))), el("td", "", num(sum("waiting"))),
             el("td", "", num(sum("queued_tokens"))));
    const kv = el("td");
    if (total) { kv.append(bar(used / total), pct(used / total)); } else kv.textContent = "\u2013";
    g.append(kv, el("td", "", total ? num(used) + " / " + num(total) : "\u2013"));
    body.appendChild(g);
    for (const r of list) {
      if (r.state !== "silent") live++;
      const tr = el("tr", "instance");
      tr.dataset.role = r.role;
      const state = el("td");
      const badge = el("span", "state " + r.state, r.state);
      badge.title = "last heartbeat " + r.age_s + " s ago";
      state.appendChild(badge);
      tr.append(el("td", "", r.id), state, el("td", "", num(r.running)),
                el("td", "", num(r.waiting)), el("td", "", num(r.queued_tokens)));
      const kv2 = el("td");
      if (r.kv_use !== null) { kv2.append(bar(r.kv_use), pct(r.kv_use)); }
      else kv2.textContent = "\u2013";
      tr.append(kv2, el("td", "", r.kv_total_blocks ?
        num(r.kv_used_blocks) + " / " + num(r.kv_total_blocks) : "\u2013"));
      body.appendChild(tr);
    }
  }
  const roles = (role) => rows.filter((r) => r.role === role).length;
  $("inst-summary").textContent = roles("prefill") + " prefill, " + roles("decode") +
    " decode, " + live + " live";
}

function secs(v) {
  if (v === null || v === undefined) return "\u2013";
  return v >= 120 ? (v / 60).toFixed(1) + " min" : v.toFixed(0) + " s";
}

function renderLoading(rows) {
  const body = document.querySelector("#loading tbody");
  body.replaceChildren();
  $("loading-box").style.display = rows.length ? "block" : "none";
  for (const r of rows) {
    const tr = el("tr", "loading");
    tr.dataset.state = r.state;
    tr.dataset.role = r.role;
    const state = el("td");
    const badge = el("span", "state " + r.state, r.state);
    badge.title = "last report " + r.age_s + " s ago";
    state.appendChild(badge);
    const frac = el("td");
    if (r.fraction !== null) frac.append(bar(r.fraction), pct(r.fraction));
    else frac.textContent = "\u2013";
    tr.append(el("td", "", r.role + " " + r.id + (r.source ? " (" + r.source + ")" : "")),
              state, frac);
    if (r.error) {
      const err = el("td", "error", r.error);
      err.colSpan = 5;
      tr.appendChild(err);
    } else {
      tr.append(el("td", "", r.shards_total ? r.shards_done + " / " + r.shards_total : "\u2013"),
                el("td", "", r.bytes_total ? bytes(r.bytes_done) + " / " + bytes(r.bytes_total) :
                  "\u2013"),
                el("td", "", r.read_bytes_per_s === null ? "\u2013" :
                  (r.read_bytes_per_s / 1e9).toFixed(2) + " GB/s"),
                el("td", "", secs(r.eta_s)), el("td", "", secs(r.seconds)));
    }
    body.appendChild(tr);
  }
}

function renderKv(kv, sources) {
  const state = $("kv-state");
  const cls = {ok: "ok", degraded: "degraded", unreachable: "unreachable"}[kv.state] || "none";
  state.className = "badge " + cls;
  state.textContent = kv.state;
  $("kv-use").textContent = kv.capacity_bytes ? pct(kv.use) + " of capacity" :
    kv.stored_bytes !== null ? bytes(kv.stored_bytes) + " stored" : "\u2013";
  $("kv-size").textContent = kv.stored_bytes === null ? (kv.note || "") :
    bytes(kv.stored_bytes) + " in " + num(kv.stored_blocks) + " blocks; capacity " +
    (kv.capacity_bytes ? bytes(kv.capacity_bytes) : "no limit");
  $("kv-bar").style.display = kv.capacity_bytes ? "inline-block" : "none";
  $("kv-bar").firstChild.style.width = Math.min(1, kv.use || 0) * 100 + "%";
  const box = $("kv-targets");
  box.replaceChildren();
  for (const t of kv.targets) {
    const d = el("div", "target" + (t.up ? "" : " down"));
    d.title = t.name + (t.up ? ": up" : ": DOWN");
    box.appendChild(d);
  }
  const down = kv.degraded_targets.length;
  $("kv-targets-summary").textContent = kv.targets.length ?
    "(" + (kv.targets.length - down) + " of " + kv.targets.length + " up" +
    (down ? "; down: " + kv.degraded_targets.join(", ") : "") + ")" : "";
  $("kv-degraded").textContent = perS(kv.degraded_reads_per_s);
  $("kv-lost").textContent = num(kv.lost_blocks);
  $("kv-errors").textContent = sources.filter((s) => !s.ok)
    .map((s) => "kvstore " + s.address + " " + s.error).join("; ");
}

// A line chart of series over t (ms); null values leave gaps. Returns the points drawn.
function drawChart(canvas, t, series, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const L = 48, R = 10, T = 8, B = 22, pw = w - L - R, ph = h - T - B;
  let yMax = opts.yMax;
  if (yMax === undefined) {
    yMax = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > yMax) yMax = v;
    yMax = yMax > 0 ? yMax * 1.2 : 1;
  }
  const now = t.length ? t[t.length - 1] : Date.now();
  const span = Math.max(opts.spanMs, 1);
  const x = (ms) => L + pw * (1 - (now - ms) / span);
  const y = (v) => T + ph * (1 - v / yMax);
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#e5e7eb"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4, yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(L + pw, yy); ctx.stroke();
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    ctx.fillText(opts.yFormat(v), L - 6, yy);
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (let i = 0; i <= 4; i++) {
    const ago = span * (1 - i / 4);
    const label = !ago ? "now" : span <= 120000 ? "-" + Math.round(ago / 1000) + " s" :
      "-" + (ago / 60000).toFixed(1) + " min";
    ctx.fillText(label, L + pw * i / 4, T + ph + 6);
  }
  ctx.strokeStyle = "#9ca3af";
  ctx.beginPath(); ctx.moveTo(L + 0.5, T); ctx.lineTo(L + 0.5, T + ph);
  ctx.lineTo(L + pw, T + ph + 0.5); ctx.stroke();
  let drawn = 0;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 2;
    let open = false;
    ctx.beginPath();
    for (let i = 0; i < t.length; i++) {
      const v = s.values[i];
      if (v === null || v === undefined || now - t[i] > span) { open = false; continue; }
      const px = x(t[i]), py = y(Math.min(v, yMax));
      if (open) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      open = true; drawn++;
    }
    ctx.stroke();
    for (let i = 0; i < t.length; i++) {  // a point with no neighbour is a dot, not nothing
      const v = s.values[i];
      if (v === null || v === undefined || now - t[i] > span) continue;
      const prev = i > 0 ? s.values[i - 1] : null, next = i + 1 < t.length ? s.values[i + 1] : null;
      if ((prev === null || prev === undefined) && (next === null || next === undefined)) {
        ctx.beginPath(); ctx.arc(x(t[i]), y(Math.min(v, yMax)), 3, 0, 2 * Math.PI); ctx.fill();
      }
    }
  }
  canvas.dataset.points = String(drawn);
  return drawn;
}

let last = null;
function render(d) {
  last = d;
  renderSources(d.sources);
  renderInstances(d.instances);
  renderLoading(d.loading || []);
  renderKv(d.kvstore, d.sources.kvstore);
  const h = d.history, r = d.rates, span = Math.max(60000, h.t_ms.length * d.interval_s * 1000);
  const win = "over " + d.rate_window_s + " s, every " + d.interval_s + " s";
  $("hit-window").textContent = win;
  $("err-window").textContent = win;
  $("hit-now").textContent = pct(r.hit_rate);
  $("hit-total").textContent = d.totals.hit_rate === null ? "no prompts yet" :
    pct(d.totals.hit_rate) + " since start";
  drawChart($("chart-hit"), h.t_ms, [{values: h.hit_rate, color: "#2563eb"}],
            {yMax: 1, spanMs: span, yFormat: (v) => Math.round(v * 100) + "%"});
  $("rate-requests").textContent = perS(r.requests_per_s);
  $("rate-errors").textContent = perS(r.errors_per_s);
  $("rate-ratio").textContent = pct(r.error_ratio);
  $("rate-rejected").textContent = perS(r.rejected_per_s);
  $("rate-retries").textContent = perS(r.retries_per_s);
  drawChart($("chart-errors"), h.t_ms, [
    {values: h.errors_per_s, color: "#dc2626"},
    {values: h.retries_per_s, color: "#d97706"},
    {values: h.rejected_per_s, color: "#7c3aed"},
  ], {spanMs: span, yFormat: (v) => (v >= 10 ? v.toFixed(0) : v.toFixed(2))});
  $("updated").textContent = "updated " + new Date(d.generated_unix_ms).toLocaleTimeString();
}

async function poll() {
  try {
    const resp = await fetch("status.json", {cache: "no-store"});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
    $("banner").style.display = "none";
    document.body.removeAttribute("data-error");
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered) + 1);
  } catch (err) {
    const b = $("banner");
    b.textContent = "cannot load status.json: " + err + (last ? " (showing the last data)" : "");
    b.style.display = "block";
    document.body.dataset.error = String(err);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
window.addEventListener("resize", () => { if (last) render(last); });
poll();
</script>
</body>
</html>
"""
