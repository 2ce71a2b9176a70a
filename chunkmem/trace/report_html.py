"""The report page: one HTML file with its data and script inline, so it opens offline anywhere.

Drawn with plain SVG from a small inline script (no libraries, nothing fetched): stacked memory
by category over moments for device and host side by side, the device budget and the
`chunkmem.annotate` spans over them, a hover read-out of every category at
a moment, legend entries that hide a category, a step-range filter (all / warm-up / steady state),
chunk placement lanes with the copies on them, the warm-up vs steady-state table, and predicted vs
actual when the trace directory holds a plan.
"""

from __future__ import annotations

import html
import json
from typing import Any

from chunkmem.trace.report_files import COLORS

_STYLE = """
body{font:13px system-ui,sans-serif;margin:16px;color:#222;max-width:1500px}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
.row{display:flex;gap:16px;flex-wrap:wrap} .panel{flex:1;min-width:560px}
svg{background:#fff;border:1px solid #ddd} .muted{color:#777}
table{border-collapse:collapse} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.legend span{display:inline-block;margin-right:10px;cursor:pointer;user-select:none}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
.off{opacity:.35} #tip{position:fixed;pointer-events:none;background:#fffe;border:1px solid #aaa;
padding:6px;font-size:12px;display:none;white-space:pre}
"""

_SCRIPT = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const C = JSON.parse(document.getElementById('colors').textContent);
const R = D.ranks[Number(document.getElementById('rank').value || 0)] || D.ranks[0];
const hidden = new Set();
const MiB = v => (v / 1048576).toFixed(v < 10485760 ? 2 : 1) + ' MiB';
const NS = 'http://www.w3.org/2000/svg';
function el(tag, attrs, parent) { const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
function range() { const f = document.getElementById('filter').value; const xs = [];
  R.moments.forEach((m, x) => { if (f === 'all' || (f === 'warm' ? m.warmup : !m.warmup)) xs.push(x); });
  return xs; }
function chart(id, side) {
  const svg = document.getElementById(id); svg.innerHTML = ''; const W = 700, H = 300, L = 60, B = 24;
  const xs = range(); if (!xs.length) return; const keys = D.stacked.filter(k => !hidden.has(k) &&
    R.series[side][k].some(v => v > 0));
  const tops = xs.map(x => keys.reduce((s, k) => s + R.series[side][k][x], 0));
  let ymax = Math.max(1, ...tops); if (side === 'host') ymax = Math.max(ymax, ...xs.map(x => R.series.host.rss[x]));
  const limit = side === 'device' ? R.device_limit : null; if (limit) ymax = Math.max(ymax, limit * 1.04);
  const sx = i => L + (W - L - 8) * i / Math.max(1, xs.length - 1), sy = v => H - B - (H - B - 8) * v / ymax;
  let base = xs.map(() => 0);
  for (const k of keys) { const top = base.map((b, i) => b + R.series[side][k][xs[i]]);
    let d = 'M' + top.map((v, i) => sx(i) + ',' + sy(v)).join('L');
    d += 'L' + base.map((v, i) => sx(i) + ',' + sy(v)).reverse().join('L') + 'Z';
    el('path', {d, fill: C[k] || '#999', stroke: 'none'}, svg); base = top; }
  if (side === 'host') el('path', {d: 'M' + xs.map((x, i) => sx(i) + ',' + sy(R.series.host.rss[x])).join('L'),
    fill: 'none', stroke: '#222', 'stroke-width': 1}, svg);
  let prev = null; xs.forEach((x, i) => { const m = R.moments[x]; if (m.step !== prev) {
    el('line', {x1: sx(i), x2: sx(i), y1: 8, y2: H - B, stroke: m.warmup ? '#e8a' : '#ccc'}, svg);
    const t = el('text', {x: sx(i) + 2, y: H - 8, 'font-size': 10, fill: '#666'}, svg);
    const gap = prev !== null && m.step > prev + 1 ? `(s${prev + 1}-${m.step - 1} not kept) ` : '';
    t.textContent = gap + 's' + m.step; }
    prev = m.step; });
  if (limit) { el('line', {x1: L, x2: W, y1: sy(limit), y2: sy(limit), stroke: '#000', 'stroke-dasharray': '6,3'}, svg);
    const t = el('text', {x: L + 4, y: sy(limit) + 12, 'font-size': 10}, svg);
    t.textContent = 'device budget ' + MiB(limit); }
  R.spans.forEach((sp, j) => { const a = xs.indexOf(sp.x0), b = xs.indexOf(sp.x1); if (a < 0 || b < 0) return;
    el('rect', {x: sx(a), y: 8, width: Math.max(1, sx(b) - sx(a)), height: H - B - 8, fill: '#0000000d',
      stroke: '#555', 'stroke-dasharray': '3,3'}, svg);
    const right = sx(a) > W - 90;  // near the right edge: the label goes to the left of its box
    const t = el('text', {x: right ? sx(a) - 2 : sx(a) + 2, y: 18 + 11 * (j % 3), 'font-size': 10,
      'text-anchor': right ? 'end' : 'start'}, svg); t.textContent = sp.name; });
  for (let k = 0; k <= 4; k++) { const v = ymax * k / 4; const t = el('text', {x: 2, y: sy(v) + 4, 'font-size': 10,
    fill: '#666'}, svg); t.textContent = MiB(v); el('line', {x1: L, x2: W, y1: sy(v), y2: sy(v), stroke: '#eee'}, svg); }
  const cursor = el('line', {y1: 8, y2: H - B, stroke: '#000', visibility: 'hidden'}, svg);
  svg.onmousemove = ev => { const r = svg.getBoundingClientRect(); const px = (ev.clientX - r.left) * W / r.width;
    const i = Math.max(0, Math.min(xs.length - 1, Math.round((px - L) / (W - L - 8) * (xs.length - 1))));
    const x = xs[i], m = R.moments[x]; cursor.setAttribute('x1', sx(i)); cursor.setAttribute('x2', sx(i));
    cursor.setAttribute('visibility', 'visible');
    const lines = [`step ${m.step} #${m.i} ${m.name} (${m.stage}) ${m.where}${m.warmup ? ' [warm-up]' : ''}`];
    for (const k of Object.keys(R.series[side])) if (R.series[side][k][x]) lines.push(`${side}.${k}: ${MiB(R.series[side][k][x])}`);
    const tip = document.getElementById('tip'); tip.textContent = lines.join('\n'); tip.style.display = 'block';
    tip.style.left = (ev.clientX + 14) + 'px'; tip.style.top = (ev.clientY + 10) + 'px'; };
  svg.onmouseleave = () => { document.getElementById('tip').style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); };
}
function lanes() {
  const svg = document.getElementById('lanes'); svg.innerHTML = ''; const xs = range(); const lanes = R.lanes;
  if (!lanes.length || !xs.length) { svg.setAttribute('height', 30); svg.setAttribute('viewBox', '0 0 1420 30');
    el('text', {x: 8, y: 20}, svg).textContent =
    'no chunk lanes: observer mode (plain model) has no chunks'; return; }
  const W = 1420, L = 130, h = 12, first = xs[0], last = xs[xs.length - 1];
  svg.setAttribute('height', lanes.length * h + 30); svg.setAttribute('viewBox', `0 0 ${W} ${lanes.length * h + 30}`);
  const sx = x => L + (W - L - 8) * (x - first) / Math.max(1, last - first);
  lanes.forEach((lane, j) => { const y = 8 + j * h; const t = el('text', {x: 2, y: y + 9, 'font-size': 10}, svg);
    t.textContent = lane.chunk; el('line', {x1: L, x2: W, y1: y + h / 2, y2: y + h / 2, stroke: '#f0f0f0'}, svg);
    const kind = lane.kind;
    for (const [a, b] of lane.spans) { if (b < first || a > last) continue;
      el('rect', {x: sx(Math.max(a, first)), y: y + 2, width: Math.max(1, sx(Math.min(b, last)) - sx(Math.max(a, first))),
        height: h - 4, fill: C[kind] || '#999'}, svg); } });
  const row = Object.fromEntries(lanes.map((l, j) => [l.chunk, j]));
  const RC = {'on-demand': '#d62728', prefetch: '#2ca02c', evict: '#111', optimizer: '#9467bd'};
  for (const mv of R.moves) { if (mv.x < first || mv.x > last || !(mv.chunk in row)) continue;
    const y = 8 + row[mv.chunk] * h; const c = el('rect', {x: sx(mv.x) - 1, y: y, width: 2, height: h,
      fill: RC[mv.reason] || '#000'}, svg);
    el('title', {}, c).textContent = `${mv.reason} ${mv.chunk} ${mv.src}->${mv.dst} ${MiB(mv.bytes)} in ${(mv.seconds * 1e3).toFixed(3)} ms`; }
}
function legend() { const box = document.getElementById('legend'); box.innerHTML = '';
  for (const k of D.stacked) { const s = document.createElement('span'); s.innerHTML = `<i style="background:${C[k]}"></i>${k}`;
    if (hidden.has(k)) s.className = 'off'; s.onclick = () => { hidden.has(k) ? hidden.delete(k) : hidden.add(k); draw(); };
    box.appendChild(s); } }
function draw() { legend(); chart('device', 'device'); chart('host', 'host'); lanes(); }
document.getElementById('filter').onchange = draw; draw();
"""


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, (int, float)) and abs(value) >= 1024:
        return f"{value / 2**20:,.2f} MiB"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _plan_line(plan: dict[str, Any]) -> str:
    verdict, binding = html.escape(str(plan.get("verdict"))), html.escape(str(plan.get("binding")))
    return (f"<p>plan.json: <b>{verdict}</b> (binding: {binding}); difference = actual / predicted - 1. "
            f"A device budget that differs from the plan's makes the other rows incomparable.</p>")


def render(data: dict[str, Any], title: str) -> str:
    rank = data["ranks"][0]
    phases = [{"phase": k, **v} for k, v in rank["phases"].items()]
    disk = ["disk_read_per_step", "disk_write_per_step", "disk_peak"] if any(p["disk_peak"] for p in phases) else []
    phase_table = _table(phases, ["phase", "steps", "device_peak", "h2d_per_step", "d2h_per_step", *disk,
                                  "seconds_per_step"])
    compare = (_plan_line(data["plan"]) + _table(data["compare"], ["what", "predicted", "actual", "difference"])
               if data["compare"]
               else "<p class=muted>No plan.json in the trace directory: run <code>chunkmem plan ... --json "
                    "&gt; TRACE_DIR/plan.json</code> to compare the estimate with this run.</p>")
    gaps = "".join(f"<p class=muted>Steps {g['first']}-{g['last']} ({g['steps']} steps) were recorded as summaries "
                   f"only (retention policy).</p>" for g in rank["gaps"])
    meta = data["meta"]
    options = "".join(f"<option value={i}>rank {r['rank']}</option>" for i, r in enumerate(data["ranks"]))
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style></head><body>
<h1>chunkmem memory trace — {html.escape(str(meta.get('model', '')))}</h1>
<div class=muted>{html.escape(str(rank['device']))} {'(CPU simulation of a device)' if rank['simulated'] else ''} ·
source: {html.escape(str(rank['source']))} · {len(rank['moments'])} moments kept · torch {html.escape(str(meta.get('torch', '')))}
· chunkmem {html.escape(str(meta.get('chunkmem', '')))} · config {html.escape(json.dumps(meta.get('config', {})))}</div>
<p>Show <select id=filter><option value=all>all kept steps</option><option value=warm>warm-up steps</option>
<option value=steady>steady-state steps</option></select> rank <select id=rank onchange="location.reload()">{options}</select>
· hover a chart for the numbers at a moment; click a legend entry to hide it.</p>
<div id=legend class=legend></div>
<div class=row><div class=panel><h2>Device (dashed line: the budget; boxes: annotations)</h2><svg id=device viewBox="0 0 700 300" width=100%></svg></div>
<div class=panel><h2>Host (black line: process RSS)</h2><svg id=host viewBox="0 0 700 300" width=100%></svg></div></div>
{gaps}
<h2>Chunk placement (bars: on the device; ticks: copies — red on-demand, green prefetch, black evict, purple optimizer)</h2>
<svg id=lanes viewBox="0 0 1420 400" width=100% preserveAspectRatio="xMinYMin meet"></svg>
<div class=row><div class=panel><h2>Warm-up vs steady state</h2>{phase_table}</div>
<div class=panel><h2>Predicted vs actual</h2>{compare}</div></div>
<div id=tip></div>
<script type="application/json" id=data>{payload}</script>
<script type="application/json" id=colors>{json.dumps(COLORS)}</script>
<script>{_SCRIPT}</script></body></html>"""
