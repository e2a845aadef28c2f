// The replay of a traced step: every rank a row, stepped event by event (minizero/replay/).
//
// The data (the <script id="replay-data"> element) is build.run_data's, one entry per run:
// every rank's memory samples in time order (the moments), each collective and copy with the
// moments it runs between [m0, m1), each unit's and phase's span likewise. Everything drawn
// here is read from those: the memory stack is the rank's latest sample, the ledger is the sum
// of the collectives that have ended, a unit is gathered when the sample says so. The paper's
// formulas (run.paper) appear only at the step's end, beside the measured values.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("replay-data").textContent);
  const RUNS = DATA.runs;
  const OPS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "d2h", "h2d", "nvme_read", "nvme_write"];
  const OP_COLOURS = {all_gather: "#1f77b4", reduce_scatter: "#d62728", all_reduce: "#9467bd", broadcast: "#8c564b"};
  const KIND_NAMES = {
    "params.gathered": "parameters gathered", "params.shard": "parameter shards",
    "params.secondary": "hpZ secondary shards", "master_params": "fp32 masters",
    "optimizer_states": "optimizer states", "grads.shard": "reduced gradient shards",
    "grads.buffer": "flat gradient buffers", "grads.param": "parameters' .grad",
  };
  const ROW = 64, LANE = 16, SPEEDS = [1, 2, 4, 8, 16, 32, 64];
  const SVG = "http://www.w3.org/2000/svg";

  const exact = (n) => Math.round(n).toLocaleString("en-US");
  function human(n) {
    const units = ["B", "KB", "MB", "GB"];
    let u = 0;
    while (Math.abs(n) >= 1024 && u < units.length - 1) { n /= 1024; u += 1; }
    return u === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[u]}`;
  }
  function el(tag, attrs, parent, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  const kindClass = (k) => "k-" + k.replace(".", "-");
  const shortUnit = (u, many) => { const m = /\.(\d+)$/.exec(u); return many && m ? m[1] : u; };

  // ------------------------------------------------------------------ one clock for every run
  // The moments of all runs, by time since each run's step began (ties: run, then its order).
  const GLOBAL = [];
  RUNS.forEach((run, k) => run.moments.forEach((m, i) => GLOBAL.push([m[0], k, i])));
  GLOBAL.sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2]);
  const DURATION = Math.max(1, ...RUNS.map((r) => r.duration));
  let scale = 1;   // bytes of the fullest place of any rank of any run: every stack on one scale

  RUNS.forEach((run, k) => {
    run.k = k;
    // the data names places, kinds and units by index (build.py): names from here on
    for (const r of run.ranks) {
      for (const smp of run.samples[r]) {
        smp.held = smp.held.map(([p, kind, b]) => [run.places[p], run.kinds[kind], b]);
        smp.gathered = smp.gathered.map((u) => run.units[u]);
      }
    }
    run.localAt = new Int32Array(GLOBAL.length);
    let li = -1;
    GLOBAL.forEach((g, i) => { if (g[1] === k) li = g[2]; run.localAt[i] = li; });
    // for each local moment and rank: the index of that rank's latest sample (-1: none yet)
    run.sampleAt = {};
    for (const r of run.ranks) {
      const a = new Int32Array(run.moments.length);
      let s = -1;
      run.moments.forEach((m, i) => { if (m[1] === r) s = m[2]; a[i] = s; });
      run.sampleAt[r] = a;
      for (const smp of run.samples[r]) {
        const per = {};
        for (const [p, , b] of smp.held) per[p] = (per[p] || 0) + b;
        for (const p in per) scale = Math.max(scale, per[p]);
      }
    }
    run.node = (r) => Math.floor(r / run.per_node);
    run.ledgerRank = run.ranks[0];
    run.collsOf = {};
    for (const r of run.ranks) run.collsOf[r] = run.colls.filter((c) => c.r === r);
    run.nodes = new Set(run.ranks.map(run.node)).size;
  });

  // ------------------------------------------------------------------ the page's parts
  const main = document.getElementById("runs");
  main.style.gridTemplateColumns = `repeat(${RUNS.length}, minmax(0, 1fr))`;

  function buildRun(run) {
    const sec = el("section", {class: "run", "data-run": run.k}, main);
    const h = el("h2", {}, sec, run.title + " ");
    el("span", {class: "where"}, h, `· optimizer step ${run.step}`);
    const rows = el("div", {class: "rows"}, sec);
    run.ring = el("svg:svg", {class: "ring", height: run.ranks.length * ROW, width: 40}, rows);
    const defs = el("svg:defs", {}, run.ring);
    for (const [op, colour] of Object.entries(OP_COLOURS)) {
      const m = el("svg:marker", {id: `head-${run.k}-${op}`, viewBox: "0 0 10 10", refX: 9, refY: 5,
        markerWidth: 5, markerHeight: 5, orient: "auto-start-reverse"}, defs);
      el("svg:path", {d: "M0,0 L10,5 L0,10 z", fill: colour}, m);
    }
    run.rows = {};
    run.ranks.forEach((r, i) => {
      const row = el("div", {class: "rank", "data-rank": r}, rows);
      const nodeStart = i > 0 && run.node(r) !== run.node(run.ranks[i - 1]);
      const who = el("div", {class: "who", title: "show this rank's ledger"}, row, `rank ${r}`);
      if (run.nodes > 1) el("small", {}, who, `node ${run.node(r)}`);
      who.addEventListener("click", () => { run.ledgerRank = r; render(); });
      el("div", {}, row);   // the ring's column
      const doing = el("div", {class: "doing"}, row);
      const phase = el("div", {class: "phase"}, doing);
      const chips = el("div", {class: "chips"}, doing);
      const chip = {};
      for (const u of run.units) chip[u] = el("div", {class: "chip", "data-unit": u, title: u}, chips, shortUnit(u, run.units.length > 6));
      const net = el("div", {class: "net"}, doing);
      const mem = el("div", {class: "mem"}, row);
      const places = {};
      for (const p of run.places) {
        const line = el("div", {class: "place", "data-place": p}, mem);
        el("span", {class: "pname"}, line, p);
        const stack = el("div", {class: "stack"}, line);
        const segs = {};
        for (const k of run.kinds) {
          segs[k] = el("div", {class: `seg ${kindClass(k)}`, "data-rank": r, "data-place": p, "data-kind": k,
            "data-bytes": 0}, stack);
        }
        places[p] = {segs, total: el("span", {class: "ptotal", "data-rank": r, "data-place": p}, line)};
      }
      run.rows[r] = {row, nodeStart, phase, chip, net, places};
    });
    const key = el("div", {class: "chipkey"}, sec, "Units:");
    for (const [cls, what] of [["", "sharded"], ["gathered", "gathered"], ["ag", "gathering"],
      ["rs", "reduce-scattering"], ["forward", "forward"], ["backward", "backward"], ["recompute", "recompute"]]) {
      if (cls === "recompute" && !run.spans.some((s) => s.name === "recompute")) continue;
      el("span", {class: "chip " + cls}, key);
      key.appendChild(document.createTextNode(what));
    }
    const legend = el("div", {class: "legend"}, sec);
    for (const k of run.kinds) {
      const item = el("span", {}, legend);
      el("i", {class: kindClass(k)}, item);
      item.appendChild(document.createTextNode(KIND_NAMES[k] || k));
    }
    buildGantt(run, sec);
    run.states = el("div", {class: "states"}, sec);
    run.ledger = el("table", {class: "ledger", "data-run": run.k}, sec);
  }

  function buildGantt(run, sec) {
    const height = run.ranks.length * LANE;
    const g = el("svg:svg", {class: "gantt", viewBox: `0 0 1000 ${height}`, preserveAspectRatio: "none",
      height: height + 2}, sec);
    const x = (t) => (1000 * t) / DURATION;
    const w = (a, b) => Math.max(0.6, x(b) - x(a));
    run.ranks.forEach((r, i) => {
      const y = i * LANE;
      el("svg:rect", {class: "lane", x: 0, y, width: 1000, height: LANE - 2}, g);
      for (const s of run.spans.filter((s) => s.r === r && s.phase && ["forward", "backward", "step"].includes(s.name))) {
        el("svg:rect", {class: `ph-${s.name}`, x: x(s.ts), y, width: w(s.ts, s.te), height: LANE - 2}, g);
      }
      for (const s of run.spans.filter((s) => s.r === r && !s.phase)) {
        el("svg:rect", {class: `unit u-${s.name}`, "data-rank": r, "data-unit": s.unit, x: x(s.ts), y: y + 1,
          width: w(s.ts, s.te), height: 6, opacity: s.unit === "root" ? 0.35 : 1}, g);
      }
      for (const c of run.collsOf[r]) {
        el("svg:rect", {class: `${c.copy ? "copy" : "coll"} o-${c.op}`, "data-rank": r, x: x(c.ts), y: y + 8,
          width: w(c.ts, c.te), height: 6}, g);
      }
    });
    run.cursor = el("svg:line", {class: "cursor", x1: 0, x2: 0, y1: 0, y2: height}, g);
    // the time axis: milliseconds since the step began, the same for every run on the page
    const axis = el("div", {class: "axis"}, sec);
    const span = DURATION / 1000;   // ms
    const tenth = Math.pow(10, Math.floor(Math.log10(span / 5)));
    const stepMs = [1, 2, 5, 10].map((m) => m * tenth).find((s) => span / s <= 6);   // at most 6 ticks
    for (let i = 0; i * stepMs <= span * 0.85; i += 1) {   // leave room for the axis' name
      el("span", {style: `left: ${(100 * i * stepMs) / span}%`}, axis, `${+(i * stepMs).toPrecision(6)}`);
    }
    el("span", {class: "unit", style: "right: 0"}, axis, "ms since the step began");
    g.addEventListener("click", (ev) => {
      const box = g.getBoundingClientRect();
      const t = ((ev.clientX - box.left) / box.width) * DURATION;
      let best = 0;
      GLOBAL.forEach((m, i) => { if (m[1] === run.k && Math.abs(m[0] - t) < Math.abs(GLOBAL[best][0] - t)) best = i; });
      go(best);
    });
  }

  // ------------------------------------------------------------------ the state at one moment
  const inside = (span, li) => span.m0 <= li && li < span.m1;

  function sampleOf(run, r, li) {
    const s = li >= 0 ? run.sampleAt[r][li] : -1;
    return run.samples[r][Math.max(s, 0)];
  }

  function renderRun(run, i) {
    const li = run.localAt[i];
    const end = li === run.moments.length - 1;
    const at = GLOBAL[i][1] === run.k ? run.moments[GLOBAL[i][2]][1] : null;
    const ring = [];
    for (const r of run.ranks) {
      const v = run.rows[r];
      const s = sampleOf(run, r, li);
      // every class from the moment alone, so a moment looks the same however it was reached
      v.row.className = ["rank", v.nodeStart ? "node-start" : "", r === at ? "current" : "",
        r === run.ledgerRank ? "ledger-rank" : ""].filter(Boolean).join(" ");
      const phases = run.spans.filter((p) => p.r === r && p.phase && inside(p, li)).sort((a, b) => a.m0 - b.m0);
      v.phase.textContent = phases.length ? phases.map((p) => p.name).join(" \u203a ") : (li < 0 ? "not started" : "");
      const computing = {};
      for (const p of run.spans) if (p.r === r && !p.phase && inside(p, li)) computing[p.unit] = p.name;
      const flying = run.collsOf[r].filter((c) => inside(c, li));
      for (const u of run.units) {
        const c = v.chip[u];
        const states = [];
        if (run.stage < 3 || s.gathered.includes(u)) states.push("gathered");
        if (computing[u]) states.push(computing[u]);
        if (flying.some((f) => f.unit === u && f.op === "all_gather")) states.push("ag");
        if (flying.some((f) => f.unit === u && f.op === "reduce_scatter")) states.push("rs");
        c.className = "chip " + states.join(" ");
        c.dataset.state = states.join(" ");
      }
      v.net.textContent = "";
      for (const f of flying) {
        const span = el("span", {class: `op-${f.op}`}, v.net);
        const among = f.copy ? (f.op === "d2h" ? "device \u2192 host" : f.op === "h2d" ? "host \u2192 device" : "")
          : `ranks ${f.ranks.join(",")}`;
        span.textContent = `${f.op} ${f.label} ${exact(f.bytes)} B, ${among}   `;
        if (!f.copy && f.ranks.length > 1) {
          const j = f.ranks.indexOf(r);
          ring.push({from: r, to: f.ranks[(j + 1) % f.ranks.length], op: f.op});
        }
      }
      const per = {};
      for (const [p, k, b] of s.held) { per[p] = per[p] || {}; per[p][k] = b; }
      for (const p of run.places) {
        let sum = 0;
        for (const k of run.kinds) {
          const b = (per[p] && per[p][k]) || 0;
          sum += b;
          const seg = v.places[p].segs[k];
          seg.style.width = `${(100 * b) / scale}%`;
          seg.dataset.bytes = b;
          seg.title = `${KIND_NAMES[k] || k}: ${exact(b)} B`;
        }
        v.places[p].total.textContent = human(sum);
        v.places[p].total.dataset.bytes = sum;
        v.places[p].total.title = `${exact(sum)} B`;
      }
    }
    drawRing(run, ring);
    if (run.cursor) {
      const t = li >= 0 ? run.moments[li][0] : 0;
      run.cursor.setAttribute("x1", (1000 * t) / DURATION);
      run.cursor.setAttribute("x2", (1000 * t) / DURATION);
    }
    renderLedger(run, li, end);
  }

  function drawRing(run, arrows) {
    for (const old of run.ring.querySelectorAll("path.arrow")) old.remove();
    const seen = new Set();
    const pos = (r) => run.ranks.indexOf(r) * ROW + ROW / 2;
    for (const a of arrows) {
      const key = `${a.from}-${a.to}-${a.op}`;
      if (seen.has(key)) continue;
      seen.add(key);
      const y0 = pos(a.from), y1 = pos(a.to);
      const down = y1 > y0;
      const x0 = down ? 6 : 10, bulge = down ? 14 : 28;
      const across = run.node(a.from) !== run.node(a.to);
      el("svg:path", {class: "arrow", "data-op": a.op, "data-from": a.from, "data-to": a.to,
        d: `M${x0},${y0 + (down ? 6 : -6)} C${x0 + bulge},${y0} ${x0 + bulge},${y1} ${x0},${y1 + (down ? -6 : 6)}`,
        fill: "none", stroke: OP_COLOURS[a.op] || "#333", "stroke-width": across ? 3.5 : 2,
        "stroke-dasharray": across ? "6 3" : "", "marker-end": `url(#head-${run.k}-${a.op})`}, run.ring);
    }
  }

  function renderLedger(run, li, end) {
    const r = run.ledgerRank;
    const sums = {};
    for (const c of run.collsOf[r]) {
      if (c.m1 > li) continue;
      const s = sums[c.op] = sums[c.op] || {calls: 0, bytes: 0, wire_bytes: 0, inter_node_bytes: 0};
      s.calls += 1; s.bytes += c.bytes; s.wire_bytes += c.wire; s.inter_node_bytes += c.inter;
    }
    const ops = OPS.filter((op) => run.collsOf[r].some((c) => c.op === op));
    const split = run.nodes > 1;
    const paper = end && run.paper ? run.paper.wire : null;
    const t = run.ledger;
    t.textContent = "";
    el("caption", {}, t, `Ledger of rank ${r}: what its collectives moved so far` + (end ? " (the whole step)" : ""));
    const head = el("tr", {}, el("thead", {}, t));
    for (const name of ["op", "calls", "payload B", "wire B"].concat(split ? ["inter-node B"] : [])
      .concat(paper ? ["paper, wire B"] : [])) el("th", {}, head, name);
    const body = el("tbody", {}, t);
    const total = {calls: 0, bytes: 0, wire_bytes: 0, inter_node_bytes: 0};
    for (const op of ops) {
      const s = sums[op] || {calls: 0, bytes: 0, wire_bytes: 0, inter_node_bytes: 0};
      const tr = el("tr", {"data-op": op}, body);
      el("td", {}, tr, op);
      for (const f of ["calls", "bytes", "wire_bytes"].concat(split ? ["inter_node_bytes"] : [])) {
        el("td", {"data-field": f, "data-value": s[f]}, tr, exact(s[f]));
        total[f] += s[f];
      }
      if (paper) {
        const p = paper[op];
        el("td", {class: "paper", title: p ? `Ψ = ${exact(run.paper.psi)}, b = ${run.paper.b}, N = ${run.paper.N}, G = ${run.paper.G}` : ""},
          tr, p ? `${exact(p[0])}  (${p[1]})` : "");
      }
    }
    const tr = el("tr", {class: "total"}, body);
    el("td", {}, tr, "total");
    el("td", {"data-field": "calls"}, tr, exact(total.calls));
    el("td", {"data-field": "bytes"}, tr, exact(total.bytes));
    el("td", {"data-field": "wire_bytes"}, tr, exact(total.wire_bytes));
    if (split) el("td", {"data-field": "inter_node_bytes"}, tr, exact(total.inter_node_bytes));
    if (paper) el("td", {class: "paper"}, tr, exact(Object.values(paper).reduce((a, p) => a + p[0], 0)));
    // model states: measured at the end of the step's last backward, the paper's beside it
    run.states.textContent = "";
    if (end && run.paper) {
      const smp = run.samples[r];
      let last = null;
      for (const s of smp) if (s.event === "phase_ends" && s.phase === "backward") last = s;
      if (last) {
        const held = last.held.reduce((a, h) => a + h[2], 0);
        run.states.textContent = `Model states of rank ${r} at the end of backward: ${exact(held)} B measured; ` +
          `paper ${run.paper.states[1]} = ${exact(run.paper.states[0])} B (Ψ = ${exact(run.paper.psi)}, no padding)`;
      }
    }
  }

  // ------------------------------------------------------------------ the caption
  const VERBS = {
    phase_begins: (s) => `begins ${s.phase}`,
    phase_ends: (s) => `ends ${s.phase}`,
    unit_begins: (s) => `${s.unit}: ${s.kind} begins`,
    unit_ends: (s) => `${s.unit}: ${s.kind} ends`,
    begin: (s) => `issues ${s.op} ${s.label} (${exact(s.bytes)} B)`,
    blocking: (s) => `waits for collective #${s.seq}`,
    end: (s) => `${s.op} ${s.label} done (${exact(s.wire_bytes)} B sent)`,
  };

  function caption(i) {
    const [t, k, li] = GLOBAL[i];
    const run = RUNS[k];
    const [, r, si] = run.moments[li];
    const s = run.samples[r][si];
    const box = document.getElementById("caption");
    box.textContent = "";
    el("b", {}, box, `${RUNS.length > 1 ? run.name + ", " : ""}rank ${r}: `);
    box.appendChild(document.createTextNode((VERBS[s.event] || ((x) => x.event))(s)));
    if (si > 0) {
      const before = {}, now = {};
      for (const [p, kind, b] of run.samples[r][si - 1].held) before[`${p}/${kind}`] = b;
      for (const [p, kind, b] of s.held) now[`${p}/${kind}`] = b;
      const changes = [];
      for (const key of new Set([...Object.keys(before), ...Object.keys(now)])) {
        const d = (now[key] || 0) - (before[key] || 0);
        if (d) {
          const [p, kind] = key.split("/");
          changes.push(`${d > 0 ? "+" : "\u2212"}${human(Math.abs(d))} ${KIND_NAMES[kind] || kind}${p === "device" ? "" : " (" + p + ")"}`);
        }
      }
      if (changes.length) el("span", {class: "delta"}, box, "   memory: " + changes.join(", "));
    }
    document.getElementById("counter").textContent = `event ${i + 1} / ${GLOBAL.length}`;
    document.getElementById("clock").textContent = `t = ${(t / 1000).toFixed(3)} ms`;
  }

  // ------------------------------------------------------------------ moving
  let cur = 0, timer = null, speed = 3;

  function render() {
    for (const run of RUNS) renderRun(run, cur);
    caption(cur);
    document.body.dataset.index = cur;
    document.getElementById("speed").textContent = `${SPEEDS[speed]} events/s`;
  }
  function go(i) {
    cur = Math.max(0, Math.min(GLOBAL.length - 1, i));
    render();
  }
  const isBegin = (i) => {
    const [, k, li] = GLOBAL[i];
    const m = RUNS[k].moments[li];
    return RUNS[k].samples[m[1]][m[2]].event === "begin";
  };
  function jump(dir) {
    for (let i = cur + dir; i >= 0 && i < GLOBAL.length; i += dir) if (isBegin(i)) return go(i);
    go(dir > 0 ? GLOBAL.length - 1 : 0);
  }
  function play(on) {
    if (timer) { clearInterval(timer); timer = null; }
    if (on) {
      if (cur >= GLOBAL.length - 1) go(0);
      timer = setInterval(() => { if (cur >= GLOBAL.length - 1) play(false); else go(cur + 1); }, 1000 / SPEEDS[speed]);
    }
    document.getElementById("play").textContent = timer ? "II" : "\u25B6";
    document.body.dataset.playing = timer ? "yes" : "no";
  }

  document.getElementById("first").addEventListener("click", () => go(0));
  document.getElementById("last").addEventListener("click", () => go(GLOBAL.length - 1));
  document.getElementById("back").addEventListener("click", (e) => (e.shiftKey ? jump(-1) : go(cur - 1)));
  document.getElementById("forward").addEventListener("click", (e) => (e.shiftKey ? jump(1) : go(cur + 1)));
  document.getElementById("play").addEventListener("click", () => play(!timer));
  document.addEventListener("keydown", (e) => {
    const key = e.key;
    if (key === "ArrowRight" || key === "PageDown") { e.shiftKey ? jump(1) : go(cur + 1); }
    else if (key === "ArrowLeft" || key === "PageUp") { e.shiftKey ? jump(-1) : go(cur - 1); }
    else if (key === " " || key === "k") { play(!timer); }
    else if (key === "Home") { go(0); }
    else if (key === "End") { go(GLOBAL.length - 1); }
    else if (key === "+" || key === "=") { speed = Math.min(SPEEDS.length - 1, speed + 1); if (timer) play(true); render(); }
    else if (key === "-") { speed = Math.max(0, speed - 1); if (timer) play(true); render(); }
    else if (key === "r" || key === "R") {
      for (const run of RUNS) run.ledgerRank = run.ranks[(run.ranks.indexOf(run.ledgerRank) + 1) % run.ranks.length];
      render();
    } else return;
    e.preventDefault();
  });

  // The page's policy (replay.html) lets it load nothing; anything it tried is noted here.
  const blocked = [];
  document.addEventListener("securitypolicyviolation", (e) => blocked.push(e.blockedURI || e.violatedDirective));
  RUNS.forEach(buildRun);
  // what a test (or a curious reader, in the console) can ask the page
  window.replay = {go, jump, count: GLOBAL.length, index: () => cur, moments: GLOBAL, blocked,
    ledgerRank: (k, r) => { RUNS[k].ledgerRank = r; render(); }};
  go(0);
})();
