// herd fleet dashboard: draws GET /v1/cluster/map (placer/clustermap.py's binary format) on a
// canvas, one block of pixels per node, zone -> block -> rack, and polls it every 2 s.
// No framework, no build step, nothing from another origin.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const FETCH_TIMEOUT_MS = 1500;
  const STATE_COLOURS = {
    free: "#24303c", partial: "#5fa8e8", full: "#1f6fd1", degraded: "#f0b429",
    fatal: "#e5484d", lost: "#9b5de5", cordoned: "#a3a9b0",
  };
  const BG = "#0f1419";
  const LIT = "#ffffff";          // nodes of the selected job
  const WAIT_TEXT = {
    not_tried: () => "not looked at yet: the next scheduling pass tries it",
    too_few_free: (w, j) => `asks ${j.gpus} GPUs; ${w.free_gpus} are free` +
      (w.preemption_on ? " and no lower-priority preemptible job holds enough" : " (preemption is off)"),
    no_domain: (w, j) => `no ${j.within === "any" ? "set of nodes" : j.within} has room for ` +
      `${j.pods} × ${j.pods ? Math.round(j.gpus / j.pods) : 0} GPUs` +
      (w.may_preempt ? ", even preempting lower-priority jobs" :
        w.preemption_on ? " (no lower-priority preemptible job to preempt)" : " (preemption is off)"),
    backoff: (w) => `backing off after ${w.rollbacks} refused placement${w.rollbacks === 1 ? "" : "s"}`,
    recovering: () => "the placer restarted: waiting for its nodes to report",
    not_queued: () => "not in the queue",
  };

  const $ = (id) => document.getElementById(id);
  const canvas = $("map"), overlay = $("overlay");
  const ctx = canvas.getContext("2d"), octx = overlay.getContext("2d");

  // ------------------------------------------------------------------ state
  const S = {
    token: null, map: null, serverSkew: 0, layout: null, layoutKey: "", colour: "state",
    selected: null, hover: -1, pinned: -1, lastOk: 0, failing: false, drawn: 0,
    timings: { firstDraw: null, firstCycle: null, refreshes: [], last: null },
    pixels: null, image: null, jobColours: null, tableKey: "",
  };

  function rgba(hex) {               // "#rrggbb" -> the Uint32 an ImageData holds (little endian)
    const n = parseInt(hex.slice(1), 16);
    return (0xff << 24 | (n & 0xff) << 16 | (n >> 8 & 0xff) << 8 | n >> 16) >>> 0;
  }
  function dim(hex, f) {
    const n = parseInt(hex.slice(1), 16);
    const c = [n >> 16, n >> 8 & 0xff, n & 0xff].map((v) => Math.round(v * f));
    return "#" + c.map((v) => v.toString(16).padStart(2, "0")).join("");
  }
  function hueColour(i) {            // a stable, distinct colour per job row
    const h = (i * 137.508) % 360, s = 0.62, l = 0.55;
    const k = (n) => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
    const f = (n) => Math.round(255 * (l - a * Math.max(-1, Math.min(k(n) - 3, 9 - k(n), 1))));
    return "#" + [f(0), f(8), f(4)].map((v) => v.toString(16).padStart(2, "0")).join("");
  }

  // ------------------------------------------------------------------ the map's bytes
  function decode(buf) {
    const dv = new DataView(buf);
    const magic = String.fromCharCode(dv.getUint8(0), dv.getUint8(1), dv.getUint8(2), dv.getUint8(3));
    if (magic !== "HMAP" || dv.getUint32(4, true) !== 1) throw new Error("not a version 1 cluster map");
    const hlen = dv.getUint32(8, true);
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 12, hlen)));
    const T = { u1: Uint8Array, u2: Uint16Array, u4: Uint32Array };
    const a = {};
    for (const [name, [dt, count, off]] of Object.entries(header.arrays)) a[name] = new T[dt](buf, off, count);
    const none = header.arrays.job[0] === "u2" ? 0xffff : 0xffffffff;
    return { header, state: a.state, job: a.job, zone: a.zone, block: a.block, rack: a.rack, none };
  }

  // ------------------------------------------------------------------ layout
  // Racks are columns of nodes (wrapped when taller than RACK_H), a block's racks sit side by
  // side, blocks flow left to right and wrap, each zone starts a new band under its label.
  const RACK_H = 48;
  function layout(m, width) {
    const N = m.header.nodes;
    const ends = (st) => { const e = new Uint32Array(st.length); for (let i = 0; i < st.length; i++) e[i] = i + 1 < st.length ? st[i + 1] : N; return e; };
    const rEnd = ends(m.rack);
    let tallest = 1;
    for (let r = 0; r < m.rack.length; r++) tallest = Math.max(tallest, rEnd[r] - m.rack[r]);
    const rackH = Math.min(tallest, RACK_H);
    const rackCols = (r) => Math.ceil((rEnd[r] - m.rack[r]) / rackH);
    // choose the largest cell that keeps the map within the height available
    const maxH = Math.max(240, window.innerHeight - 170);
    let best = null;
    for (let cell = 14; cell >= 1; cell--) {
      const L = place(m, rEnd, rackH, rackCols, cell, width, false);
      best = L;
      if (L.height <= maxH) break;
    }
    return place(m, rEnd, rackH, rackCols, best.cell, width, true);
  }
  function place(m, rEnd, rackH, rackCols, cell, width, fill) {
    const N = m.header.nodes;
    const rackGap = cell >= 4 ? 2 : 1, blockGap = Math.max(3, cell * 2), zoneGap = 16;
    const pos = fill ? new Int32Array(N * 2) : null;
    const labels = [];
    let y = 0, r = 0, b = 0;
    const zEnd = (z) => z + 1 < m.zone.length ? m.zone[z + 1] : N;
    const bEnd = (i) => i + 1 < m.block.length ? m.block[i + 1] : N;
    const blockH = rackH * cell;
    for (let z = 0; z < m.zone.length; z++) {
      y += zoneGap;
      labels.push({ x: 0, y: y - 14, text: m.header.levels.zone[z] });
      let x = 0, lineH = 0;
      while (b < m.block.length && m.block[b] < zEnd(z)) {
        // this block's width: its racks side by side
        let r2 = r, w = 0;
        while (r2 < m.rack.length && m.rack[r2] < bEnd(b)) { w += rackCols(r2) * cell + rackGap; r2++; }
        if (x > 0 && x + w > width) { x = 0; y += lineH + blockGap; lineH = 0; }
        let rx = x;
        for (; r < r2; r++) {
          const cols = rackCols(r);
          if (fill) {
            for (let n = m.rack[r]; n < rEnd[r]; n++) {
              const k = n - m.rack[r];
              pos[2 * n] = rx + Math.floor(k / rackH) * cell;
              pos[2 * n + 1] = y + (k % rackH) * cell;
            }
          }
          rx += cols * cell + rackGap;
        }
        x += w + blockGap;
        lineH = Math.max(lineH, blockH);
        b++;
      }
      y += lineH;
    }
    return { cell, width: Math.max(1, width), height: Math.max(1, y + 2), pos, labels };
  }

  // ------------------------------------------------------------------ drawing
  function colours(m) {
    const states = m.header.states;
    const byState = states.map((s) => rgba(STATE_COLOURS[s] || "#ff00ff"));
    const dimState = states.map((s) => rgba(dim(STATE_COLOURS[s] || "#ff00ff", 0.35)));
    const jobs = m.header.jobs.id.length;
    if (!S.jobColours || S.jobColours.length < jobs) {
      S.jobColours = new Uint32Array(jobs + 64);
      S.jobDim = new Uint32Array(jobs + 64);
      for (let j = 0; j < S.jobColours.length; j++) {
        S.jobColours[j] = rgba(hueColour(j));
        S.jobDim[j] = rgba(dim(hueColour(j), 0.3));
      }
    }
    return { byState, dimState };
  }

  function draw() {
    const m = S.map, L = S.layout;
    if (!m || !L) return;
    if (!S.image || S.image.width !== L.width || S.image.height !== L.height) {
      S.image = ctx.createImageData(L.width, L.height);
      S.pixels = new Uint32Array(S.image.data.buffer);
    }
    const px = S.pixels, W = L.width, cell = L.cell, pos = L.pos;
    px.fill(rgba(BG));
    const { byState, dimState } = colours(m);
    let sel = S.selected === null ? -1 : m.header.jobs.id.indexOf(S.selected);
    if (sel >= 0 && !m.header.jobs.nodes[sel]) sel = -1;       // (a pending job lights nothing)
    const lit = rgba(LIT), byJob = S.colour === "job";
    const N = m.header.nodes, st = m.state, jb = m.job, none = m.none;
    let litCount = 0;
    for (let i = 0; i < N; i++) {
      let c;
      const j = jb[i];
      if (sel >= 0) {
        if (j === sel) { c = lit; litCount++; } else c = byJob && j !== none ? S.jobDim[j] : dimState[st[i]];
      } else if (byJob && j !== none && st[i] <= 2) c = S.jobColours[j];
      else c = byState[st[i]];
      const base = pos[2 * i + 1] * W + pos[2 * i];
      for (let dy = 0; dy < cell; dy++) {
        const o = base + dy * W;
        for (let dx = 0; dx < cell; dx++) px[o + dx] = c;
      }
    }
    ctx.putImageData(S.image, 0, 0);
    S.litCount = litCount;
    S.drawn++;
    drawOverlay();
  }

  function drawOverlay() {
    const L = S.layout;
    if (!L) return;
    octx.clearRect(0, 0, overlay.width, overlay.height);
    for (const [row, colour] of [[S.hover, "#ffffffaa"], [S.pinned, "#ffd400"]]) {
      if (row < 0 || row >= S.map.header.nodes) continue;
      const x = L.pos[2 * row], y = L.pos[2 * row + 1], c = L.cell;
      octx.strokeStyle = colour;
      octx.lineWidth = 2;
      octx.strokeRect(x - 1.5, y - 1.5, c + 3, c + 3);
    }
  }

  function applyLayout() {
    const m = S.map;
    const wrap = $("map-wrap").parentElement;
    const width = Math.max(320, Math.floor(wrap.clientWidth) - 4);
    const key = `${m.header.model_epoch}:${m.header.nodes}:${m.rack.length}:${width}`;
    if (key === S.layoutKey) return;
    S.layout = layout(m, width);
    S.layoutKey = key;
    const L = S.layout;
    for (const c of [canvas, overlay]) { c.width = L.width; c.height = L.height; }
    // where each pixel's node is, for hover
    S.nodeAt = new Int32Array(L.width * L.height).fill(-1);
    for (let i = 0; i < m.header.nodes; i++) {
      const base = L.pos[2 * i + 1] * L.width + L.pos[2 * i];
      for (let dy = 0; dy < L.cell; dy++) S.nodeAt.fill(i, base + dy * L.width, base + dy * L.width + L.cell);
    }
    const labels = $("labels");
    labels.textContent = "";
    for (const l of L.labels) {
      const d = document.createElement("div");
      d.style.left = l.x + "px"; d.style.top = l.y + "px"; d.textContent = "zone " + l.text;
      labels.appendChild(d);
    }
  }

  // ------------------------------------------------------------------ panels
  function fmtMs(ms) { return ms < 1000 ? `${Math.round(ms)} ms` : ms < 60000 ? `${(ms / 1000).toFixed(1)} s` : `${(ms / 60000).toFixed(1)} min`; }
  function fmtAge(s) { return s < 120 ? `${Math.round(s)}s` : s < 7200 ? `${Math.round(s / 60)}m` : `${(s / 3600).toFixed(1)}h`; }
  function fmtBytes(b) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return `${b.toFixed(i ? 1 : 0)} ${u[i]}`;
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  }

  function renderLegend() {
    const h = S.map.header, box = $("legend");
    box.textContent = "";
    h.states.forEach((s, i) => {
      box.append(el("span", { "data-state": s, class: "legend-item" },
        el("span", { class: "sw", style: "" }), `${s} `, el("b", { class: "count" }, String(h.counts[i]))));
      box.lastChild.firstChild.style.background = STATE_COLOURS[s];
    });
    box.append(el("span", { class: "dim" }, `${h.nodes} nodes · ${h.gpus} GPUs`));
    const f = $("frag");
    f.textContent = "";
    const frag = h.fragmentation || {};
    for (const lv of Object.keys(frag)) {
      const bar = el("div", { class: "bar" }, el("i"));
      bar.firstChild.style.width = `${Math.round(100 * frag[lv])}%`;
      const lp = (h.largest_placeable || {})[lv];
      f.append(el("div", { "data-level": lv }, `fragmentation ${lv} `, el("b", {}, frag[lv].toFixed(2)),
        lp !== undefined ? el("span", { class: "dim" }, ` · largest ${lp} GPUs`) : null, bar));
    }
  }

  function jobRow(h, i) {
    const J = h.jobs;
    return { id: J.id[i], state: J.state[i], gpus: J.gpus[i], pods: J.pods[i], within: J.within[i],
      priority: J.priority[i], attempt: J.attempt[i], submitted: J.submitted[i], timings: J.timings[i],
      waiting: J.waiting[i], reason: J.reason[i], nodes: J.nodes[i] };
  }

  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (v) => String(v).replace(/[&<>"']/g, (c) => ESC[c]);

  function renderJobs() {
    const h = S.map.header, J = h.jobs, tb = $("jobs").tBodies[0];
    const now = Date.now() / 1000 + S.serverSkew;
    const key = h.generation + ":" + Math.floor(now / 10) + ":" + S.selected;
    if (key === S.tableKey) return;
    S.tableKey = key;
    // one string, one parse: rebuilding a few hundred rows cell by cell costs tens of ms
    const n = Math.min(J.id.length, 500), parts = [];
    for (let i = 0; i < n; i++) {
      const j = jobRow(h, i);
      const why = j.waiting ? ` title="${esc("why pending? " + whyText(j))}"` : "";
      parts.push(`<tr data-job="${esc(j.id)}"${j.id === S.selected ? ' class="selected"' : ""}${why}>` +
        `<td>${esc(j.id)}</td><td class="st-${esc(j.state)}">${esc(j.state)}</td><td class="num">${j.gpus}</td>` +
        `<td class="num">${j.priority}</td><td class="num">${j.submitted ? fmtAge(Math.max(0, now - j.submitted)) : ""}</td>` +
        `<td class="num">${j.attempt}</td><td class="num">${j.nodes}</td></tr>`);
    }
    tb.innerHTML = parts.join("");
    $("jobs-count").textContent = `${J.id.length}${J.id.length > n ? ` (first ${n})` : ""} · ${h.queue ? h.queue.pending : 0} pending`;
  }

  function whyText(j) {
    const w = j.waiting;
    if (!w) return "";
    const f = WAIT_TEXT[w.code];
    let t = f ? f(w, j) : w.code;
    if (w.behind_reservation) t += "; nodes held for an earlier job's reservation were out of reach";
    if (w.reserved) t += "; it holds a reservation and waits for that domain to drain";
    return t;
  }

  function selectJob(id) {
    S.selected = S.selected === id ? null : id;
    S.tableKey = "";
    renderJobs();
    draw();
    renderJob();
  }

  async function renderJob() {
    const box = $("job-detail");
    if (S.selected === null) { $("job-title").textContent = ""; box.textContent = "select a row of the jobs table"; box.className = "dim"; return; }
    const h = S.map.header, i = h.jobs.id.indexOf(S.selected);
    const j = i >= 0 ? jobRow(h, i) : null;
    $("job-title").textContent = S.selected;
    box.className = "";
    let d = null;
    try { d = await api(`/v1/cluster/map/job/${encodeURIComponent(S.selected)}`, "json"); } catch (e) { d = null; }
    if (S.selected === null || (j && j.id !== S.selected)) return;
    const t = (d && d.timings) || (j && j.timings) || {};
    const steps = [["submitted", 0], ["decided", t.decided], ["pushed", t.pushed], ["acked", t.acked], ["running", t.running]];
    const tl = el("div", { class: "timeline" });
    for (const [name, ms] of steps) {
      tl.append(el("span", { class: ms === undefined ? "missing" : "", "data-step": name },
        name === "submitted" ? "submitted" : `${name} +${ms === undefined ? "…" : fmtMs(ms)}`));
    }
    const kv = el("dl", { class: "kv" });
    const add = (k, v) => { kv.append(el("dt", {}, k), el("dd", {}, v)); };
    const src = d || j || {};
    add("state", `${src.state || ""}${d && d.attempt ? ` · attempt ${d.attempt}` : ""}`);
    if (d && d.spec) add("shape", `${d.spec.pods} × ${d.spec.gpus_per_pod} GPUs within ${d.spec.within} · priority ${d.spec.priority}${d.spec.preemptible ? " · preemptible" : ""}`);
    if (d && d.pod_counts) add("pods", Object.entries(d.pod_counts).map(([k, v]) => `${v} ${k}`).join(", ") || "none");
    if (j) add("nodes lit", String(j.nodes));
    if ((d && d.reason) || (j && j.reason)) add("reason", (d && d.reason) || j.reason);
    box.textContent = "";
    box.append(tl);
    const wj = j || (d ? { ...d, ...d.spec, gpus: d.spec.pods * d.spec.gpus_per_pod } : null);
    if (wj && wj.waiting) box.append(el("div", { class: "why", id: "why" }, "why pending? " + whyText(wj)));
    box.append(kv);
    if (d && d.fetch) {
      const f = d.fetch, tot = f.origin + f.peers + f.local;
      const bar = el("div", { class: "fetchbar" });
      for (const [k, c] of [["origin", "#e5484d"], ["peers", "#3fb950"], ["local", "#5fa8e8"]]) {
        const s = el("i"); s.style.background = c; s.style.width = tot ? `${100 * f[k] / tot}%` : "0"; bar.append(s);
      }
      box.append(el("div", {}, `fetch (${d.fetch_pods} pods reporting): origin ${fmtBytes(f.origin)} · peers ${fmtBytes(f.peers)} · local ${fmtBytes(f.local)}`), bar);
    }
  }

  let nodeReq = 0;
  async function renderNode(row) {
    const m = S.map;
    if (!m || row < 0) return;
    const h = m.header;
    const find = (st, i) => { let lo = 0, hi = st.length - 1; while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (st[mid] <= i) lo = mid; else hi = mid - 1; } return lo; };
    const z = find(m.zone, row), b = find(m.block, row), r = find(m.rack, row);
    const j = m.job[row];
    const basic = `${h.levels.zone[z]} / ${h.levels.block[b]} / ${h.levels.rack[r]} · node ${row - m.rack[r]} · ${h.states[m.state[row]]}` +
      (j !== m.none ? ` · ${h.jobs.id[j]}` : "");
    const box = $("node-detail");
    box.className = "";
    box.textContent = basic;
    const mine = ++nodeReq;
    let d;
    try { d = await api(`/v1/cluster/map/node/${row}?epoch=${h.model_epoch}`, "json"); } catch (e) { return; }
    if (mine !== nodeReq) return;
    box.textContent = "";
    const kv = el("dl", { class: "kv" });
    const add = (k, v) => { kv.append(el("dt", {}, k), el("dd", {}, v)); };
    add("node", d.node_id);
    add("where", basic);
    if (d.node) add("seen", `${d.node.state}, ${d.node.free_gpus}/${d.node.gpus} GPUs free${d.node.cordoned ? ", cordoned" : ""}`);
    if (d.cordon_reason) add("cordon", d.cordon_reason);
    if (d.health_reasons && d.health_reasons.length) add("health", d.health_reasons.join(", "));
    if (d.degraded_gpus && d.degraded_gpus.length) add("degraded", d.degraded_gpus.join(", "));
    box.append(kv);
    const g = el("div", { class: "gpus" });
    for (const x of d.gpus) g.append(el("span", { class: x.healthy ? "" : "bad", title: x.holder || "free" }, `${x.slot}:${x.holder ? x.holder : "·"}`));
    box.append(g);
    if (d.workloads && d.workloads.length) box.append(el("div", {}, "workloads: " + d.workloads.map((w) => `${w.workload_id} (${w.state})`).join(", ")));
  }

  function showTip(row, ev) {
    const tip = $("tip"), m = S.map;
    if (row < 0) { tip.hidden = true; return; }
    const h = m.header, j = m.job[row];
    tip.textContent = `#${row} ${h.states[m.state[row]]}${j !== m.none ? " · " + h.jobs.id[j] : ""}`;
    tip.hidden = false;
    const rect = overlay.getBoundingClientRect();
    tip.style.left = `${ev.clientX - rect.left + 14}px`;
    tip.style.top = `${ev.clientY - rect.top + 10}px`;
  }

  // ------------------------------------------------------------------ I/O
  async function api(path, kind) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const headers = S.token ? { authorization: "Bearer " + S.token } : {};
      if (kind === "bin" && S.map) headers["if-none-match"] = `"${S.map.header.generation}"`;
      const r = await fetch(path, { headers, signal: ctl.signal, cache: "no-store" });
      if (r.status === 401 || r.status === 403) { const e = new Error("auth"); e.auth = r.status; throw e; }
      if (!r.ok && r.status !== 304) throw new Error(`HTTP ${r.status}`);
      if (kind === "json") return await r.json();
      const now = parseFloat(r.headers.get("x-herd-now"));
      if (!isNaN(now)) S.serverSkew = now - Date.now() / 1000;
      const stale = r.headers.get("x-herd-map-stale") === "1";
      if (r.status === 304) return { buf: null, stale };     // the map we hold is still the map
      return { buf: await r.arrayBuffer(), stale };
    } finally { clearTimeout(timer); }
  }

  async function cycle() {
    const t0 = performance.now();
    let res;
    try {
      res = await api("/v1/cluster/map", "bin");
    } catch (e) {
      if (e.auth) { askToken(e.auth === 403 ? "this token lacks the viewer role" : ""); return false; }
      down(e);
      return true;
    }
    const t1 = performance.now();
    if (res.buf === null) {            // unchanged: nothing to draw; ages in the table move on
      renderJobs();
      S.timings.unchanged = (S.timings.unchanged || 0) + 1;
      up(res.stale);
      return true;
    }
    const m = decode(res.buf);
    const t2 = performance.now();
    S.map = m;
    applyLayout();
    draw();
    const t3 = performance.now();
    renderLegend();
    renderJobs();
    const t4 = performance.now();
    const rec = { fetch: t1 - t0, decode: t2 - t1, draw: t3 - t2, panels: t4 - t3, total: t4 - t0,
      bytes: res.buf.byteLength, at: t4 };
    if (S.timings.firstDraw === null) { S.timings.firstDraw = t4; S.timings.firstCycle = rec; } else { S.timings.refreshes.push(rec); if (S.timings.refreshes.length > 100) S.timings.refreshes.shift(); }
    S.timings.last = rec;
    up(res.stale);
    $("perf").textContent = `map ${fmtBytes(rec.bytes)} · draw ${rec.draw.toFixed(1)} ms · cycle ${rec.total.toFixed(0)} ms`;
    if (S.pinned >= 0 && S.drawn % 5 === 0) renderNode(S.pinned);
    if (S.selected !== null && S.drawn % 3 === 0) renderJob();
    return true;
  }

  function up(stale) {
    S.lastOk = Date.now();
    S.failing = false;
    const s = $("status");
    s.className = "status ok";
    const ha = S.map && S.map.header.ha;
    s.textContent = `placer answering · ${new Date().toLocaleTimeString()}` + (stale ? " · map held during a rebuild" : "") +
      (ha ? ` · ${ha.role}${ha.leader ? `, leader ${ha.leader}` : ""}, epoch ${ha.epoch}` : "");
    $("banner").hidden = true;
    canvas.style.opacity = "1";
  }
  function down(e) {
    S.failing = true;
    const s = $("status");
    s.className = "status down";
    s.textContent = "placer not answering";
    const b = $("banner");
    b.hidden = false;
    b.textContent = `The placer stopped answering (${e && e.name === "AbortError" ? "timed out" : (e && e.message) || "error"})` +
      (S.lastOk ? `; the map shows the fleet as of ${new Date(S.lastOk).toLocaleTimeString()}.` : ".");
    canvas.style.opacity = "0.45";
  }

  function askToken(why) {
    $("login").hidden = false;
    $("login-error").textContent = why || "";
    $("status").className = "status down";
    $("status").textContent = "needs a viewer token";
  }

  let timer = null;
  async function loop() {
    clearTimeout(timer);
    const go = await cycle();
    if (go) timer = setTimeout(loop, REFRESH_MS);
  }

  // ------------------------------------------------------------------ wiring
  // A token in the URL fragment (never sent to a server) is kept for this tab and taken out
  // of the address bar; without one, the tab's stored token, else the login form.
  function tokenFromFragment() {
    const frag = new URLSearchParams(location.hash.slice(1));
    if (!frag.get("token")) return false;
    S.token = frag.get("token");
    try { sessionStorage.setItem("herd-token", S.token); } catch (e) { /* storage off: keep it in memory */ }
    history.replaceState(null, "", location.pathname + location.search);
    return true;
  }

  function init() {
    if (!tokenFromFragment()) {
      try { S.token = sessionStorage.getItem("herd-token"); } catch (e) { S.token = null; }
    }
    window.addEventListener("hashchange", () => { if (tokenFromFragment()) { $("login").hidden = true; loop(); } });
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      S.token = $("token").value.trim();
      try { sessionStorage.setItem("herd-token", S.token); } catch (e) { /* memory only */ }
      $("login").hidden = true;
      loop();
    });
    $("colour").addEventListener("change", (ev) => { S.colour = ev.target.value; draw(); });
    $("jobs").addEventListener("click", (ev) => {
      const tr = ev.target.closest("tr[data-job]");
      if (tr) selectJob(tr.getAttribute("data-job"));
    });
    overlay.addEventListener("mousemove", (ev) => {
      if (!S.layout) return;
      const rect = overlay.getBoundingClientRect();
      const x = Math.floor(ev.clientX - rect.left), y = Math.floor(ev.clientY - rect.top);
      const row = x >= 0 && y >= 0 && x < S.layout.width && y < S.layout.height ? S.nodeAt[y * S.layout.width + x] : -1;
      if (row !== S.hover) {
        S.hover = row;
        drawOverlay();
        clearTimeout(S.hoverTimer);          // ask for the node's details once the pointer rests
        if (S.pinned < 0 && row >= 0) S.hoverTimer = setTimeout(() => { if (S.hover === row) renderNode(row); }, 120);
      }
      showTip(row, ev);
    });
    overlay.addEventListener("mouseleave", () => { S.hover = -1; drawOverlay(); $("tip").hidden = true; });
    overlay.addEventListener("click", () => {
      S.pinned = S.hover === S.pinned ? -1 : S.hover;
      $("node-pin").textContent = S.pinned >= 0 ? "(pinned)" : "";
      drawOverlay();
      if (S.pinned >= 0) renderNode(S.pinned);
    });
    window.addEventListener("resize", () => { if (S.map) { applyLayout(); draw(); } });
    loop();
  }

  // for tests and the curious: what the page has drawn, read back from the canvas
  window.herdDash = {
    state: S,
    timings: () => S.timings,
    ready: () => S.timings.firstDraw !== null,
    select: (id) => { if (S.selected !== id) selectJob(id); },
    jobs: () => (S.map ? S.map.header.jobs.id.slice() : []),
    // nodes by state counted from the canvas's pixels (one cell each), in state colouring
    countsFromCanvas: () => {
      const L = S.layout, img = ctx.getImageData(0, 0, L.width, L.height);
      const px = new Uint32Array(img.data.buffer), out = {};
      const want = S.map.header.states.map((s) => [s, rgba(STATE_COLOURS[s])]);
      for (const [s] of want) out[s] = 0;
      for (let i = 0; i < px.length; i++) for (const [s, c] of want) if (px[i] === c) { out[s]++; break; }
      for (const s of Object.keys(out)) out[s] /= L.cell * L.cell;
      return out;
    },
    litFromCanvas: () => {
      const L = S.layout, img = ctx.getImageData(0, 0, L.width, L.height);
      const px = new Uint32Array(img.data.buffer), lit = rgba(LIT), rows = [];
      let n = 0;
      for (let i = 0; i < px.length; i++) if (px[i] === lit) n++;
      for (let r = 0; r < S.map.header.nodes; r++) {   // rows whose cell is lit on the canvas
        const p = L.pos[2 * r + 1] * L.width + L.pos[2 * r];
        if (px[p] === lit) rows.push(r);
      }
      return { nodes: n / (L.cell * L.cell), rows };
    },
    hoverRow: (row) => {            // where a row's cell is, in client coordinates (to move a mouse there)
      const L = S.layout, rect = overlay.getBoundingClientRect();
      return { x: Math.round(rect.left + L.pos[2 * row] + L.cell / 2), y: Math.round(rect.top + L.pos[2 * row + 1] + L.cell / 2) };
    },
    refreshNow: () => loop(),
  };
  init();
})();
