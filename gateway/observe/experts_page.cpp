#include "gateway/observe/experts_page.h"

namespace moe::gw {

const char* experts_page_html() {
  return R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>moe-gateway: experts</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:16px;margin:0 0 8px} h2{font-size:14px;margin:16px 0 4px}
.figs span{margin-right:18px} .figs b{font-variant-numeric:tabular-nums}
.map{display:grid;gap:1px;background:#ddd;padding:1px;width:max-content;--cell:7px}
.map i{display:block;width:var(--cell);height:var(--cell);background:#fff;box-sizing:border-box}
.map b{font:10px sans-serif;color:#666;background:#fafafa;padding-right:4px;text-align:right;line-height:var(--cell)}
.map i.r{background:#9ecae1} .map i.r.h{box-shadow:inset 0 -3px 0 #3182bd}
.map i.p{outline:1px solid #31a354;outline-offset:-1px}
.map i.m{border:2px solid #d62728}
.legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px;vertical-align:middle;box-sizing:border-box}
canvas{background:#fff;border:1px solid #ddd;margin-right:12px}
#status{color:#888}
</style></head><body>
<h1>Experts, live</h1>
<p>Rows are MoE layers (the model's layer index), columns experts.</p>
<div id="status">waiting for the first figures…</div>
<div class="legend">
 <i style="background:#fff;border:1px solid #ccc"></i>not resident
 <i style="background:#9ecae1"></i>resident
 <i style="background:#e6550d"></i>hot (tokens a second, darker is more; a blue foot: resident too)
 <i style="outline:1px solid #31a354;outline-offset:-1px"></i>predicted
 <i style="border:2px solid #d62728"></i>missed in the last second
</div>
<div id="workers"></div>
<script>
"use strict";
const workers = [];  // by position in the data
function el(tag, cls, parent) { const e = document.createElement(tag); if (cls) e.className = cls; if (parent) parent.appendChild(e); return e; }
function heat(v, max) {
  const t = Math.min(1, Math.log1p(v) / Math.log1p(Math.max(max, 1)));
  const c = [[158, 202, 225], [253, 174, 107], [230, 85, 13], [127, 39, 4]];
  const x = t * (c.length - 1), i = Math.min(c.length - 2, Math.floor(x)), f = x - i;
  return "rgb(" + c[i].map((a, j) => Math.round(a + (c[i + 1][j] - a) * f)).join(",") + ")";
}
function chart(cv, pts, label, fmt) {
  const g = cv.getContext("2d"), W = cv.width, H = cv.height;
  g.clearRect(0, 0, W, H);
  const v = pts.filter(p => p != null), max = Math.max(1e-9, ...v);
  g.fillStyle = "#222"; g.font = "11px sans-serif";
  g.fillText(label + (v.length ? ": " + fmt(v[v.length - 1]) : ""), 4, 12);
  g.strokeStyle = "#3182bd"; g.beginPath();
  pts.forEach((p, i) => { if (p == null) return; const x = W * i / Math.max(1, pts.length - 1), y = H - 4 - (H - 20) * p / max; i ? g.lineTo(x, y) : g.moveTo(x, y); });
  g.stroke();
}
function draw(w, index) {
  let k = workers[index];
  const L = w.moe_layers.length, E = w.n_experts;
  if (!k || k.cells.length !== L * E || k.name !== w.name) {
    if (k) k.box.remove();
    const box = el("section", "worker", document.getElementById("workers"));
    box.dataset.worker = w.name;
    el("h2", "", box).textContent = "worker " + w.name;
    const figs = el("div", "figs", box);
    const charts = el("div", "", box);
    const hit = el("canvas", "", charts), bpt = el("canvas", "", charts);
    hit.width = bpt.width = 360; hit.height = bpt.height = 90;
    const map = el("div", "map", box);
    const cell = E <= 64 ? 14 : 7;
    map.style.setProperty("--cell", cell + "px");
    map.style.gridTemplateColumns = "3em repeat(" + E + ", " + cell + "px)";
    const cells = [];
    for (let i = 0; i < L * E; ++i) {
      if (i % E === 0) el("b", "", map).textContent = w.moe_layers[i / E];
      const c = el("i", "", map);
      c.title = "layer " + w.moe_layers[Math.floor(i / E)] + ", expert " + (i % E);
      cells.push(c);
    }
    k = workers[index] = {name: w.name, box, figs, hit, bpt, map, cells};
  }
  const maxHot = Math.max(0, ...w.hot);
  let counts = {r: 0, h: 0, p: 0, m: 0};
  for (let i = 0; i < L * E; ++i) {
    const r = w.resident[i] === "1", p = w.predicted[i] === "1", m = w.missed[i] > 0, h = w.hot[i] > 0;
    const cls = (r ? "r " : "") + (p ? "p " : "") + (m ? "m " : "") + (h ? "h" : "");
    const c = k.cells[i];
    if (c.className !== cls.trim()) c.className = cls.trim();
    c.style.background = h ? heat(w.hot[i], maxHot) : "";
    counts.r += r; counts.h += h; counts.p += p; counts.m += m;
  }
  const last = w.series.length ? w.series[w.series.length - 1] : {};
  k.figs.innerHTML = "<span>islands <b>" + w.islands_used + " / " + w.islands_total + "</b></span>" +
    "<span>resident <b>" + counts.r + "</b></span><span>hot <b>" + counts.h + "</b></span>" +
    "<span>predicted <b>" + counts.p + "</b></span><span>missed <b>" + counts.m + "</b></span>" +
    "<span>hit rate <b>" + (last.hit_rate == null ? "–" : (100 * last.hit_rate).toFixed(1) + " %") + "</b></span>" +
    "<span>expert bytes a token <b>" + (last.bytes_per_token == null ? "–" : Math.round(last.bytes_per_token).toLocaleString()) + "</b></span>" +
    "<span>tokens/s <b>" + (last.tokens_per_s == null ? "–" : last.tokens_per_s) + "</b></span>";
  k.box.dataset.hot = counts.h; k.box.dataset.resident = counts.r; k.box.dataset.missed = counts.m;
  chart(k.hit, w.series.map(s => s.hit_rate), "hit rate", v => (100 * v).toFixed(1) + " %");
  chart(k.bpt, w.series.map(s => s.bytes_per_token), "expert bytes a token", v => Math.round(v).toLocaleString());
}
async function tick() {
  try {
    // Same origin, without any credentials of the address: the browser's login goes with it.
    const r = await fetch(location.origin + "/experts.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json();
    d.workers.forEach(draw);
    // Workers gone from the data (down) leave the page.
    while (workers.length > d.workers.length) workers.pop().box.remove();
    const s = document.getElementById("status");
    s.textContent = "updated " + new Date().toLocaleTimeString() + (d.workers.length ? "" : " (no worker yet)");
    s.dataset.updates = String(Number(s.dataset.updates || 0) + 1);
  } catch (e) {
    document.getElementById("status").textContent = "cannot read experts.json: " + e.message;
  }
}
tick();
setInterval(tick, 1000);
</script></body></html>
)HTML";
}

}  // namespace moe::gw
