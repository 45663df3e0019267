// The Agora monitor's dashboard: polls the JSON API (see the package README) and draws it.
// No library, nothing from the network but this monitor: charts are drawn on <canvas>.
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#db2777", "#65a30d"];
const state = { run: null, periodS: 5, updates: 0, timer: null };
// What the page shows, for anyone (a browser test) to read: points per chart, updates done.
window.agoraDashboard = { updates: 0, points: {}, lastError: null };

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${path}: HTTP ${response.status}`);
  return body;
}

function fmt(value, digits = 0) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return value.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function ago(t, now) {
  if (!t) return "–";
  const s = Math.max(0, now - t);
  if (s < 90) return `${s.toFixed(0)} s ago`;
  if (s < 5400) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

// --- charts ----------------------------------------------------------------------------------

function niceRange(values) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (!isFinite(lo) || !isFinite(hi)) return [0, 1];
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

// lines: [{label, xs, ys}] (ys may hold nulls: gaps); opts: {time: bool (xs are epoch s)}
function drawChart(canvas, lines, opts = {}) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, left = 52, right = 10, top = 18, bottom = 24;
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  const xs = [], ys = [];
  for (const line of lines) {
    line.xs.forEach((x, i) => { if (line.ys[i] !== null && line.ys[i] !== undefined) { xs.push(x); ys.push(line.ys[i]); } });
  }
  canvas.dataset.points = String(ys.length);
  if (ys.length === 0) {
    ctx.fillStyle = "#6b7280";
    ctx.fillText("no data yet", w / 2 - 28, h / 2);
    return 0;
  }
  const [x0, x1] = niceRange(xs), [y0, y1] = niceRange(ys);
  const px = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - right);
  const py = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
  ctx.strokeStyle = "#e5e7eb";
  ctx.fillStyle = "#6b7280";
  for (let i = 0; i <= 4; i++) {  // grid and axis labels
    const y = y0 + ((y1 - y0) * i) / 4, yy = py(y);
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(w - right, yy); ctx.stroke();
    ctx.fillText(fmt(y, Math.abs(y1 - y0) < 10 ? 2 : 0), 2, yy + 4);
    const x = x0 + ((x1 - x0) * i) / 4;
    ctx.fillText(opts.time ? clock(x) : fmt(x), Math.min(px(x) - 16, w - 60), h - 6);
  }
  lines.forEach((line, n) => {
    ctx.strokeStyle = COLORS[n % COLORS.length];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    line.xs.forEach((x, i) => {
      const y = line.ys[i];
      if (y === null || y === undefined) { pen = false; return; }
      if (pen) ctx.lineTo(px(x), py(y)); else ctx.moveTo(px(x), py(y));
      pen = true;
    });
    ctx.stroke();
    if (lines.length > 1) {
      ctx.fillStyle = ctx.strokeStyle;
      ctx.fillText(line.label, left + 6 + n * 64, 12);
    }
  });
  return ys.length;
}

function chart(id, lines, opts) {
  window.agoraDashboard.points[id] = drawChart(document.getElementById(id), lines, opts);
}

// --- tables ----------------------------------------------------------------------------------

function fillTable(id, rows, cells, rowClass = () => "") {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((row, i) => {
    const tr = document.createElement("tr");
    tr.className = rowClass(row);
    for (const cell of cells(row, i)) {
      const td = document.createElement("td");
      if (cell && typeof cell === "object") { td.textContent = cell.text; td.className = cell.cls || ""; td.title = cell.title || ""; }
      else td.textContent = cell;
      tr.appendChild(td);
    }
    return tr;
  }));
}

function figures(overview, alerts) {
  const latest = overview.latest || {};
  const items = [
    ["loss", fmt(latest.loss, 3)], ["samples", fmt(latest.samples)], ["tokens/s", fmt(latest.tokens_per_s)],
    ["workers", fmt(latest.workers)], ["trainers", fmt(latest.trainers)], ["alerts", String(alerts.length)],
  ];
  document.getElementById("figures").replaceChildren(...items.map(([label, value]) => {
    const div = document.createElement("div");
    div.className = "figure";
    div.innerHTML = `<div class="value"></div><div class="label"></div>`;
    div.firstChild.textContent = value;
    div.lastChild.textContent = label;
    return div;
  }));
}

// --- polling ---------------------------------------------------------------------------------

async function loadRuns() {
  const answer = await getJson("/api/runs");
  state.periodS = answer.period_s || 5;
  const select = document.getElementById("run-select");
  const wanted = new URLSearchParams(location.hash.slice(1)).get("run");
  const names = answer.runs.map((r) => r.run);
  select.replaceChildren(...names.map((name) => new Option(name, name)));
  state.run = names.includes(wanted) ? wanted : names.includes(state.run) ? state.run : names[0] || null;
  if (state.run) select.value = state.run;
  select.parentElement.style.display = names.length > 1 ? "" : "none";  // a selector only for several runs
}

async function update() {
  try {
    await loadRuns();  // runs appear while the page is open
    if (!state.run) { document.getElementById("status").textContent = "no run in the database yet"; return; }
    const base = `/api/runs/${encodeURIComponent(state.run)}`;
    const [overview, series, nodes, board, alerts] = await Promise.all(
      ["overview", "series?points=300", "nodes", "leaderboard", "alerts"].map((p) => getJson(`${base}/${p}`)));
    const now = overview.now;
    figures(overview, alerts.alerts);
    chart("chart-loss-samples", [{ label: "loss", xs: series.samples, ys: series.loss }]);
    chart("chart-loss-time", [{ label: "loss", xs: series.t, ys: series.loss }], { time: true });
    chart("chart-tokens", [{ label: "tokens/s", xs: series.t, ys: series.tokens_per_s }], { time: true });
    const stages = Object.entries(series.stages);
    chart("chart-workers", stages.map(([s, v]) => ({ label: `stage ${s}`, xs: v.t, ys: v.workers_serving })), { time: true });
    chart("chart-steps", stages.map(([s, v]) => ({ label: `stage ${s}`, xs: v.t, ys: v.step })), { time: true });
    chart("chart-averaging", stages.map(([s, v]) => ({ label: `stage ${s}`, xs: v.t, ys: v.averaging_success })), { time: true });
    fillTable("alerts", alerts.alerts, (a) => [{ text: a.severity, cls: a.severity }, a.name, a.subject, a.message, ago(a.since, now)]);
    const averaging = Object.fromEntries(stages.map(([s, v]) => [s, v.averaging_success[v.averaging_success.length - 1]]));
    fillTable("stages", overview.stages, (s) => [s.stage, fmt(s.step), ago(s.step_changed_t, now), s.workers_serving, fmt(s.samples),
      { text: (s.samples_gap >= 0 ? "+" : "") + fmt(s.samples_gap), cls: s.reconciled ? "ok" : "warning" }, fmt(averaging[s.stage], 2)]);
    fillTable("nodes", nodes.nodes, (n) => [{ text: n.node_id.slice(0, 12), title: n.node_id }, n.role, n.stage ?? "–", n.phase ?? "–",
      fmt(n.samples), fmt(n.throughput, 1), n.live ? "live" : ago(n.last_seen, now), n.version ?? "–", n.account || "–",
      n.termination_reason ? { text: n.termination_reason, cls: "warning", title: n.termination_detail || "" } : (n.live ? "–" : n.left_t ? { text: "left", title: "stopped cleanly: it announced leaving the DHT" }
        : n.lost_t ? { text: "lost", cls: "warning", title: "vanished from the DHT without leaving" } : "–")],
    (n) => (n.live ? "" : "dead"));
    fillTable("leaderboard", board.accounts, (a, i) => [i + 1, a.account || "(open run)", `${a.nodes} (${a.live})`, a.workers, a.trainers,
      fmt(a.worker_samples), fmt(a.trainer_samples)]);
    const t = overview.latest ? overview.latest.t : null;
    document.getElementById("status").textContent = t ? `last snapshot ${ago(t, now)} · every ${state.periodS} s` : "waiting for the first snapshot";
    window.agoraDashboard.updates = ++state.updates;
    window.agoraDashboard.lastError = null;
  } catch (error) {
    window.agoraDashboard.lastError = String(error);
    document.getElementById("status").textContent = `error: ${error.message}`;
  }
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(async () => { await update(); schedule(); }, state.periodS * 1000);
}

document.getElementById("run-select").addEventListener("change", (event) => {
  state.run = event.target.value;
  location.hash = `run=${encodeURIComponent(state.run)}`;
  update();
});

(async () => { await update(); schedule(); })();
