// The live dashboard: one WebSocket (GET <this page>/ws, the feed of server/dashboard.py, 10
// frames/s), a few capped history arrays, and plots drawn on <canvas> by the small helpers below.
// Frames only update data and mark the page dirty; drawing happens once per animation frame, so
// 10 updates/s (or a burst after a stall) never queue up work. No libraries, nothing fetched.
"use strict";
(() => {
  const HISTORY = 300; // samples kept per series (30 s at 10 updates/s), and steps kept
  const WINDOW_SPANS = [5, 10, 20, 30]; // seconds the time series show: what history there is, up to 30
  const TIMELINE_SPANS = [1, 2, 5, 10, 20, 30, 60]; // the timeline zooms to fit its requests
  const TIMELINE_ROWS = 24;
  const PAD = { l: 46, r: 10, t: 8, b: 18 };
  const css = getComputedStyle(document.documentElement);
  const colors = {};
  const color = (name) => (colors[name] ??= css.getPropertyValue("--" + name).trim());
  const MODE_COLORS = { EXTEND: color("c-extend"), DECODE: color("c-decode"), MIXED: color("c-mixed") };
  const PHASE_COLORS = {
    queued: color("c-queued"), prefill: color("c-extend"), decode: color("c-decode"), retracted: color("c-retract"),
  };
  const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif';

  const series = { t: [], running: [], waiting: [], tps: [], ftps: [], inUse: [], evictable: [], free: [], hit: [], retract: [] };
  let steps = [];
  let latest = null;
  let updates = 0;
  let draws = 0;
  let lastFrameAt = 0;
  let radixKey = "";
  let drawPending = false;

  const $ = (id) => document.getElementById(id);
  const fmtInt = (v) => Math.round(v).toLocaleString("en-US");
  const fmtPct = (v) => (100 * v).toFixed(1) + "%";
  const fmtRate = (v) => (v >= 100 ? fmtInt(v) : v.toFixed(1));
  const fmtAxis = (v) => (v >= 10000 ? v / 1000 + "k" : Number.isInteger(v) ? fmtInt(v) : v.toFixed(1));
  const fmtShare = (v) => Math.round(100 * v) + "%";

  function middleEllipsis(text, max) { // prefixes share their start: keep the end visible too
    if (text.length <= max) return text;
    const tail = Math.floor(max * 0.45);
    return text.slice(0, max - tail - 1) + "…" + text.slice(text.length - tail);
  }

  function setNum(id, value, text) {
    const el = $(id);
    el.dataset.value = String(value);
    el.textContent = text === undefined ? fmtInt(value) : text;
  }

  function push(name, value) {
    const arr = series[name];
    arr.push(value);
    if (arr.length > HISTORY) arr.shift();
  }

  // ---- the feed ---------------------------------------------------------------------------------

  // The page's own `api_key` and, behind a --dp-size front end, `dp_rank` (which replica), kept
  // on the feed's URL and on the links to the other replicas.
  function query(rank) {
    const params = new URLSearchParams(location.search);
    const key = params.get("api_key");
    const parts = [];
    if (rank !== null) parts.push("dp_rank=" + encodeURIComponent(rank));
    if (key) parts.push("api_key=" + encodeURIComponent(key));
    return parts.length ? "?" + parts.join("&") : "";
  }

  function feedUrl() {
    const path = location.pathname.replace(/\/+$/, "") + "/ws";
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    return proto + "//" + location.host + path + query(new URLSearchParams(location.search).get("dp_rank"));
  }

  function showReplicas(dp) { // the front end's hello: this replica, and links to every replica's dashboard
    const nav = $("replicas");
    nav.replaceChildren();
    for (const r of dp.replicas) {
      const a = document.createElement("a");
      a.href = location.pathname + query(String(r.index));
      a.textContent = "replica " + r.index;
      a.className = (r.index === dp.rank ? "current " : "") + (r.healthy ? "up" : "down");
      a.title = [r.healthy ? "healthy" : "down", r.restarts + " restarts", r.device].filter(Boolean).join(", ");
      nav.appendChild(a);
    }
    nav.hidden = false;
  }

  function setConn(state, text) {
    const el = $("conn");
    el.className = "conn " + state;
    el.textContent = text || state;
  }

  let retryMs = 250;
  function connect() {
    setConn("connecting");
    let ws;
    try {
      ws = new WebSocket(feedUrl());
    } catch (e) {
      setConn("down", "cannot connect");
      return;
    }
    ws.onopen = () => { retryMs = 250; setConn("live"); lastFrameAt = performance.now(); };
    ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
    ws.onclose = (ev) => {
      setConn("down", ev.code === 1006 && !lastFrameAt ? "disconnected (API key?)" : "reconnecting");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 5000);
    };
  }

  setInterval(() => { // a socket that is open but silent is worth saying
    const el = $("conn");
    if (el.classList.contains("live") && performance.now() - lastFrameAt > 2000) setConn("stalled");
    else if (el.classList.contains("stalled") && performance.now() - lastFrameAt <= 2000) setConn("live");
  }, 500);

  function onFrame(f) {
    lastFrameAt = performance.now();
    if (f.type === "hello") {
      $("model").textContent = f.model;
      steps = f.steps.slice(-HISTORY);
      if (f.dp) showReplicas(f.dp);
    } else if (f.type === "snapshot") {
      onSnapshot(f);
    } else if (f.type === "error") {
      $("error").hidden = false;
      $("error").textContent = f.message;
      $("error").title = f.message;
    }
  }

  function onSnapshot(s) {
    updates += 1;
    latest = s;
    // How far the page keeps up, as counts (devtools, tests): snapshots taken of those the server
    // numbered (a slow page's frames are replaced by newer ones), and draws made.
    $("updates").dataset.seq = String(s.seq);
    $("error").hidden = true;
    const total = Math.max(s.total_tokens, 1);
    push("t", s.t);
    push("running", s.running_requests);
    push("waiting", s.waiting_requests);
    push("tps", s.tokens_per_s);
    push("ftps", s.forward_tokens_per_s);
    push("inUse", s.kv_in_use_tokens / total);
    push("evictable", s.evictable_tokens / total);
    push("free", s.available_tokens / total);
    push("hit", s.cache_hit_rate);
    push("retract", s.num_retractions);
    if (s.steps.length) {
      steps = steps.concat(s.steps);
      if (steps.length > HISTORY) steps = steps.slice(-HISTORY);
    }
    updateNumbers(s);
    updateRadix(s.radix_top);
    scheduleDraw();
  }

  function updateNumbers(s) {
    setNum("updates", updates);
    setNum("running", s.running_requests);
    setNum("max-running", s.max_running_requests);
    setNum("waiting", s.waiting_requests);
    setNum("tokens-per-s", s.tokens_per_s, fmtRate(s.tokens_per_s));
    setNum("forward-tokens-per-s", s.forward_tokens_per_s, fmtRate(s.forward_tokens_per_s));
    setNum("generated-tokens", s.generated_tokens);
    setNum("total-tokens", s.total_tokens);
    setNum("kv-usage", s.token_usage, fmtPct(s.token_usage));
    setNum("kv-in-use", s.kv_in_use_tokens);
    setNum("kv-evictable", s.evictable_tokens);
    setNum("kv-free", s.available_tokens);
    setNum("cache-hit-rate", s.cache_hit_rate, fmtPct(s.cache_hit_rate));
    setNum("retractions", s.num_retractions);
    const spec = s.speculative; // null unless the server runs --speculative-algorithm
    setNum("spec-accept", spec ? spec.accept_rate : 0, spec ? fmtPct(spec.accept_rate) : "off");
    $("spec-detail").textContent = spec
      ? spec.accept_length.toFixed(2) + " tokens per verify, " + fmtInt(spec.verify_steps) + " verifies"
      : "n-gram speculation";
    const step = steps[steps.length - 1];
    if (step) {
      setNum("last-step", step.batch_size, step.mode.toLowerCase() + " × " + step.batch_size);
      $("last-step-detail").textContent = fmtInt(step.num_tokens) + " tokens in " + step.duration_ms.toFixed(1) + " ms";
    }
  }

  function updateRadix(rows) {
    const key = JSON.stringify(rows);
    if (key === radixKey) return; // unchanged: leave the DOM alone
    radixKey = key;
    const body = document.createElement("tbody");
    for (const p of rows) {
      const tr = body.insertRow();
      const text = middleEllipsis(p.text.replace(/\n/g, "⏎").replace(/\s/g, " "), 36);
      const cells = [text, fmtInt(p.tokens), fmtInt(p.subtree_tokens), fmtInt(p.hits), p.locked ? "yes" : ""];
      for (const v of cells) tr.insertCell().textContent = v; // text, never HTML: prompts are user input
      tr.cells[0].className = "text";
      tr.cells[0].title = p.text;
      if (p.locked) tr.cells[4].className = "locked";
    }
    if (!rows.length) {
      const td = body.insertRow().insertCell();
      td.colSpan = 5;
      td.className = "empty";
      td.textContent = "no cached prefixes";
    }
    $("radix").replaceChild(body, $("radix").tBodies[0]);
  }

  // ---- drawing ------------------------------------------------------------------------------------

  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => {
      drawPending = false;
      drawAll();
      $("updates").dataset.draws = String(++draws);
    });
  }

  function surface(id) {
    const c = $(id);
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = FONT;
    return { ctx, w, h, pw: w - PAD.l - PAD.r, ph: h - PAD.t - PAD.b };
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function axes(s, yMax, fmtY, xLabels) {
    const { ctx, pw, ph } = s;
    ctx.strokeStyle = color("grid");
    ctx.fillStyle = color("dim");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const f of [0, 0.5, 1]) {
      const y = Math.round(PAD.t + ph * (1 - f)) + 0.5;
      ctx.beginPath(); ctx.moveTo(PAD.l, y); ctx.lineTo(PAD.l + pw, y); ctx.stroke();
      ctx.fillText(fmtY(yMax * f), PAD.l - 6, y);
    }
    ctx.textBaseline = "top";
    xLabels.forEach(([f, text], i) => {
      ctx.textAlign = i === 0 ? "left" : i === xLabels.length - 1 ? "right" : "center";
      ctx.fillText(text, PAD.l + pw * f, PAD.t + ph + 4);
    });
  }

  let windowS = WINDOW_SPANS[0];
  const timeLabels = () => [[0, "-" + windowS + "s"], [0.5, "-" + windowS / 2 + "s"], [1, "now"]];
  const timeX = (s, t, now) => PAD.l + s.pw * (1 - (now - t) / windowS);

  function updateWindow() { // a page opened a moment ago shows its few seconds, not a mostly empty 30
    const span = series.t.length ? series.t[series.t.length - 1] - series.t[0] : 0;
    windowS = WINDOW_SPANS.find((v) => v >= span) || WINDOW_SPANS[WINDOW_SPANS.length - 1];
  }

  function lineChart(id, names, fmtY, { fixedMax = 0, minMax = 1 } = {}) {
    const s = surface(id);
    const now = series.t[series.t.length - 1];
    const max = fixedMax || niceMax(Math.max(minMax, ...names.flatMap((n) => series[n])));
    axes(s, max, fmtY, timeLabels());
    if (now === undefined) return;
    const { ctx, ph } = s;
    ctx.save();
    ctx.beginPath(); ctx.rect(PAD.l, 0, s.pw, s.h); ctx.clip();
    for (const name of names) {
      ctx.strokeStyle = color("c-" + name);
      ctx.lineWidth = 1.6;
      ctx.lineJoin = "round";
      ctx.beginPath();
      series[name].forEach((v, i) => {
        const x = timeX(s, series.t[i], now), y = PAD.t + ph * (1 - v / max);
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    }
    ctx.restore();
  }

  function kvChart() {
    const s = surface("chart-kv");
    axes(s, 1, fmtShare, timeLabels());
    const now = series.t[series.t.length - 1];
    if (now === undefined) return;
    const { ctx, ph } = s;
    const layers = [["inuse", series.inUse], ["evictable", series.evictable], ["free", series.free]];
    let base = series.t.map(() => 0);
    ctx.save();
    ctx.beginPath(); ctx.rect(PAD.l, 0, s.pw, s.h); ctx.clip();
    for (const [name, values] of layers) {
      const top = base.map((b, i) => b + values[i]);
      ctx.fillStyle = color("c-" + name);
      ctx.beginPath();
      top.forEach((v, i) => ctx.lineTo(timeX(s, series.t[i], now), PAD.t + ph * (1 - v)));
      for (let i = base.length - 1; i >= 0; i--) ctx.lineTo(timeX(s, series.t[i], now), PAD.t + ph * (1 - base[i]));
      ctx.closePath();
      ctx.fill();
      base = top;
    }
    ctx.restore();
  }

  function stepsChart() {
    const s = surface("chart-steps");
    const max = niceMax(Math.max(2, ...steps.map((st) => st.batch_size)));
    axes(s, max, fmtAxis, [[0, "-" + HISTORY + " steps"], [1, "latest"]]);
    const { ctx, pw, ph } = s;
    const bw = pw / HISTORY;
    const offset = HISTORY - steps.length;
    steps.forEach((st, i) => {
      const h = (ph * st.batch_size) / max;
      ctx.fillStyle = MODE_COLORS[st.mode] || color("dim");
      ctx.fillRect(PAD.l + (offset + i) * bw, PAD.t + ph - h, Math.max(bw - 0.5, 0.5), h);
    });
  }

  function timelineChart() {
    const s = surface("chart-timeline");
    const { ctx } = s;
    const maxSpan = TIMELINE_SPANS[TIMELINE_SPANS.length - 1];
    const recent = (tl) => !tl.finish_reason || tl.phases[tl.phases.length - 1][1] > -maxSpan;
    const rows = latest ? latest.timelines.filter(recent).slice(-TIMELINE_ROWS) : [];
    const oldest = Math.max(0, ...rows.map((tl) => -tl.queued));
    const span = TIMELINE_SPANS.find((v) => v >= oldest) || maxSpan;
    $("timeline-span").textContent = span + " s";
    const left = 86, plotW = s.w - left - PAD.r;
    const rowH = (s.h - PAD.t - PAD.b) / TIMELINE_ROWS;
    const x = (t) => left + plotW * (1 + Math.min(0, Math.max(t, -span)) / span);
    ctx.strokeStyle = color("grid");
    ctx.fillStyle = color("dim");
    ctx.textBaseline = "top";
    for (let k = 0; k <= 4; k++) {
      const gx = Math.round(left + (plotW * k) / 4) + 0.5;
      ctx.beginPath(); ctx.moveTo(gx, PAD.t); ctx.lineTo(gx, s.h - PAD.b); ctx.stroke();
      ctx.textAlign = k === 0 ? "left" : k === 4 ? "right" : "center";
      ctx.fillText(k === 4 ? "now" : "-" + (span * (4 - k)) / 4 + "s", gx, s.h - PAD.b + 4);
    }
    if (!rows.length) {
      ctx.textAlign = "center"; ctx.textBaseline = "middle";
      ctx.fillText("no requests in the last " + maxSpan + " s", left + plotW / 2, s.h / 2);
      return;
    }
    rows.forEach((tl, r) => drawTimelineRow(ctx, tl, PAD.t + r * rowH, rowH, x, left, span));
  }

  function drawTimelineRow(ctx, tl, y, rowH, x, left, span) {
    const barH = Math.max(rowH - 4, 2), top = y + (rowH - barH) / 2;
    ctx.fillStyle = color("dim");
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(tl.rid.slice(0, 10), left - 6, y + rowH / 2);
    const points = [["queued", tl.queued, 0]].concat(tl.phases);
    const bars = [], chunks = [], marks = [];
    points.forEach(([name, t], i) => {
      const end = i + 1 < points.length ? points[i + 1][1] : 0; // still in this phase: until now
      if (name === "finished") {
        if (t >= -span) marks.push(x(t));
      } else if (end >= -span) { // else scrolled out
        (name === "prefill" ? chunks : bars).push([PHASE_COLORS[name] || color("dim"), x(t), x(end)]);
      }
    });
    for (const [c, x0, x1] of bars) {
      ctx.fillStyle = c;
      ctx.fillRect(x0, top, Math.max(x1 - x0, 1), barH);
    }
    for (const [c, x0, x1] of chunks) { // on top: a chunk is one short forward, kept visible and apart
      ctx.fillStyle = c;
      ctx.fillRect(x0, top, Math.max(x1 - x0 - 1, 2), barH);
    }
    ctx.fillStyle = color("c-finished");
    for (const mx of marks) ctx.fillRect(mx - 1, top - 1, 2, barH + 2);
  }

  function drawAll() {
    updateWindow();
    lineChart("chart-requests", ["running", "waiting"], fmtAxis, { minMax: 2 });
    lineChart("chart-throughput", ["tps", "ftps"], fmtAxis);
    stepsChart();
    kvChart();
    lineChart("chart-hit", ["hit"], fmtShare, { fixedMax: 1 });
    lineChart("chart-retractions", ["retract"], fmtAxis, { minMax: 2 });
    timelineChart();
  }

  window.addEventListener("resize", scheduleDraw);
  scheduleDraw();
  connect();
})();
