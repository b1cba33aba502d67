// ferry dashboard: subscribes to the gateway's server-sent events and renders them.
// The server pushes one "history" event on connect (back-fill for the charts) and a
// "snapshot" event every second; this file only formats and draws, it computes nothing
// that /metrics does not also expose.
"use strict";
(() => {
  const HISTORY_S = 300; // the charts' x range: the last five minutes
  const series = { t: [], running: [], waiting: [], kv: [], tps: [] };
  const $ = (id) => document.getElementById(id);
  let queueChart = null;
  let kvChart = null;
  let lastSnapshot = null;

  // -- formatting ------------------------------------------------------------
  const dash = "–";
  const fmtInt = (v) => (v == null ? dash : String(Math.round(v)));
  const fmtRate = (v) => (v == null ? dash : v >= 100 ? v.toFixed(0) : v.toFixed(2));
  const fmtPct = (v) => (v == null ? dash : (v * 100).toFixed(1) + "%");
  const fmtSec = (v) => (v == null ? dash : v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s");
  const fmtBytes = (v) => {
    if (v == null) return dash;
    const mib = v / (1 << 20);
    return mib >= 1024 ? (mib / 1024).toFixed(2) + " GiB" : mib.toFixed(0) + " MiB";
  };
  const setText = (id, text) => { const el = $(id); if (el) el.textContent = text; };

  // -- charts ----------------------------------------------------------------
  function chartWidth(el) { return Math.max(300, el.clientWidth - 4); }

  function makeCharts() {
    const qEl = $("queue-chart");
    const kEl = $("kv-chart");
    queueChart = new uPlot({
      width: chartWidth(qEl), height: 220,
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(4, max + 1)] } },
      series: [{}, { label: "running", stroke: "#2563eb", width: 2 },
                   { label: "waiting", stroke: "#f97316", width: 2 }],
      axes: [{}, { label: "requests" }],
      legend: { live: false },
    }, [[], [], []], qEl);
    kvChart = new uPlot({
      width: chartWidth(kEl), height: 220,
      scales: { x: { time: true }, pct: { range: [0, 100] }, tps: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
      series: [{}, { label: "KV usage %", stroke: "#7c3aed", width: 2, scale: "pct" },
                   { label: "gen tok/s", stroke: "#059669", width: 2, scale: "tps", spanGaps: true }],
      axes: [{}, { scale: "pct", label: "KV %" }, { scale: "tps", side: 1, label: "tok/s", grid: { show: false } }],
      legend: { live: false },
    }, [[], [], []], kEl);
    window.addEventListener("resize", () => {
      queueChart.setSize({ width: chartWidth(qEl), height: 220 });
      kvChart.setSize({ width: chartWidth(kEl), height: 220 });
    });
  }

  function pushPoint(t, running, waiting, kv, tps) {
    const n = series.t.length;
    if (n && t <= series.t[n - 1]) return; // never draw backwards (history overlap)
    series.t.push(t); series.running.push(running); series.waiting.push(waiting);
    series.kv.push(kv == null ? null : kv * 100); series.tps.push(tps);
    while (series.t.length && series.t[0] < t - HISTORY_S) {
      for (const k of Object.keys(series)) series[k].shift();
    }
  }

  function redraw() {
    queueChart.setData([series.t, series.running, series.waiting]);
    kvChart.setData([series.t, series.kv, series.tps]);
    $("queue-chart").dataset.points = String(series.t.length);
    $("kv-chart").dataset.points = String(series.t.length);
  }

  // -- tables ----------------------------------------------------------------
  function fillBody(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows.map((cells) => {
      const tr = document.createElement("tr");
      for (const cell of cells) {
        const td = document.createElement("td");
        if (cell && typeof cell === "object") { td.textContent = cell.text; td.className = cell.cls || ""; }
        else td.textContent = cell == null ? dash : String(cell);
        tr.appendChild(td);
      }
      return tr;
    }));
  }

  // The server already reduced /health to one row per process: {name, status, up, detail}.
  const healthRow = (h) => [h.name, { text: h.status, cls: h.up === true ? "ok" : h.up === false ? "bad" : "unknown" }, h.detail];

  const reqRow = (r) => [r.engine, r.req_id, r.priority, r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens, fmtSec(r.age_s)];

  // -- rendering one snapshot -------------------------------------------------
  function render(s) {
    lastSnapshot = s;
    const e = s.engine || {};
    const w = s.window || {};
    setText("model-name", s.model || "");
    setText("running-count", fmtInt(e.num_running));
    // several engines (data parallel): the cards and the chart add up every engine that reports
    setText("engines-scope", e.num_engines > 1 ? `(${e.engines_reporting} of ${e.num_engines} engines)` : "");
    setText("waiting-count", fmtInt(e.num_waiting));
    setText("kv-usage", fmtPct(e.kv_usage));
    $("kv-usage-bar").style.width = e.kv_usage == null ? "0" : (e.kv_usage * 100).toFixed(1) + "%";
    setText("kv-blocks", e.available ? `${e.num_kv_blocks_total - e.num_kv_blocks_free} / ${e.num_kv_blocks_total} blocks` : dash);
    setText("requests-per-s", fmtRate(w.requests_per_s));
    setText("tokens-per-s", fmtRate(w.generation_tokens_per_s));
    setText("prompt-tokens-per-s", fmtRate(w.prompt_tokens_per_s));
    setText("ttft-p50", fmtSec(w.ttft_p50_s));
    setText("ttft-p95", fmtSec(w.ttft_p95_s));
    setText("queue-p95", fmtSec(w.queue_p95_s));
    setText("preemption-rate", fmtRate(w.preemptions_per_s));
    setText("preemptions-total", fmtInt(e.num_preemptions_total));
    setText("rejection-rate", fmtRate(w.rejections_per_s));
    setText("window-label", `last ${fmtInt(w.window_s)} s`);
    // Step time: forward + sample + idle = one step cycle; schedule overlaps the
    // forward with async scheduling, else it is part of idle.
    setText("step-window", fmtInt(w.window_s));
    setText("step-mean", fmtSec(w.step_mean_s));
    setText("tokens-per-step", w.tokens_per_step == null ? dash : w.tokens_per_step.toFixed(1));
    for (const phase of ["forward", "sample", "idle", "schedule"]) {
      const share = w[`step_${phase}_share`];
      setText(`step-${phase}`, fmtPct(share));
      const seg = $(`step-bar-${phase}`);
      if (seg) seg.style.width = share == null ? "0" : (share * 100).toFixed(1) + "%";
    }
    setText("updated-at", new Date(s.time * 1000).toLocaleTimeString());
    $("stale-badge").hidden = !e.stale;

    const engines = s.engines || [];
    fillBody($("engines"), engines.map((g) => [g.name, g.ready ? "ready" : (g.reason || "down"),
      fmtInt(g.num_running), fmtInt(g.num_waiting), fmtPct(g.kv_usage), fmtPct(g.prefix_cache_hit_rate),
      fmtInt(g.routed_total), g.endpoint]));
    setText("engines-count", `(${engines.filter((g) => g.ready).length} of ${engines.length} ready)`);
    fillBody($("health"), (s.health || []).map(healthRow));
    fillBody($("events"), (s.events || []).map((ev) => [new Date(ev.time * 1000).toLocaleTimeString(), ev.text]));
    fillBody($("processes"), (s.processes || []).map((p) =>
      [p.name, fmtBytes(p.rss_bytes), fmtBytes(p.peak_rss_bytes), fmtBytes(p.device_memory_peak_bytes)]));
    fillBody($("running-table"), (s.running || []).map(reqRow));
    fillBody($("waiting-table"), (s.waiting || []).map(reqRow));
    setText("running-table-count", e.num_running == null ? "" : `(${e.num_running})`);
    setText("waiting-table-count", e.num_waiting == null ? "" : `(${e.num_waiting})`);
    const cfg = (s.config || []).map(([k, v]) => [k, v != null && typeof v === "object" ? JSON.stringify(v) : v]);
    fillBody($("config-scheduler"), cfg.filter(([k]) => k.startsWith("scheduler."))
      .map(([k, v]) => [k.slice("scheduler.".length), v]));
    fillBody($("config-other"), cfg.filter(([k]) => !k.startsWith("scheduler.")));

    const running = e.stale ? null : e.num_running;
    const waiting = e.stale ? null : e.num_waiting;
    pushPoint(s.time, running, waiting, e.stale ? null : e.kv_usage, w.generation_tokens_per_s);
    redraw();
  }

  // -- wiring ------------------------------------------------------------------
  function connect() {
    const source = new EventSource("dashboard/events");
    const status = $("conn-status");
    source.onopen = () => { status.textContent = "live"; status.className = "badge badge-good"; };
    source.onerror = () => { status.textContent = "reconnecting"; status.className = "badge badge-warn"; };
    source.addEventListener("history", (ev) => {
      const h = JSON.parse(ev.data);
      for (const p of h.points || []) pushPoint(p.time, p.num_running, p.num_waiting, p.kv_usage, null);
      redraw();
    });
    source.addEventListener("snapshot", (ev) => render(JSON.parse(ev.data)));
  }

  makeCharts();
  connect();
  // A stable hook for tests and for poking at the page from the console.
  window.ferryDashboard = { points: () => series.t.length, snapshot: () => lastSnapshot, series };
})();
