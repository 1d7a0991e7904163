// mlwe operations console. Plain JavaScript, no dependencies, no network beyond this origin.
//
// Data comes from the API (snapshot routes) and one Server-Sent Events stream read
// with fetch() so the bearer token travels in a header, never in a URL. The stream
// resumes with Last-Event-ID after a disconnect. Every value from the server is put
// into the page with textContent: nothing is ever parsed as HTML.
"use strict";

(() => {
  const API = "api/v1";
  const MAX_ROWS = 250;
  const MAX_TRACES = 120;
  const MAX_POINTS = 240;
  // the lifecycle's states (mlwe.core.lifecycle.State); anything else on the state topic
  // (a workflow step such as "watch") is an event, not a state
  const LIFECYCLE = new Set(["pending", "admitted", "starting", "running", "preempting", "preempted",
    "stopping", "succeeded", "failed", "cancelled"]);
  // failures that are not the workload's doing: its node was lost, or the engine restarted
  // and found the process gone; the workload is requeued, so they are drawn as "lost"
  const LOST = new Set(["node-lost", "vanished"]);
  function causeOf(reason) {
    const m = typeof reason === "string" ? reason.match(/\(([^()]+)\)\s*$/) : null;
    return m ? m[1] : null;
  }
  function chipOf(state, cause) {
    if (state === "failed" && LOST.has(cause)) return { cls: "s-lost", text: cause === "vanished" ? "restart" : "lost" };
    return { cls: `s-${state}`, text: state };
  }

  // ------------------------------------------------------------------ state
  const S = {
    token: null,
    role: null,
    lastEventId: null,
    snapshot: null, // /cluster
    snapshotAt: 0, // performance.now() when the snapshot arrived
    workloads: new Map(), // id -> {id, name, priority, state, history[], correlation, changed}
    nodeTele: new Map(), // node -> Map(workload -> metrics), plus history
    nodeUtil: new Map(), // node -> [util samples]
    loss: new Map(), // workload -> {points: [[t, loss]], markers: [[t, label]]}
    wlTele: new Map(), // workload -> latest metrics
    filter: "",
    reveal: new Set(), // panels whose first match is still to be scrolled into view
    history: [], // stored cluster samples (GET /history), oldest first
    histSince: null,
    dirty: new Set(["map", "deadlines", "telemetry", "workloads", "reasoning", "audit", "kpis", "history"]),
    audit: [],
    traces: [],
    approvals: [],
    teleEvents: [],
    related: new Map(), // correlation id or workload -> Set(workload ids) in the same story
  };

  const $ = (id) => document.getElementById(id);
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtTime(t) {
    if (t === null || t === undefined) return "";
    const d = new Date(t * 1000);
    if (isNaN(d.getTime())) return String(t);
    return d.toTimeString().slice(0, 8);
  }
  function fmtDur(s) {
    const neg = s < 0;
    s = Math.abs(Math.round(s));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    const txt = h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
    return neg ? `-${txt}` : txt;
  }
  function hue(id) {
    let h = 2166136261;
    for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
    return Math.abs(h) % 360;
  }
  function prioClass(p) { return p >= 500 ? "urgent" : p >= 100 ? "high" : ""; }
  function nowEngine() {
    if (!S.snapshot) return Date.now() / 1000;
    return S.snapshot.now + (performance.now() - S.snapshotAt) / 1000;
  }
  function mark(...panels) { for (const p of panels) S.dirty.add(p); }
  function canOperate() { return S.role === "operator" || S.role === "admin"; }

  // ------------------------------------------------------------------ auth
  function loadToken() {
    const m = location.hash.match(/token=([^&]+)/);
    if (m) {
      sessionStorage.setItem("mlwe.token", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search); // keep it out of history
    }
    S.token = sessionStorage.getItem("mlwe.token");
  }
  function askToken(message) {
    const dlg = $("login");
    $("login-error").textContent = message || "";
    if (!dlg.open) dlg.showModal();
  }
  $("login-form").addEventListener("submit", () => {
    const v = $("login-token").value.trim();
    if (v) { sessionStorage.setItem("mlwe.token", v); S.token = v; start(); }
  });

  async function api(path, opts = {}) {
    const headers = Object.assign({ Accept: "application/json" }, opts.headers || {});
    if (S.token) headers.Authorization = `Bearer ${S.token}`;
    const res = await fetch(`${API}/${path}`, Object.assign({}, opts, { headers }));
    if (res.status === 401) { askToken("the token was refused; paste another"); throw new Error("unauthorised"); }
    let body = null;
    try { body = await res.json(); } catch (_) { body = null; }
    if (!res.ok) {
      const msg = body && body.detail ? body.detail : `${res.status} ${res.statusText}`;
      throw new Error(msg);
    }
    return body;
  }

  // ------------------------------------------------------------- stories
  function relate(key, wid) {
    if (!key || !wid) return;
    let s = S.related.get(key);
    if (!s) { s = new Set(); S.related.set(key, s); }
    s.add(wid);
  }
  // An element belongs to the filtered story if its workload, its correlation id, or
  // any workload it names (a preemption names its victims) matches the filter.
  function tag(node, workloads, correlation) {
    const ids = (workloads || []).filter(Boolean);
    node.dataset.workload = ids.join(" ");
    if (correlation) node.dataset.correlation = correlation;
    return node;
  }
  function matches(node) {
    const f = S.filter;
    if (!f) return false;
    const ids = (node.dataset.workload || "").split(" ");
    if (ids.includes(f) || node.dataset.correlation === f) return true;
    const story = S.related.get(f);
    return story ? ids.some((i) => story.has(i)) : false;
  }
  // the scrolling lists, each brought to its first match when the filter changes
  const REVEAL = ["workloads", "audit", "reasoning", "deadlines", "loss-charts", "node-telemetry",
    "telemetry-events", "cluster-map"];
  function scrollWithin(box, node) {
    const b = box.getBoundingClientRect(), r = node.getBoundingClientRect();
    if (r.top < b.top || r.bottom > b.bottom) box.scrollTop += r.top - b.top - 4;
    if (r.left < b.left || r.right > b.right) box.scrollLeft += r.left - b.left - 4;
  }
  function applyFilter(root) {
    const scope = root || document;
    document.body.classList.toggle("filtering", !!S.filter);
    for (const n of scope.querySelectorAll("[data-workload]")) n.classList.toggle("match", matches(n));
    // after a panel's render (its new order), not on the keystroke: that would scroll to
    // where the match was before the story was sorted first
    for (const id of [...S.reveal]) {
      const box = $(id);
      if (!root || !box || !(root === box || root.contains(box))) continue;
      const first = box.querySelector(".match");
      if (first) { scrollWithin(box, first); S.reveal.delete(id); }
    }
  }
  function setFilter(v) {
    S.filter = (v || "").trim();
    $("filter").value = S.filter;
    const url = new URL(location.href);
    if (S.filter) url.searchParams.set("filter", S.filter); else url.searchParams.delete("filter");
    history.replaceState(null, "", url.pathname + url.search); // kept in the URL, shareable
    S.reveal = new Set(S.filter ? REVEAL : []);
    mark("workloads", "telemetry", "audit", "reasoning", "map");
    applyFilter();
  }
  $("filter").addEventListener("input", (e) => setFilter(e.target.value));
  document.addEventListener("click", async (e) => {
    const act = e.target.closest("button[data-action]");
    if (act) {
      const a = act.dataset.action;
      const path = act.dataset.node
        ? `nodes/${encodeURIComponent(act.dataset.node)}/${a}`
        : `agent/approvals/${encodeURIComponent(act.dataset.approval)}/${a}`;
      act.disabled = true;
      try {
        const r = await api(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: "{}" });
        toast(r.message);
      } catch (err) {
        toast(`${a}: ${err.message}`, true);
      } finally {
        act.disabled = false;
        refreshSnapshot();
        agentStatus();
      }
      return;
    }
    const t = e.target.closest("[data-pick]");
    if (t) setFilter(t.dataset.pick);
  });

  // ------------------------------------------------------------ workloads
  function upsertWorkload(w) {
    const cur = S.workloads.get(w.id) || { history: [] };
    // a snapshot answered after newer state events arrived is older than what is shown:
    // keep what the stream said (its lifecycle would drop the states seen since)
    if (typeof w.transitions === "number" && (cur.seen || 0) > w.transitions) return cur;
    const merged = Object.assign(cur, w);
    if (typeof w.transitions === "number") merged.seen = w.transitions;
    if (w.history) {
      merged.history = w.history.map((h) => h.target);
      merged.causes = w.history.map((h) => (h.target === "failed" ? causeOf(h.reason) : null));
    } else if (w.lifecycle) { // the server's record is the truth
      merged.history = w.lifecycle.slice();
      merged.causes = (w.lifecycle_causes || []).slice();
    }
    S.workloads.set(w.id, merged);
    if (merged.correlation_id) relate(merged.correlation_id, w.id);
    return merged;
  }
  // replay: an event from before the snapshot the page loaded (its transitions are already
  // in the workload's lifecycle; only the telemetry markers and the story links are new)
  function onState(ev, replay = false) {
    const d = ev.data || {};
    const wid = d.workload || ev.workload;
    if (!wid) return;
    if (d.type === "command") return; // backend commands: the transitions tell the story
    const to = d.to || d.target || d.state;
    if (!LIFECYCLE.has(to)) { // a workflow step or other event: told, not drawn as a state
      relate(ev.correlation_id, wid);
      if (to) {
        S.teleEvents.unshift({ time: ev.time, workload: wid, kind: "step", text: `${wid} ${to}`, correlation: ev.correlation_id });
        S.teleEvents.length = Math.min(S.teleEvents.length, 80);
        mark("telemetry");
      }
      return;
    }
    const w = S.workloads.get(wid) || { id: wid, name: d.name || wid, priority: d.priority ?? 0, history: [] };
    if (d.name) w.name = d.name;
    if (d.priority !== undefined) w.priority = d.priority;
    // a workload the snapshot did not include (older than the latest 200): its story is the replay
    if (replay && w.state === undefined) w.fromReplay = true;
    const fresh = Boolean(w.fromReplay);
    if (typeof d.seq === "number") w.seen = Math.max(w.seen || 0, d.seq);
    if (!replay || fresh) w.state = d.to || d.target || d.state || w.state;
    if (d.deadline !== undefined) w.deadline = d.deadline;
    if ((d.to || d.target) === "preempting" && typeof d.reason === "string" && d.reason.startsWith("preempted by ")) {
      d.preempted_by = d.reason.slice(13).split(" ")[0];
      w.preempted_by = d.preempted_by;
    }
    if (!replay || fresh) {
      if (!w.causes) w.causes = w.history.map(() => null);
      if (w.history[w.history.length - 1] !== w.state) {
        w.history.push(w.state);
        w.causes.push(w.state === "failed" ? causeOf(d.reason) : null);
      }
      w.changed = performance.now();
      w.flash = true;
    }
    const st = d.to || d.target || d.state;
    w.correlation_id = w.correlation_id || ev.correlation_id;
    S.workloads.set(wid, w);
    relate(ev.correlation_id, wid);
    if (d.cause_id) relate(d.cause_id, wid);
    if (d.preempted_by) { relate(d.preempted_by, wid); relate(wid, d.preempted_by); }
    // telemetry-visible moments: a run starts, is asked to stop, or ends
    if (["running", "preempting", "preempted", "failed", "succeeded", "stopping"].includes(st)) {
      const by = d.preempted_by ? ` by ${d.preempted_by}` : "";
      const lost = st === "failed" && LOST.has(causeOf(d.reason));
      const label = lost ? `${chipOf(st, causeOf(d.reason)).text} (requeued)` : `${st}${by}`;
      const L = S.loss.get(wid);
      if (L) L.markers.push([ev.time, st]);
      S.teleEvents.unshift({ time: ev.time, workload: wid, kind: lost ? "lost" : st, text: `${wid} ${label}`, also: d.preempted_by, correlation: ev.correlation_id });
      S.teleEvents.length = Math.min(S.teleEvents.length, 80);
    }
    mark("workloads", "telemetry", "deadlines");
  }

  function renderWorkloads() {
    const list = $("workloads");
    const isMatch = (w) => S.filter && matches({ dataset: { workload: [w.id, w.preempted_by].filter(Boolean).join(" "), correlation: w.correlation_id || "" } });
    const items = [...S.workloads.values()]
      .sort((a, b) => (S.filter ? isMatch(b) - isMatch(a) : 0) ||
        (b.changed || 0) - (a.changed || 0) || (b.priority || 0) - (a.priority || 0))
      .slice(0, MAX_ROWS);
    const frag = document.createDocumentFragment();
    for (const w of items) {
      const li = tag(el("li", "wl-row"), [w.id, w.preempted_by], w.correlation_id);
      li.dataset.state = w.state || "";
      li.id = `wl-${w.id}`;
      const id = el("span", "wid");
      id.dataset.pick = w.id;
      id.append(el("span", "", w.id));
      if (w.name && w.name !== w.id) id.append(el("span", "wname", w.name));
      li.append(id);
      li.append(el("span", `prio ${prioClass(w.priority || 0)}`, w.priority ?? ""));
      const chain = el("span", "chain-states");
      const all = w.history || [];
      const hist = all.slice(-6);
      const off = all.length - hist.length;
      hist.forEach((s, i) => {
        if (i) chain.append(el("span", "st arrow", "›"));
        const c = chipOf(s, (w.causes || [])[off + i]);
        const chip = el("span", `st ${c.cls}`, c.text);
        if (c.cls === "s-lost") chip.title = "not the workload's failure: node lost or engine restarted; requeued";
        chain.append(chip);
      });
      li.append(chain);
      // Kueue's distinction: a queued workload that could never run here is not "waiting"
      const inadmissible = w.condition === "inadmissible" && ["pending", "preempted"].includes(w.state);
      const now = chipOf(w.state, (w.causes || [])[(w.causes || []).length - 1]);
      const badge = el("span", `st state-badge ${inadmissible ? "s-inadmissible" : now.cls}`,
        inadmissible ? "inadmissible" : now.text || "");
      if (inadmissible) badge.title = (w.inadmissible_reasons || []).join("; ");
      li.append(badge);
      if (w.flash) { li.classList.add("flash"); w.flash = false; }
      frag.append(li);
    }
    list.replaceChildren(frag);
    if (!items.length) list.append($("tpl-empty").content.cloneNode(true));
    applyFilter(list);
  }

  // ------------------------------------------------------------ telemetry
  function onTelemetry(ev) {
    const d = ev.data || {};
    const node = d.node;
    const wid = d.workload || ev.workload;
    const m = d.metrics || {};
    if (node) {
      let per = S.nodeTele.get(node);
      if (!per) { per = new Map(); S.nodeTele.set(node, per); }
      per.set(wid || "_node", Object.assign({ t: ev.time }, m));
      let u = S.nodeUtil.get(node);
      if (!u) { u = []; S.nodeUtil.set(node, u); }
      if (typeof m.gpu_util === "number") { u.push(m.gpu_util); if (u.length > 60) u.shift(); }
    }
    if (wid) {
      S.wlTele.set(wid, Object.assign({ t: ev.time, node }, m));
      if (typeof m.loss === "number" || m.loss === null || (typeof m.loss === "string")) {
        let L = S.loss.get(wid);
        if (!L) { L = { points: [], markers: [] }; S.loss.set(wid, L); }
        const last = L.points[L.points.length - 1];
        if (!last || last[0] !== ev.time) L.points.push([ev.time, Number(m.loss)]);
        if (L.points.length > MAX_POINTS) L.points.shift();
      }
    }
    mark("telemetry");
  }

  function deviceHolder(nodeName) {
    // per GPU: the workload holding it (from the snapshot), for per-GPU figures
    const n = S.snapshot && S.snapshot.nodes.find((x) => x.name === nodeName);
    return n ? n.devices.map((d) => (d.holders[0] ? d.holders[0].id : null)) : [];
  }

  function renderTelemetry() {
    const grid = $("node-telemetry");
    const frag = document.createDocumentFragment();
    const nodes = S.snapshot ? S.snapshot.nodes : [];
    for (const n of nodes) {
      const per = S.nodeTele.get(n.name) || new Map();
      const holders = deviceHolder(n.name);
      const box = tag(el("div", "nt"), [...new Set(holders.filter(Boolean).concat(n.workloads || []))]);
      const head = el("div", "nt-head");
      head.append(el("span", "", n.name), el("span", "", n.gpu_model || "cpu"));
      box.append(head);
      const bars = el("div", "bars");
      let power = 0, vram = 0, utilSum = 0, utilN = 0;
      const devs = n.gpus ? holders : [null];
      devs.forEach((wid, i) => {
        const bar = el("div", "bar");
        const m = wid ? per.get(wid) : per.get("_node");
        const util = m && typeof m.gpu_util === "number" ? m.gpu_util : (n.gpus ? 0 : (m && m.cpu_util) || 0);
        const fill = el("i");
        fill.style.height = `${Math.round(Math.max(0, Math.min(1, util)) * 100)}%`;
        if (wid) fill.style.background = `hsl(${hue(wid)} 70% 58%)`;
        bar.append(fill);
        if (n.gpus) {
          const dev = n.devices[i];
          const used = dev ? dev.holders.reduce((a, h) => a + h.milli, 0) / 1000 : 0;
          const v = el("b");
          v.style.height = `${Math.round(used * 100)}%`;
          v.title = "VRAM allocated";
          bar.append(v);
          vram += used * n.vram_per_gpu;
        }
        bar.title = wid ? `GPU ${i}: ${wid} · util ${(util * 100).toFixed(0)}%` : `idle`;
        if (m && typeof m.gpu_power_w === "number") power += m.gpu_power_w;
        utilSum += util; utilN += 1;
        bars.append(bar);
      });
      box.append(bars);
      const foot = el("div", "nt-foot");
      foot.append(
        el("span", "", `util ${utilN ? Math.round((utilSum / utilN) * 100) : 0}%`),
        el("span", "", n.gpus ? `vram ${(vram / 1024).toFixed(0)}G` : `cpu ${Math.round((1 - n.free.cpu / n.capacity.cpu) * 100)}%`),
        el("span", "", `${Math.round(power)}W`),
      );
      box.append(foot);
      frag.append(box);
    }
    grid.replaceChildren(frag);

    const charts = $("loss-charts");
    const storyOf = (wid) => S.filter && (wid === S.filter || (S.related.get(S.filter) || new Set()).has(wid));
    const live = [...S.loss.entries()]
      .filter(([wid]) => {
        const w = S.workloads.get(wid);
        return storyOf(wid) || !w || !["succeeded", "cancelled"].includes(w.state);
      })
      .sort((a, b) => storyOf(b[0]) - storyOf(a[0]))
      .slice(0, 12);
    const cf = document.createDocumentFragment();
    for (const [wid, L] of live) {
      const w = S.workloads.get(wid);
      const box = tag(el("div", "chart"), [wid, w && w.preempted_by]);
      const pts = L.points;
      const lastLoss = pts.length ? pts[pts.length - 1][1] : NaN;
      const diverging = pts.length > 4 && (!isFinite(lastLoss) || lastLoss > 1.5 * Math.min(...pts.map((p) => p[1]).filter(isFinite)) + 0.2);
      if (diverging) box.classList.add("diverging");
      const title = el("div", "ctitle");
      title.dataset.pick = wid;
      title.append(el("span", "", `${wid} · loss`), el("span", "", isFinite(lastLoss) ? lastLoss.toFixed(3) : "NaN"));
      box.append(title);
      const cv = el("canvas");
      cv.width = 360; cv.height = 96;
      box.append(cv);
      drawLoss(cv, L, wid);
      cf.append(box);
    }
    charts.replaceChildren(cf);

    const evs = $("telemetry-events");
    const ef = document.createDocumentFragment();
    for (const e of S.teleEvents.slice(0, 40)) {
      const li = tag(el("li", "tevent"), [e.workload, e.also], e.correlation);
      li.dataset.kind = e.kind;
      li.append(el("span", "", `${fmtTime(e.time)} `), el("span", `k-${e.kind}`, e.text));
      ef.append(li);
    }
    evs.replaceChildren(ef);
    applyFilter($("panel-telemetry"));
  }

  function drawLoss(cv, L, wid) {
    const ctx = cv.getContext("2d");
    const W = cv.width, H = cv.height, pts = L.points.filter((p) => isFinite(p[1]));
    ctx.clearRect(0, 0, W, H);
    if (pts.length < 2) return;
    const t0 = pts[0][0], t1 = pts[pts.length - 1][0];
    let lo = Infinity, hi = -Infinity;
    for (const p of pts) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); }
    if (hi - lo < 1e-6) { hi += 0.5; lo -= 0.5; }
    const x = (t) => ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - 8) + 4;
    const y = (v) => H - 6 - ((v - lo) / (hi - lo)) * (H - 12);
    ctx.strokeStyle = "#232b39"; ctx.lineWidth = 1;
    for (let i = 1; i < 4; i++) { ctx.beginPath(); ctx.moveTo(0, (H * i) / 4); ctx.lineTo(W, (H * i) / 4); ctx.stroke(); }
    for (const [t, kind] of L.markers) {
      if (t < t0 || t > t1 + 60) continue;
      ctx.strokeStyle = kind.startsWith("preempt") ? "#f5b942" : kind === "failed" ? "#ff5d6c" : "#3fcf8e";
      ctx.beginPath(); ctx.moveTo(x(Math.min(t, t1)), 0); ctx.lineTo(x(Math.min(t, t1)), H); ctx.stroke();
    }
    ctx.strokeStyle = `hsl(${hue(wid)} 70% 62%)`; ctx.lineWidth = 2;
    ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1]))));
    ctx.stroke();
  }

  // ------------------------------------------------------ cluster over time
  // from the stored samples (GET /history), so the plots survive a reload
  async function loadClusterHistory() {
    try {
      const q = S.histSince === null ? "history?limit=720" : `history?since=${S.histSince}&limit=720`;
      const r = await api(q);
      if (r.items.length) {
        S.history = S.history.concat(r.items).slice(-720);
        S.histSince = r.next_since;
        mark("history");
      }
    } catch (_) { /* the connection badge says it */ }
  }
  const PLOTS = [
    { id: "plot-util", title: "GPUs allocated", unit: "%", series: (m) => [["allocated", (m.gpu_util || 0) * 100, "#5ab0ff"]] },
    { id: "plot-queue", title: "waiting, by queue", unit: "", series: (m) => Object.keys(m).filter((k) => k.startsWith("pending:"))
        .sort().map((k) => [k.slice(8), m[k], `hsl(${hue(k)} 65% 60%)`]) },
    { id: "plot-preempt", title: "preemptions · GPU-h lost", unit: "", series: (m) => [
        ["preemptions", m.preemptions || 0, "#f5b942"], ["GPU-h lost", m.lost_gpu_h || 0, "#ff5d6c"]] },
    { id: "plot-deadlines", title: "deadlines met · missed", unit: "", series: (m) => [
        ["met", m.deadlines_met || 0, "#3fcf8e"], ["missed", m.deadlines_missed || 0, "#ff5d6c"]] },
  ];
  function renderHistory() {
    const pts = S.history;
    for (const P of PLOTS) {
      const box = $(P.id);
      if (!box) continue;
      const cv = box.querySelector("canvas");
      const legend = box.querySelector(".legend");
      const names = new Map();
      for (const p of pts) for (const [n, , c] of P.series(p.metrics)) names.set(n, c);
      const last = pts.length ? P.series(pts[pts.length - 1].metrics) : [];
      legend.replaceChildren(...[...names.entries()].map(([n, c]) => {
        const cur = last.find((x) => x[0] === n);
        const sp = el("span", "", `${n} ${cur ? Number(cur[1]).toFixed(P.unit === "%" ? 0 : 1) + P.unit : ""}`);
        sp.style.color = c;
        return sp;
      }));
      box.dataset.points = String(pts.length);
      const W = cv.width = Math.max(200, Math.floor(cv.clientWidth || 280));
      const H = cv.height = 70;
      const ctx = cv.getContext("2d");
      ctx.clearRect(0, 0, W, H);
      if (pts.length < 2) { ctx.fillStyle = "#5a6578"; ctx.fillText("collecting samples…", 6, 20); continue; }
      const t0 = pts[0].time, t1 = pts[pts.length - 1].time;
      let hi = P.unit === "%" ? 100 : 1;
      for (const p of pts) for (const [, v] of P.series(p.metrics)) hi = Math.max(hi, v);
      const x = (t) => ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - 6) + 3;
      const y = (v) => H - 4 - (v / hi) * (H - 10);
      ctx.strokeStyle = "#232b39"; ctx.lineWidth = 1;
      for (let i = 1; i < 3; i++) { ctx.beginPath(); ctx.moveTo(0, (H * i) / 3); ctx.lineTo(W, (H * i) / 3); ctx.stroke(); }
      for (const [n, c] of names) {
        ctx.strokeStyle = c; ctx.lineWidth = 1.6; ctx.beginPath();
        let started = false;
        for (const p of pts) {
          const v = (P.series(p.metrics).find((s2) => s2[0] === n) || [n, 0])[1];
          if (!started) { ctx.moveTo(x(p.time), y(v)); started = true; } else ctx.lineTo(x(p.time), y(v));
        }
        ctx.stroke();
      }
      ctx.fillStyle = "#8591a5"; ctx.fillText(`${hi.toFixed(P.unit === "%" ? 0 : 1)}${P.unit}`, W - 34, 10);
    }
  }

  // ----------------------------------------------------------- cluster map
  function renderMap() {
    const map = $("cluster-map");
    const frag = document.createDocumentFragment();
    const nodes = S.snapshot ? S.snapshot.nodes : [];
    for (const n of nodes) {
      const box = el("div", `node ${n.status}`);
      box.id = `node-${n.name}`;
      const head = el("div", "nname");
      head.append(el("span", "", n.name), el("span", "nmodel", n.gpu_model ? `${n.gpus}×${n.gpu_model}` : "cpu"));
      box.append(head);
      if (n.status !== "ready") box.append(el("div", "nstatus", n.status));
      if (canOperate() && n.status !== "down") {
        const acts = el("div", "node-actions");
        const toggle = n.status === "cordoned" ? "uncordon" : "cordon";
        for (const a of [toggle, "drain"]) {
          const b = el("button", "node-act", a);
          b.type = "button";
          b.dataset.action = a;
          b.dataset.node = n.name;
          acts.append(b);
        }
        box.append(acts);
      }
      if (n.gpus) {
        const g = el("div", "gpus");
        g.style.gridTemplateColumns = `repeat(${Math.min(8, n.gpus)}, 16px)`;
        for (const d of n.devices) {
          const cell = el("div", "gpu");
          const h = d.holders[0];
          if (h) {
            cell.classList.add("busy");
            const pc = prioClass(h.priority);
            if (pc) cell.classList.add(`p-${pc}`);
            if (d.holders.length > 1 || h.milli < 1000) cell.classList.add("frac");
            const light = h.state === "preempting" || h.state === "stopping" ? 30 : 52;
            cell.style.background = `hsl(${hue(h.id)} 62% ${light}%)`;
            tag(cell, d.holders.map((x) => x.id));
            cell.dataset.pick = h.id;
          } else {
            tag(cell, []);
          }
          cell.title = h
            ? `${n.name} GPU ${d.index}: ` + d.holders.map((x) => `${x.id} (${x.name}, prio ${x.priority}, ${x.milli}m, ${x.state})`).join("; ")
            : `${n.name} GPU ${d.index}: free`;
          g.append(cell);
        }
        box.append(g);
      } else {
        const bar = el("div", "cpu-bar");
        const f = el("div");
        f.style.width = `${Math.round((1 - n.free.cpu / Math.max(1, n.capacity.cpu)) * 100)}%`;
        bar.append(f);
        bar.title = `${n.workloads.length} workload(s); ${(n.free.cpu / 1000).toFixed(0)} free cores`;
        tag(bar, n.workloads);
        box.append(bar);
      }
      frag.append(box);
    }
    map.replaceChildren(frag);
    applyFilter(map);
  }

  function renderDeadlines() {
    const list = $("deadlines");
    const now = nowEngine();
    const ws = [...S.workloads.values()].filter(
      (w) => w.deadline && !["succeeded", "cancelled"].includes(w.state),
    );
    ws.sort((a, b) => a.deadline - b.deadline);
    const frag = document.createDocumentFragment();
    for (const w of ws.slice(0, 60)) {
      const left = w.deadline - now;
      const cls = left < 0 ? "missed" : w.deadline_at_risk ? "risk" : "safe";
      const li = tag(el("li", cls), [w.id], w.correlation_id);
      const name = el("span", "dname", `${w.id} ${w.name && w.name !== w.id ? "· " + w.name : ""}`);
      name.dataset.pick = w.id;
      li.append(name, el("span", "dleft", left < 0 ? `missed ${fmtDur(-left)}` : fmtDur(left)));
      li.append(el("span", "dmeta", `${w.state} · prio ${w.priority} · progress ${Math.round((w.progress || 0) * 100)}%${w.deadline_at_risk ? " · at risk" : ""}`));
      frag.append(li);
    }
    list.replaceChildren(frag);
    if (!ws.length) list.append(el("li", "empty", "no workload with a deadline"));
    applyFilter(list);
  }

  function renderKpis() {
    const k = $("kpis");
    const t = S.snapshot ? S.snapshot.totals : {};
    const items = [
      ["GPUs used", `${Math.round(t.gpus_used || 0)}/${Math.round(t.gpus || 0)}`],
      ["running", t.running || 0],
      ["pending", (t.pending || 0) + (t.preempted || 0)],
      ["preemptions", t.preemptions || 0],
      ["nodes ready", `${t.nodes_ready || 0}/${t.nodes || 0}`],
      ["version", S.snapshot ? S.snapshot.version : "-"],
    ];
    const frag = document.createDocumentFragment();
    for (const [label, v] of items) {
      const d = el("div", "kpi");
      if (label === "nodes ready" && t.nodes_ready < t.nodes) d.classList.add("alert");
      d.append(el("b", "", v), el("span", "", label));
      frag.append(d);
    }
    k.replaceChildren(frag);
  }

  // ------------------------------------------------------------ reasoning
  function asList(v) {
    if (v === undefined || v === null) return [];
    if (Array.isArray(v)) return v;
    return [v];
  }
  function textOf(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "string") return v;
    if (typeof v === "number" || typeof v === "boolean") return String(v);
    if (Array.isArray(v)) return v.map(textOf).join("; ");
    if (typeof v === "object") {
      for (const k of ["summary", "description", "text", "name", "kind", "action"]) if (typeof v[k] === "string") {
        const extra = v.score !== undefined ? ` (score ${v.score})` : "";
        return v[k] + extra;
      }
      return JSON.stringify(v);
    }
    return String(v);
  }
  function workloadsIn(d) {
    const out = new Set();
    const scan = (v, depth) => {
      if (depth > 4 || v === null || v === undefined) return;
      if (typeof v === "string") { if (S.workloads.has(v)) out.add(v); return; }
      if (Array.isArray(v)) { v.forEach((x) => scan(x, depth + 1)); return; }
      if (typeof v === "object") for (const [k, x] of Object.entries(v)) {
        if (["workload", "workloads", "victim", "victims", "preemptor", "target", "subject", "finding"].includes(k)) scan(x, depth + 1);
        else if (typeof x === "object") scan(x, depth + 1);
      }
    };
    scan(d, 0);
    return [...out];
  }
  function onReasoning(ev) {
    const d = ev.data || {};
    const ws = new Set(workloadsIn(d));
    if (ev.workload) ws.add(ev.workload);
    for (const w of ws) relate(ev.correlation_id, w);
    S.traces.unshift({ time: ev.time, data: d, workloads: [...ws], correlation: ev.correlation_id });
    S.traces.length = Math.min(S.traces.length, MAX_TRACES);
    mark("reasoning");
  }
  // One shape for every trace: the agent's decisions (finding, considered plans, choice,
  // outcome) and the scheduler's preemptions (relayed by the API).
  function normTrace(d) {
    if (d.type === "agent-decision") {
      const t = d.trace || {};
      const f = d.finding || {};
      const considered = asList(t.considered).map((c) => {
        const score = typeof c.score === "number" ? ` ${c.score.toFixed(2)}` : "";
        return `${c.summary || c.plan_id}${score}${c.verdict ? " (" + c.verdict + ")" : ""}`;
      });
      const chosen = asList(d.candidates).find((c) => c.id === t.chose);
      const fc = d.forecast && (d.forecast.summary || "");
      return {
        source: `agent · ${d.reasoner || t.reasoner || ""} · ${d.mode || ""}`,
        title: f.summary || f.id || "finding",
        findings: asList(t.saw).map(textOf).join(" · ") || f.summary,
        options: considered.join(" · ") || asList(d.candidates).map(textOf).join(" · "),
        choice: chosen ? chosen.summary : t.chose || "",
        why: asList(t.why).map(textOf).join("; "),
        verdict: `${d.outcome || ""}${d.reasons && d.reasons.length ? ": " + d.reasons.join("; ") : ""}${fc ? " · forecast: " + fc : ""}`,
      };
    }
    return {
      source: d.source || d.reasoner || d.loop || "agent",
      title: d.title || d.trigger || d.summary || d.kind || "trace",
      findings: asList(d.findings || d.observations || d.saw).map(textOf).join(" · "),
      options: asList(d.options || d.candidates || d.considered).map(textOf).join(" · "),
      choice: textOf(d.choice || d.chosen || d.decision || d.plan),
      why: asList(d.why || d.reasons || d.rationale).map(textOf).join("; "),
      verdict: textOf(d.verdict || d.outcome || d.result),
    };
  }
  function renderReasoning() {
    const list = $("reasoning");
    const frag = document.createDocumentFragment();
    for (const a of S.approvals) {
      const plan = a.plan || {};
      const ws = [(plan.finding || {}).subject].filter(Boolean);
      const li = tag(el("li", "trace approval"), ws, a.correlation_id);
      li.append(el("span", "ttime", "approval"));
      const head = el("div", "thead");
      head.append(el("span", "src", "agent · waiting for an operator"), el("span", "", a.summary || a.id));
      li.append(head);
      const body = el("div", "tbody approval-actions");
      if (canOperate()) {
        for (const act of ["approve", "reject"]) {
          const b = el("button", `node-act ${act}`, act);
          b.type = "button";
          b.dataset.action = act;
          b.dataset.approval = a.id;
          body.append(b);
        }
      } else {
        body.append(el("span", "", "an operator approves or rejects it"));
      }
      li.append(body);
      frag.append(li);
    }
    for (const tr of S.traces) {
      const n = normTrace(tr.data);
      const li = tag(el("li", "trace"), tr.workloads, tr.correlation);
      li.dataset.source = String(n.source).split(" ")[0];
      li.append(el("span", "ttime", fmtTime(tr.time)));
      const head = el("div", "thead");
      head.append(el("span", "src", n.source), el("span", "", n.title));
      li.append(head);
      const body = el("dl", "tbody");
      for (const k of ["findings", "options", "choice", "why", "verdict"]) {
        const v = n[k];
        if (!v) continue;
        body.append(el("dt", "", k));
        const dd = el("dd", "", v);
        if (k === "verdict") {
          const lv = v.toLowerCase();
          dd.className = lv.includes("reject") || lv.includes("gave-up") ? "verdict-rejected"
            : lv.includes("commit") || lv.includes("applied") ? "verdict-accepted" : "verdict-pending";
        }
        body.append(dd);
      }
      li.append(body);
      frag.append(li);
    }
    list.replaceChildren(frag);
    if (!S.traces.length && !S.approvals.length) list.append(el("li", "empty", "no reasoning yet"));
    applyFilter(list);
  }

  // ---------------------------------------------------------------- audit
  function auditWorkloads(a) {
    const ids = new Set();
    if (a.workload) ids.add(a.workload);
    const p = a.payload || {};
    for (const k of ["victim", "preemptor", "workload"]) if (typeof p[k] === "string") ids.add(p[k]);
    for (const k of ["victims", "workloads", "created"]) if (Array.isArray(p[k])) p[k].forEach((x) => typeof x === "string" && ids.add(x));
    if (typeof p.chosen === "string" && p.chosen.startsWith("evict ")) p.chosen.slice(6).split(", ").forEach((x) => ids.add(x.trim()));
    return [...ids];
  }
  function onAudit(ev) {
    const a = Object.assign({}, ev.data || {}, { workload: ev.workload, correlation_id: ev.correlation_id, time: ev.time });
    const ids = auditWorkloads(a);
    for (const w of ids) relate(a.correlation_id || ev.correlation_id, w);
    if (ids.length > 1) for (const w of ids) for (const o of ids) relate(w, o);
    if (S.audit.length && S.audit[0].seq >= a.seq) return; // already shown (resume overlap)
    S.audit.unshift(a);
    S.audit.length = Math.min(S.audit.length, MAX_ROWS);
    mark("audit");
  }
  // one readable line per record: what was chosen or done, then its facts as key=value
  function pairs(p, skip) {
    return Object.entries(p)
      .filter(([k, v]) => !skip.includes(k) && v !== null && v !== undefined && v !== "" && typeof v !== "object")
      .slice(0, 6)
      .map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`)
      .join(" · ");
  }
  function auditWhat(a) {
    const p = a.payload || {};
    if (p.chosen) return `${p.chosen}${p.reasons && p.reasons.length ? " — " + p.reasons[0] : ""}`;
    const head = p.action || p.event || p.outcome || p.summary || p.type || "";
    const rest = pairs(p, ["action", "event", "outcome", "summary", "type", "kind", "workload", "seq"]);
    const list = ["created", "victims", "workloads", "running"].filter((k) => Array.isArray(p[k]) && p[k].length)
      .map((k) => `${k} ${p[k].slice(0, 4).join(", ")}${p[k].length > 4 ? "…" : ""}`).join(" · ");
    return [head, rest, list].filter(Boolean).join(" · ") || a.kind;
  }
  function renderAudit() {
    const list = $("audit");
    const frag = document.createDocumentFragment();
    for (const a of S.audit) {
      const kind = (a.payload && a.payload.kind) || a.kind;
      const li = tag(el("li", "audit-row"), auditWorkloads(a), a.correlation_id);
      li.dataset.kind = kind;
      li.append(el("span", "seq", a.seq));
      li.append(el("span", "", fmtTime(a.time)));
      li.append(el("span", `akind k-${kind}`, kind));
      li.append(el("span", "aactor", a.actor || ""));
      const what = el("span", "awhat", `${a.workload ? a.workload + ": " : ""}${auditWhat(a)}`);
      what.title = `${a.actor} · ${auditWhat(a)}`;
      if (a.workload) what.dataset.pick = a.workload;
      li.append(what);
      li.append(el("span", "ahash", (a.hash || "").slice(0, 8)));
      frag.append(li);
    }
    list.replaceChildren(frag);
    if (!S.audit.length) list.append(el("li", "empty", "no audit records yet"));
    applyFilter(list);
  }
  async function checkChain() {
    try {
      const r = await api("audit/verify");
      const c = $("chain");
      c.className = `chain ${r.ok ? "ok" : "bad"}`;
      c.textContent = r.ok
        ? `chain ✓ ${r.checked} records · head ${r.head_hash.slice(0, 12)}`
        : `chain BROKEN at #${r.first_bad_seq}: ${r.reason}`;
    } catch (e) {
      $("chain").textContent = `chain: ${e.message}`;
    }
  }

  // --------------------------------------------------------------- stream
  let streamAbort = null;
  async function stream() {
    const conn = $("conn");
    let backoff = 500;
    for (;;) {
      streamAbort = new AbortController();
      try {
        const headers = { Accept: "text/event-stream", Authorization: `Bearer ${S.token}` };
        if (S.lastEventId !== null) headers["Last-Event-ID"] = String(S.lastEventId);
        const res = await fetch(`${API}/streams?topics=telemetry,state,reasoning,audit`, { headers, signal: streamAbort.signal });
        if (res.status === 401) { askToken("the token was refused"); return; }
        if (!res.ok || !res.body) throw new Error(`stream: ${res.status}`);
        conn.className = "conn live"; $("conn-text").textContent = "live";
        backoff = 500;
        const reader = res.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            handleBlock(block);
          }
        }
      } catch (e) {
        if (e.name === "AbortError") return;
      }
      conn.className = "conn down"; $("conn-text").textContent = "reconnecting";
      await new Promise((r) => setTimeout(r, backoff));
      backoff = Math.min(backoff * 2, 10000);
    }
  }
  function handleBlock(block) {
    let event = "message", data = "", id = null;
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const c = line.indexOf(":");
      const field = c < 0 ? line : line.slice(0, c);
      const value = c < 0 ? "" : line.slice(c + 1).replace(/^ /, "");
      if (field === "event") event = value;
      else if (field === "data") data += (data ? "\n" : "") + value;
      else if (field === "id") id = value;
    }
    if (id !== null) S.lastEventId = id;
    if (!data) return;
    let payload;
    try { payload = JSON.parse(data); } catch (_) { return; }
    switch (event) {
      case "state": onState(payload); break;
      case "telemetry": onTelemetry(payload); break;
      case "reasoning": onReasoning(payload); break;
      case "audit": onAudit(payload); break;
      case "dropped": toast(`stream: ${payload.dropped} event(s) dropped (slow connection); state refreshed`, true); refreshSnapshot(); break;
      case "gap": refreshSnapshot(); break;
      default: break;
    }
  }

  // ------------------------------------------------------------ snapshots
  // A console stays open for days: forget finished workloads beyond the most recent ones.
  const KEEP_WORKLOADS = 1500;
  function prune() {
    if (S.workloads.size > KEEP_WORKLOADS) {
      const done = [...S.workloads.values()]
        .filter((w) => ["succeeded", "cancelled", "failed"].includes(w.state))
        .sort((a, b) => (a.changed || 0) - (b.changed || 0));
      for (const w of done.slice(0, S.workloads.size - KEEP_WORKLOADS)) {
        S.workloads.delete(w.id);
        S.loss.delete(w.id);
        S.wlTele.delete(w.id);
      }
    }
    for (const wid of S.loss.keys()) if (!S.workloads.has(wid) && S.loss.size > 64) S.loss.delete(wid);
    if (S.related.size > 20000) S.related.clear();
  }

  async function refreshSnapshot() {
    prune();
    try {
      const snap = await api("cluster");
      S.snapshot = snap;
      S.snapshotAt = performance.now();
      for (const w of snap.workloads) upsertWorkload(w);
      mark("map", "deadlines", "kpis", "telemetry");
    } catch (_) { /* shown by the connection badge */ }
  }
  async function loadHistory() {
    const [wl, audit, recent, traces] = await Promise.all([
      api("workloads?limit=200"),
      api("audit?limit=200"),
      api("streams/recent?topics=telemetry,state&limit=1500"),
      api("reasoning?limit=100"),
    ]);
    for (const w of wl.items) upsertWorkload(w);
    for (const ev of traces.items) onReasoning(ev);
    for (const a of audit.items) {
      const ids = auditWorkloads(a);
      for (const w of ids) relate(a.correlation_id, w);
      if (ids.length > 1) for (const w of ids) for (const o of ids) relate(w, o);
    }
    S.audit = audit.items.slice().reverse();
    for (const ev of recent.items) {
      if (ev.topic === "telemetry") onTelemetry(ev);
      else if (ev.topic === "state") onState(ev, true);
    }
    if (S.lastEventId === null) S.lastEventId = String(recent.last_id);
    mark("workloads", "audit", "reasoning", "telemetry");
  }

  function toast(msg, isError) {
    const t = $("toast");
    t.textContent = msg;
    t.className = `toast${isError ? " error" : ""}`;
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { t.textContent = ""; }, 8000);
  }
  for (const b of document.querySelectorAll("button.scenario")) {
    b.addEventListener("click", async () => {
      b.disabled = true;
      try {
        const r = await api(`scenarios/${encodeURIComponent(b.dataset.scenario)}`, {
          method: "POST", headers: { "Content-Type": "application/json" }, body: "{}",
        });
        toast(r.message);
        if (r.workloads && r.workloads[0]) for (const w of r.workloads) relate(r.correlation_id, w);
        await refreshSnapshot();
        // the story's first workload (the urgent job, the lost node's work, the diverging run)
        if (r.workloads && r.workloads[0]) setFilter(r.workloads[0]);
        document.body.dataset.scenario = b.dataset.scenario;
      } catch (e) {
        toast(`${b.dataset.scenario}: ${e.message}`, true);
      } finally {
        b.disabled = false;
      }
    });
  }

  async function agentStatus() {
    try {
      const a = await api("agent");
      const before = S.approvals.length;
      const approving = a.present && a.mode === "approve";
      S.approvals = approving && a.pending_approvals ? (await api("agent/approvals")).items : [];
      if (before || S.approvals.length) mark("reasoning");
      $("agent-status").textContent = a.present
        ? `agent: ${a.mode} · ${a.reasoner || ""}${approving && a.pending_approvals ? ` · ${a.pending_approvals} awaiting approval` : ""}`
        : "agent: not running";
    } catch (_) { /* ignore */ }
  }

  // ---------------------------------------------------------------- loop
  let lastRender = 0;
  function frame(ts) {
    if (ts - lastRender > 250) {
      lastRender = ts;
      const d = S.dirty;
      S.dirty = new Set();
      if (d.has("kpis")) renderKpis();
      if (d.has("map")) renderMap();
      if (d.has("telemetry")) renderTelemetry();
      if (d.has("workloads")) renderWorkloads();
      if (d.has("reasoning")) renderReasoning();
      if (d.has("audit")) renderAudit();
      if (d.has("history")) renderHistory();
      renderDeadlines();
      $("clock").textContent = `engine ${fmtTime(nowEngine())}`;
    }
    requestAnimationFrame(frame);
  }

  let started = false;
  async function start() {
    if (!S.token) { askToken(""); return; }
    try {
      const me = await api("whoami");
      S.role = me.role;
      $("who").textContent = `${me.name} · ${me.role}`;
      const dlg = $("login");
      if (dlg.open) dlg.close();
    } catch (e) {
      return;
    }
    for (const b of document.querySelectorAll("button.scenario")) b.hidden = S.role === "viewer" || S.role === "submitter";
    if (started) return;
    started = true;
    await refreshSnapshot();
    try { await loadHistory(); } catch (e) { toast(e.message, true); }
    stream();
    checkChain();
    agentStatus();
    setInterval(refreshSnapshot, 2000);
    setInterval(checkChain, 10000);
    setInterval(agentStatus, 5000);
    loadClusterHistory();
    setInterval(loadClusterHistory, 10000);
    window.addEventListener("resize", () => mark("history"));
    requestAnimationFrame(frame);
  }

  loadToken();
  const fromUrl = new URLSearchParams(location.search).get("filter");
  if (fromUrl) setFilter(fromUrl);
  start();
})();
