// cogattn view: the page. Every number comes from the server (cogattn.analysis, in Python) or, in an
// export, from the same answers embedded in the file; this script only lays them out and colours them.
"use strict";

const EMBEDDED = window.COGATTN_EMBEDDED || null;
const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
let run = params.get("run");
let S = null; // the run's summary
let steps = []; // the steps the slider walks
let sliderKind = null; // the kind whose steps and layers the slider and the layer list walk
let point = null; // the clicked video point [frame, row, col]

async function api(path, query = {}) {
  if (EMBEDDED) return embedded(path, query);
  const response = await fetch(path.slice(1) + "?" + new URLSearchParams(query)); // relative: works under a proxy's prefix
  return response.json();
}

// The (row, column) of a rows × cols grid drawn on canvas under the pointer event e, from where the canvas is
// on screen, clamped to the grid.
function cellUnder(canvas, e, rows, cols) {
  const at = canvas.getBoundingClientRect();
  const r = Math.floor(((e.clientY - at.top) / at.height) * rows);
  const c = Math.floor(((e.clientX - at.left) / at.width) * cols);
  return [Math.max(0, Math.min(r, rows - 1)), Math.max(0, Math.min(c, cols - 1))];
}

function embedded(path, q) {
  if (path === "/api/runs") return EMBEDDED.runs;
  if (path === "/api/summary") return EMBEDDED.summaries[q.run] || { error: (EMBEDDED.runs.find((r) => r.name === q.run) || {}).error || "no such run" };
  if (path === "/api/point") return { hint: EMBEDDED.summaries[q.run].export.points }; // what the file does not keep: a hint
  if (path === "/api/block") return EMBEDDED.maps[[q.run, "block", q.step, q.layer, q.head, q.mask].join("|")] || { hint: "not in this export" };
  if (path === "/api/heads") return EMBEDDED.maps[[q.run, "heads", q.step, q.column].join("|")] || { hint: "not in this export" };
  if (path === "/api/track") return { hint: EMBEDDED.summaries[q.run].export.tracks };
  const sparse = { "/api/tile": "tile", "/api/density": "top_p", "/api/decay": "offset" }[path];
  if (sparse) {
    const key = [q.run, sparse, q.step, q.layer, q.head, ...(sparse === "tile" ? [q.pattern] : [])].join("|");
    return EMBEDDED.maps[key] || { hint: `not in this export (${EMBEDDED.summaries[q.run].export.sparse})` };
  }
  const key = [q.run, q.kind, q.step, q.layer, q.head, q.token ?? ""].join("|");
  const kept = EMBEDDED.summaries[q.run].export; // one sentence of what the file keeps, not its whole record
  const asked = `${q.kind}, layer ${q.layer}, head ${q.head}`;
  return EMBEDDED.maps[key] || { hint: `not in this export (${asked}): it keeps ${kept.layers}, ${kept.heads}; open the run with \`cogattn view\` for the rest.` };
}

function fileUrl(name, what) {
  if (EMBEDDED) return EMBEDDED.files[`${name}/${what}`] || null;
  return `file/${escaped(name)}/${what}`;
}

// A run's name in a URL. The server names every run with valid text; a lone surrogate here would make
// encodeURIComponent throw and stop the table (the runs after it unlisted), so one is written as U+FFFD.
function escaped(name) {
  try {
    return encodeURIComponent(String(name));
  } catch (err) { // a lone surrogate (no lookbehind in the pattern: Safari before 16.4 would refuse the file)
    return encodeURIComponent(String(name).replace(/[\uD800-\uDFFF]/g, "\uFFFD"));
  }
}

// -- colours: the plots' colormap, sent by the server ----------------------------------------------------
function limits(values, log) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) {
    if (v === null || (log && v <= 0)) continue;
    lo = Math.min(lo, v);
    hi = Math.max(hi, v);
  }
  if (!isFinite(lo)) return log ? [1e-12, 1] : [0, 1];
  return hi > lo ? [lo, hi] : [lo, lo + 1e-12];
}

function paint(canvas, values, rows, cols, range, log, cell) {
  canvas.width = cols * cell;
  canvas.height = rows * cell;
  const ctx = canvas.getContext("2d");
  const cmap = S.colormap;
  const [lo, hi] = log ? range.map(Math.log) : range;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = values[r * cols + c];
      if (v === null) {
        ctx.fillStyle = "#fff";
      } else {
        const x = log ? Math.log(Math.max(v, range[0])) : v;
        const i = Math.max(0, Math.min(cmap.length - 1, Math.round(((x - lo) / (hi - lo)) * (cmap.length - 1))));
        ctx.fillStyle = `rgb(${cmap[i].join(",")})`;
      }
      ctx.fillRect(c * cell, r * cell, cell, cell);
    }
  }
}

// -- colour bars: the colormap with tick values and what a value is ---------------------------------------
// The head atlas's colourings: columns of cogattn.analysis.head_stats.head_table, each a mean over the video queries.
const HEAD_UNITS = {
  same_frame_mass: "attention mass on the query's own latent frame (mean over video queries)",
  text_mass: "attention mass on the text keys (mean over video queries)",
  entropy_mean: "entropy (nats, mean over video queries)",
  sink_share: "share of all received mass on the sink tokens",
};
// The audio stream's kinds (LTX-2): what their rows and columns are, as the kinds' docs name them.
const AUDIO_AXES = {
  audio: ["audio query bin", "audio key bin"],
  audio_to_text: ["text token", "audio query bin"],
  frame_audio: ["latent frame (its video queries averaged)", "audio key bin"],
  audio_frame: ["audio query bin", "latent frame (its video keys summed)"],
};
const unitOf = (kind) => (S.units || {})[kind] || ""; // the reducers' `unit`, as on the plots' colour bars

// A number as the page writes it: `digits` significant digits, exponent form outside [0.001, 10000).
function fmt(v, digits) {
  const a = Math.abs(v);
  if (a === 0 || (a >= 1e-3 && a < 1e4)) return String(Number(v.toPrecision(digits)));
  return v.toExponential(digits - 1).replace(/\.?0+e/, "e");
}

// Where a value sits along a bar of `range` (0 at its low end, 1 at its high end).
function along(v, range, log) {
  const [lo, hi] = log ? range.map(Math.log) : range;
  return ((log ? Math.log(v) : v) - lo) / (hi - lo);
}

// The bar's ticks on a bar `width` pixels wide: its ends (the panel's limits, written to 4 digits) and round
// values between (3 digits), 1-2-5 steps on a linear scale, powers of ten on a log one (with their 2× and 5×
// where fewer than two powers fall inside), each kept only where its label clears the labels beside it.
// Returns [value, label] pairs, lowest first.
const TICK_CHAR = 6.5; // px a character of an 11px tick label takes, about
function ticks(range, log, width) {
  const [lo, hi] = range;
  let inner = [];
  if (log) {
    for (const mantissas of [[1], [1, 2, 5]]) {
      inner = [];
      for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
        for (const m of mantissas) inner.push(Number((m * 10 ** e).toPrecision(12)));
      }
      inner = inner.filter((v) => v > lo && v < hi);
      if (inner.length >= 2) break;
    }
  } else {
    const raw = (hi - lo) / Math.max(2, Math.floor(width / 70));
    const power = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
    for (let i = Math.ceil(lo / step); i * step < hi; i++) inner.push(Number((i * step).toPrecision(12)));
  }
  const x = (v) => width * along(v, range, log);
  const low = [lo, fmt(lo, 4)], high = [hi, fmt(hi, 4)];
  const gap = TICK_CHAR; // a character's space between two labels
  let right = low[1].length * TICK_CHAR + gap; // the low end's label is left-aligned at 0
  const limit = width - high[1].length * TICK_CHAR - gap; // the high end's is right-aligned at the bar's end
  const kept = [];
  for (const v of inner) {
    const label = fmt(v, 3);
    const half = (label.length * TICK_CHAR) / 2;
    if (x(v) - half >= right && x(v) + half <= limit) {
      kept.push([v, label]);
      right = x(v) + half + gap;
    }
  }
  return [low, ...kept, high];
}

// A colour bar `width` pixels wide: the colormap the maps are painted with, its ticks and the unit.
function colorBar(range, log, unit, width) {
  const bar = document.createElement("div");
  bar.className = "colorbar";
  bar.style.width = `${width}px`;
  bar.dataset.range = JSON.stringify(range);
  bar.dataset.scale = log ? "log" : "linear";
  // a gradient through every colour of the map, not a canvas: a panel's canvases are its maps alone; on a log
  // scale the colours step evenly in log(value), as `paint` steps them
  const strip = document.createElement("div");
  strip.className = "strip";
  const last = S.colormap.length - 1;
  const stops = S.colormap.map((rgb, i) => `rgb(${rgb.join(",")}) ${((100 * i) / last).toFixed(2)}%`);
  strip.style.background = `linear-gradient(to right, ${stops.join(", ")})`;
  const marks = document.createElement("div");
  marks.className = "ticks";
  const values = ticks(range, log, width);
  values.forEach(([v, text], i) => {
    const tick = document.createElement("span");
    tick.className = i === 0 ? "tick low" : i === values.length - 1 ? "tick high" : "tick";
    tick.dataset.value = String(v);
    tick.style.left = `${100 * along(v, range, log)}%`;
    tick.textContent = text;
    marks.append(tick);
  });
  const label = document.createElement("div");
  label.className = "unit";
  label.textContent = unit + (log ? " · log scale" : "");
  bar.append(strip, marks, label);
  return bar;
}

// One map: a single 2-D panel, or one panel per latent frame of a (F, h, w) map over the video. `opts.unit`
// labels its colour bar, `opts.where(frame, row, col)` names a cell in the line under the panel that shows the
// value under the pointer.
function draw(target, payload, opts = {}) {
  const box = $(target);
  const readout = box.parentElement.querySelector(".readout");
  box.replaceChildren();
  readout.textContent = "";
  const drawn = tell(box, payload);
  box.dataset.values = drawn ? JSON.stringify(payload.values) : "";
  box.dataset.shape = drawn ? JSON.stringify(payload.shape) : "";
  if (!drawn) return;
  const log = $("scale").value === "log";
  const shape = payload.shape;
  const panels = shape.length === 3 ? shape[0] : 1;
  const [rows, cols] = shape.slice(-2);
  const size = rows * cols;
  const shared = limits(payload.values, log);
  const oneBar = $("limits").value === "shared" || panels === 1;
  const cell = Math.max(4, Math.min(28, Math.floor(240 / Math.max(rows, cols))));
  const where = opts.where || ((f, r, c) => `row ${r}, column ${c}`);
  const figures = document.createElement("div");
  figures.className = "figures";
  box.append(figures);
  for (let f = 0; f < panels; f++) {
    const values = payload.values.slice(f * size, (f + 1) * size);
    const range = oneBar ? shared : limits(values, log);
    const figure = document.createElement("figure");
    const canvas = document.createElement("canvas");
    canvas.dataset.frame = f;
    paint(canvas, values, rows, cols, range, log, cell);
    const cellAt = (e) => cellUnder(canvas, e, rows, cols);
    canvas.addEventListener("mousemove", (e) => {
      const [r, c] = cellAt(e);
      const v = values[r * cols + c];
      readout.textContent = `${where(f, r, c)}: ${v === null ? "not recorded" : fmt(v, 6)}`;
      readout.dataset.cell = JSON.stringify([f, r, c]);
      readout.dataset.value = v === null ? "" : String(v);
    });
    canvas.addEventListener("mouseleave", () => (readout.textContent = ""));
    if (opts.onClick) canvas.addEventListener("click", (e) => opts.onClick(f, ...cellAt(e)));
    const caption = document.createElement("figcaption");
    caption.textContent = opts.captions ? opts.captions[f] : `${range[0].toPrecision(3)} – ${range[1].toPrecision(3)}`;
    figure.append(canvas, caption);
    if (!oneBar) figure.append(colorBar(range, log, opts.unit || "", Math.max(canvas.width, 120)));
    figures.append(figure);
  }
  const wide = panels * (cols * cell + 4); // under the row of maps it serves, as wide as that row where it can be
  if (oneBar) box.append(colorBar(shared, log, opts.unit || "", Math.max(220, Math.min(wide, 360))));
  box.classList.toggle("clickable", Boolean(opts.onClick));
}

// -- the viewer --------------------------------------------------------------------------------------------
// The controls the page's address keeps, so a link opens the same view (`?run=…&step=…&point=f,r,c`).
const KEPT = ["item", "step", "layer", "head", "scale", "limits", "word-kind", "token", "stat-kind", "audio-kind", "head-column", "mask", "pattern"];

function restore() {
  for (const id of KEPT) {
    const v = params.get(id);
    if (v === null) continue;
    if (id === "step") {
      const i = steps.indexOf(Number(v));
      if (i >= 0) $("step").value = String(i);
    } else if ([...$(id).options].some((o) => o.value === v)) {
      $(id).value = v;
    }
  }
  const p = (params.get("point") || "").split(",").map(Number);
  if (p.length === 3 && p.every(Number.isInteger)) point = p;
}

function remember() {
  if (EMBEDDED) return; // a file: its address is the file's
  const q = new URLSearchParams({ run });
  for (const id of KEPT) q.set(id, id === "step" ? String(steps[Number($("step").value)]) : $(id).value);
  if (point) q.set("point", point.join(","));
  history.replaceState(null, "", "?" + q);
}

function selection() {
  return { run, item: $("item").value, step: steps[Number($("step").value)], layer: $("layer").value, head: $("head").value };
}

// Under the step slider, a mark per step where a cache skipped layers (darker: more of them).
function drawGaps(gaps, layerCount) {
  const strip = $("step-gaps");
  strip.replaceChildren();
  strip.dataset.gaps = JSON.stringify(steps.map((s) => (gaps[s] || []).length));
  strip.hidden = !Object.keys(gaps).length;
  steps.forEach((s, i) => {
    const mark = document.createElement("span");
    const skipped = gaps[s] || [];
    mark.style.left = `${steps.length > 1 ? (100 * i) / (steps.length - 1) : 50}%`; // under the thumb at step i
    mark.style.width = `max(4px, ${100 / steps.length}%)`;
    if (skipped.length) {
      mark.className = "gap";
      mark.style.opacity = String(0.25 + (0.75 * skipped.length) / Math.max(1, layerCount));
      mark.title = `step ${s}: ${S.skipped.by || "a cache"} skipped layer(s) ${skipped.join(", ")}`;
    }
    strip.append(mark);
  });
}

async function redraw() {
  const sel = selection();
  const t = S.timesteps[sel.step];
  const skipped = ((S.gaps && S.gaps[sliderKind]) || {})[sel.step] || [];
  $("step-label").textContent =
    `${sel.step}` +
    (t === undefined || t === null ? "" : ` (t=${Number(t).toPrecision(4)})`) +
    (skipped.length ? ` · ${skipped.length} layer(s) skipped by ${S.skipped.by || "a cache"}: no map, left out of the mean` : "");
  const jobs = [];
  if (S.kinds.includes("frame")) {
    const captions = [`groups: ${S.groups.join(" · ")}`];
    const where = (f, r, c) => `query group ${S.groups[r] ?? r}, key group ${S.groups[c] ?? c}`;
    jobs.push(api("/api/map", { ...sel, kind: "frame" }).then((p) => draw("frame", p, { captions, unit: unitOf("frame"), where })));
  } else {
    draw("frame", { hint: "To see how each latent frame attends to the others, record kind 'frame'." });
  }
  const wordKind = $("word-kind").value;
  if (wordKind) {
    const q = { ...sel, kind: wordKind, token: $("token").value };
    const captions = Array.from({ length: S.layout.frames }, (_, f) => `f${f}`);
    jobs.push(
      api("/api/map", q).then((p) => {
        draw("word", p, { captions, onClick: choosePoint, unit: unitOf(wordKind), where: onVideo });
        wordPayload = p;
        if (S.video_frames && !EMBEDDED) drawOverlay();
      }),
    );
  }
  $("word-panel").hidden = !wordKind;
  const statKind = $("stat-kind").value;
  $("stat-panel").hidden = !statKind;
  if (statKind) {
    const captions = Array.from({ length: S.layout.frames }, (_, f) => `f${f}`);
    const opts = { captions, onClick: choosePoint, unit: unitOf(statKind), where: onVideo };
    jobs.push(api("/api/map", { ...sel, kind: statKind }).then((p) => draw("stat", p, opts)));
  }
  const audioKind = $("audio-kind").value;
  $("audio-panel").hidden = !audioKind;
  if (audioKind) {
    const [rows, cols] = AUDIO_AXES[audioKind];
    $("audio-axes").textContent = `(rows: ${rows}, columns: ${cols})`;
    const bin = (i) => {
      const s = (S.audio_seconds || [])[i];
      return s ? `${i} (${s[0].toFixed(2)}–${s[1].toFixed(2)} s)` : `${i}`;
    };
    const name = (axis, i) => (axis.includes("audio") ? `${axis} ${bin(i)}` : axis.includes("text") ? `${axis} ${i}: ${S.tokens[i] ?? ""}` : `${axis.split(" (")[0]} ${i}`);
    const where = (f, r, c) => `${name(rows, r)}, ${name(cols, c)}`;
    jobs.push(api("/api/map", { ...sel, kind: audioKind }).then((p) => draw("audio", p, { unit: unitOf(audioKind), where })));
  }
  if (S.kinds.includes("block")) {
    $("block-panel").hidden = false;
    jobs.push(api("/api/block", { ...sel, mask: $("mask").value }).then(drawBlock));
  }
  if (S.head_atlas) {
    const q = { run, item: sel.item, step: sel.step, column: $("head-column").value };
    jobs.push(api("/api/heads", q).then(drawHeads));
  }
  if (S.kinds.includes("tile")) {
    $("tile-panel").hidden = false;
    jobs.push(api("/api/tile", { ...sel, pattern: $("pattern").value }).then(drawTile));
  }
  if (S.kinds.includes("top_p")) {
    $("density-panel").hidden = false;
    jobs.push(api("/api/density", sel).then(drawDensity));
  }
  if (S.kinds.includes("offset")) {
    $("decay-panel").hidden = false;
    jobs.push(api("/api/decay", sel).then(drawDecay));
  }
  if (point) jobs.push(drawPoint(), drawTrack());
  remember();
  await Promise.all(jobs);
  document.body.dataset.ready = String(Number(document.body.dataset.ready || 0) + 1);
}

// -- the word's map over the video: each pixel frame under its latent frame's map --------------------------
const frameImages = [];
let wordPayload = null;
let playing = null;

function loadFrame(i) {
  if (!frameImages[i]) {
    frameImages[i] = new Image();
    frameImages[i].src = fileUrl(run, `frame/${i}`);
  }
  return frameImages[i];
}

function drawOverlay() {
  const i = Number($("pixel-frame").value);
  const latent = S.latent_of_pixel[i];
  const canvas = $("overlay");
  canvas.dataset.pixel = String(i);
  canvas.dataset.latent = String(latent);
  $("pixel-label").textContent = `${i} (latent frame ${latent})`;
  const image = loadFrame(i);
  const paintAll = () => {
    canvas.width = image.naturalWidth * 3;
    canvas.height = image.naturalHeight * 3;
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, 0, 0, canvas.width, canvas.height);
    if (!wordPayload || wordPayload.error || latent < 0) return;
    const [, rows, cols] = wordPayload.shape;
    const values = wordPayload.values.slice(latent * rows * cols, (latent + 1) * rows * cols);
    const heat = document.createElement("canvas");
    paint(heat, values, rows, cols, limits(wordPayload.values, $("scale").value === "log"), $("scale").value === "log", 1);
    ctx.globalAlpha = 0.55;
    ctx.drawImage(heat, 0, 0, canvas.width, canvas.height);
    ctx.globalAlpha = 1;
  };
  if (image.complete && image.naturalWidth) paintAll();
  else image.onload = paintAll;
}

function togglePlay() {
  if (playing) {
    clearInterval(playing);
    playing = null;
    $("play").textContent = "play";
    return;
  }
  $("play").textContent = "pause";
  playing = setInterval(() => {
    $("pixel-frame").value = String((Number($("pixel-frame").value) + 1) % S.video_frames);
    drawOverlay();
  }, 125);
}

function drawBlock(payload) {
  const where = (f, r, c) => `query block ${r}, key block ${c}`;
  draw("block", payload, { captions: [`${S.selection.block_size || ""} tokens a block`], unit: unitOf("block"), where });
  $("recall").textContent = payload.recall === undefined ? "" : `recall ${payload.recall.toFixed(4)} of the attention mass`;
  $("block").dataset.recall = payload.recall === undefined ? "" : String(payload.recall);
  outline("block", payload);
}

// A mask's kept cells of a 2-D map, outlined on its canvas.
function outline(target, payload) {
  const canvas = $(target).querySelector("canvas");
  if (!canvas || !payload.mask) return;
  const [rows, cols] = payload.shape;
  const cell = canvas.width / cols;
  const ctx = canvas.getContext("2d");
  ctx.strokeStyle = "cyan";
  ctx.lineWidth = Math.max(1, cell / 8);
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) if (payload.mask[r * cols + c]) ctx.strokeRect(c * cell + 1, r * cell + 1, cell - 2, cell - 2);
  }
}

function drawHeads(payload) {
  $("heads-panel").hidden = false;
  const pick = (f, r, c) => {
    $("layer").value = String(payload.layers[r]);
    $("head").value = String(payload.heads[c]);
    redraw();
  };
  const where = (f, r, c) => {
    const label = payload.labels && payload.labels[r][c];
    return `layer ${payload.layers[r]}, head ${payload.heads[c]}` + (label ? ` (${label})` : "");
  };
  const unit = HEAD_UNITS[payload.column] || payload.column || "";
  draw("heads", payload, { captions: [payload.column || ""], onClick: payload.layers ? pick : null, unit, where });
}

// -- the sparse-attention panels: the tile map, top_p's density, offset's decay -----------------------------
function drawTile(payload) {
  const labels = payload.labels || [];
  const where = (f, r, c) => `query tile ${labels[r] ?? r}, key tile ${labels[c] ?? c}`;
  const shape = payload.tile_shape ? ` of ${payload.tile_shape.join(" × ")} (latent frames × patch rows × columns)` : "";
  draw("tile", payload, { captions: [`tiles${shape}; group 0: text`], unit: unitOf("tile"), where });
  const recall = payload.recall ?? null;
  $("tile-recall").textContent = recall === null ? "" : `recall ${fmt(recall, 4)} of the attention mass`;
  $("tile").dataset.recall = recall === null ? "" : String(recall);
  outline("tile", payload);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.append(e);
  return e;
}

// A line chart of `series` ([{x, y, cls}], `cls` "line" with its points marked, or "fit"), from 0 to the largest
// value on each axis, the ends labelled; a point's <title> holds its numbers.
function chart(series, xlabel, ylabel, digits = 4) {
  const W = 300, H = 190, L = 50, B = 36, T = 10, R = 14;
  const finite = (v) => v !== null && Number.isFinite(v);
  const xs = series.flatMap((s) => s.x).filter(finite);
  const ys = series.filter((s) => s.cls === "line").flatMap((s) => s.y).filter(finite);
  const x1 = Math.max(1e-12, ...xs), y1 = Math.max(1e-12, ...ys);
  const X = (x) => L + ((W - L - R) * x) / x1, Y = (y) => H - B - ((H - B - T) * Math.min(y, 1.2 * y1)) / y1;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }, root);
  svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }, root);
  const text = (x, y, s, anchor) => (svg("text", { x, y, "text-anchor": anchor }, root).textContent = s);
  text(L, H - B + 13, "0", "middle");
  text(W - R, H - B + 13, fmt(x1, 3), "end");
  text(L - 4, H - B, "0", "end");
  text(L - 4, T + 8, fmt(y1, 3), "end");
  text((L + W - R) / 2, H - 6, xlabel, "middle");
  svg("text", { x: 12, y: (T + H - B) / 2, transform: `rotate(-90 12 ${(T + H - B) / 2})`, "text-anchor": "middle" }, root).textContent = ylabel;
  for (const s of series) {
    const at = s.x.map((x, i) => [x, s.y[i]]).filter(([x, y]) => finite(x) && finite(y));
    svg("polyline", { class: s.cls, points: at.map(([x, y]) => `${X(x)},${Y(y)}`).join(" ") }, root);
    if (s.cls !== "line") continue;
    for (const [x, y] of at) {
      const dot = svg("circle", { cx: X(x), cy: Y(y), r: 2.5, "data-x": x, "data-y": y }, root);
      svg("title", {}, dot).textContent = `${xlabel} ${fmt(x, digits)}: ${ylabel} ${fmt(y, digits)}`;
    }
  }
  return root;
}

// The panel's error line, and its numbers on the box (`data-values`) where there is no error.
function answered(target, payload) {
  const box = $(target);
  box.replaceChildren();
  const drawn = tell(box, payload);
  box.dataset.values = drawn ? JSON.stringify(payload) : "";
  return drawn;
}

// The lines under a panel's maps: its `error` in red (what went wrong), or its `hint` in grey (what to record or
// choose to see it: nothing went wrong). Whether the panel has numbers to draw.
function tell(box, payload) {
  const panel = box.parentElement;
  const error = panel.querySelector(".error");
  let note = panel.querySelector(".note");
  if (!note) {
    note = document.createElement("p");
    note.className = "hint note";
    error.before(note);
  }
  error.textContent = payload.error || "";
  note.textContent = payload.error ? "" : payload.hint || "";
  return !payload.error && !payload.hint;
}

function drawDensity(payload) {
  const table = $("density-table");
  table.replaceChildren();
  if (!answered("density", payload)) return;
  $("density").append(chart([{ x: payload.p, y: payload.share, cls: "line" }], "mass p", "share of keys"));
  const rows = [
    ["mass p", payload.p, 4],
    ["share of the keys", payload.share, 4],
    [`keys (of ${payload.keys})`, payload.counts, 4],
  ];
  for (const [name, values, digits] of rows) {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = name;
    tr.append(th);
    for (const v of values) {
      const td = document.createElement("td");
      td.textContent = v === null ? "–" : fmt(v, digits);
      tr.append(td);
    }
    table.append(tr);
  }
}

function drawDecay(payload) {
  $("decay-fit").textContent = "";
  if (!answered("decay", payload)) return;
  const d = (n) => Array.from({ length: n }, (_, i) => i);
  for (const [axis, p, xlabel] of [["dt", "t", "|Δt| (latent frames)"], ["ds", "s", "spatial distance (patches)"]]) {
    const x = d(payload[axis].length);
    const series = [{ x, y: payload[axis], cls: "line" }, { x, y: payload[`${p}_fitted`], cls: "fit" }];
    const figure = chart(series, xlabel, "mass");
    figure.dataset.axis = axis;
    $("decay").append(figure);
  }
  const num = (v, digits = 4) => (v === null || v === undefined ? "–" : fmt(v, digits));
  const fit = (f, per) => `rate λ ${num(f.rate)} per ${per}, R² ${num(f.r2)}, a ${num(f.scale)}`;
  const curve = (values) => values.map((v, i) => `${i}: ${num(v)}`).join(", ");
  $("decay-fit").textContent =
    `time: ${fit(payload.t_fit, "latent frame")} · space: ${fit(payload.s_fit, "patch")} · text mass ${num(payload.text_mass)}` +
    ` · mass by |Δt| ${curve(payload.dt)} · by spatial distance ${curve(payload.ds)}`;
}

// A cell of a map over the video, named as the plots name their axes.
const onVideo = (f, r, c) => `latent frame ${f}, patch row ${r}, patch column ${c}`;

function choosePoint(frame, row, col) {
  point = [frame, row, col];
  remember();
  Promise.all([drawPoint(), drawTrack()]).then(() => (document.body.dataset.ready = String(Number(document.body.dataset.ready || 0) + 1)));
}

// -- a video point's track: its frame_max match in every latent frame, over the video's frames ----------------
async function drawTrack() {
  if (!S.kinds.includes("frame_max")) return;
  $("track-panel").hidden = false;
  const [frame, row, col] = point;
  $("track-label").textContent = `frame ${frame}, row ${row}, column ${col}`;
  const payload = await api("/api/track", { ...selection(), frame, row, col });
  const box = $("track");
  const readout = box.parentElement.querySelector(".readout");
  box.replaceChildren();
  readout.textContent = "";
  const drawn = tell(box, payload);
  box.dataset.track = drawn ? JSON.stringify({ point: payload.point, positions: payload.positions, confidence: payload.confidence }) : "";
  if (!drawn) return;
  const [frames, rows, cols] = payload.grid;
  const cell = Math.max(4, Math.min(28, Math.floor(240 / Math.max(rows, cols))));
  const figures = document.createElement("div");
  figures.className = "figures";
  box.append(figures);
  for (let f = 0; f < frames; f++) {
    const [mr, mc] = payload.positions[f];
    const p = payload.confidence[f];
    const figure = document.createElement("figure");
    const canvas = document.createElement("canvas");
    canvas.width = cols * cell;
    canvas.height = rows * cell;
    canvas.dataset.frame = f;
    canvas.dataset.match = JSON.stringify([mr, mc]);
    canvas.dataset.confidence = String(p);
    const pixel = payload.under[f];
    const image = pixel !== null && S.video_frames && !EMBEDDED ? loadFrame(pixel) : null;
    const paintTrack = () => {
      const ctx = canvas.getContext("2d");
      ctx.fillStyle = "#eee";
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      if (image && image.complete && image.naturalWidth) {
        ctx.imageSmoothingEnabled = false;
        ctx.drawImage(image, 0, 0, canvas.width, canvas.height);
      }
      if (f === frame) { // the point itself
        ctx.strokeStyle = "cyan";
        ctx.lineWidth = Math.max(1, cell / 8);
        ctx.strokeRect(col * cell + 1, row * cell + 1, cell - 2, cell - 2);
      }
      if (mr < 0) return;
      ctx.strokeStyle = "red";
      ctx.lineWidth = Math.max(1.5, cell / 6);
      ctx.beginPath();
      ctx.arc((mc + 0.5) * cell, (mr + 0.5) * cell, Math.max(3, cell * 0.4), 0, 2 * Math.PI);
      ctx.stroke();
    };
    paintTrack();
    if (image && !(image.complete && image.naturalWidth)) image.addEventListener("load", paintTrack, { once: true });
    const cellAt = (e) => cellUnder(canvas, e, rows, cols);
    canvas.addEventListener("mousemove", (e) => {
      const [r, c] = cellAt(e);
      const match = r === mr && c === mc ? `: the match, probability ${fmt(p, 6)}` : "";
      readout.textContent = onVideo(f, r, c) + match;
    });
    canvas.addEventListener("mouseleave", () => (readout.textContent = ""));
    canvas.addEventListener("click", (e) => choosePoint(f, ...cellAt(e)));
    const caption = document.createElement("figcaption");
    caption.textContent = mr < 0 ? `f${f}: no key with attention` : `f${f}: (${mr}, ${mc}) p ${fmt(p, 4)}`;
    caption.title = pixel === null ? "" : `over pixel frame ${pixel}`;
    figure.append(canvas, caption);
    figures.append(figure);
  }
  box.classList.add("clickable");
}

const ROW_KINDS = ["full", "query", "topk", "query_frame"]; // the kinds that hold a point's row

async function drawPoint() {
  // a run with frame_max and none of these: its point clicks are for the track alone
  $("point-panel").hidden = !S.kinds.some((k) => ROW_KINDS.includes(k)) && S.kinds.includes("frame_max");
  if ($("point-panel").hidden) return;
  const [frame, row, col] = point;
  $("point-label").textContent = `frame ${frame}, row ${row}, column ${col}`;
  $("point").dataset.point = JSON.stringify(point);
  const payload = await api("/api/point", { ...selection(), frame, row, col });
  const frames = Array.from({ length: S.layout.frames }, (_, f) => `f${f}`);
  const overVideo = Boolean(payload.shape) && payload.shape.length === 3; // a row over the video: click it to move
  const captions = payload.groups ? [`key groups: ${payload.groups.join(" · ")}`] : frames;
  const where = overVideo ? onVideo : (f, r, c) => (payload.groups ? `key group ${payload.groups[c]}` : `column ${c}`);
  draw("point", payload, { captions, onClick: overVideo ? choosePoint : null, unit: unitOf(payload.kind), where });
  const canvas = overVideo && $("point").querySelector(`canvas[data-frame="${frame}"]`);
  if (canvas) { // the point itself, outlined
    const cell = canvas.width / payload.shape[2];
    const ctx = canvas.getContext("2d");
    ctx.strokeStyle = "red";
    ctx.lineWidth = Math.max(1, cell / 6);
    ctx.strokeRect(col * cell + 1, row * cell + 1, cell - 2, cell - 2);
  }
  $("point-note").textContent = payload.note || "";
}

// The item shown, named above the maps; the word labels are its text's: the negative prompt's tokens for the
// unconditional item (where the batch tool kept them), the prompt's otherwise.
function labelItem() {
  const it = S.items.find((x) => String(x.slot) === $("item").value) || S.items[0];
  $("item-label").textContent = it ? it.label : "";
  const tokens = it && it.role === "uncond" ? S.negative_tokens : S.tokens;
  [...$("token").options].forEach((o, i) => (o.textContent = `${i}: ${tokens[i] ?? ""}`));
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = text ?? value;
  select.append(o);
}

function describe() {
  const info = S.info || {};
  const parts = [];
  if (info.prompt) parts.push(`“${info.prompt}”`);
  if (info.seed !== undefined && info.seed !== null) parts.push(`seed ${info.seed}`);
  parts.push(`${S.model.family || "?"} (${S.model.class || "?"}, ${S.model.dtype || "?"})`);
  parts.push(`status: ${S.status}`);
  parts.push(`spot checks: ${S.checks.count} (${S.checks.failed} failed)`);
  if (S.skipped.count) parts.push(`${S.skipped.count} attention calls skipped by ${S.skipped.by || "the model"}`);
  if (S.export) parts.push(`export: ${S.export.layers}; ${S.export.heads}; ${S.export.tokens} tokens; ≤ ${S.export.max_side} patches a side`);
  $("meta").textContent = parts.join(" · ");
  const details = {
    options: S.selection,
    model: S.model,
    "spot checks": S.checks,
    "skipped by a cache (step, layer, role)": S.skipped.count ? S.skipped.calls : "none",
  };
  if (S.export) details.export = S.export;
  $("details-text").textContent = Object.entries(details)
    .map(([k, v]) => `${k}: ${JSON.stringify(v)}`)
    .join("\n");
}

async function openRun() {
  S = await api("/api/summary", { run });
  if (!S || S.error || !S.kinds) {
    $("run-name").textContent = `${run}: ${(S && S.error) || "no such run"}`;
    document.body.dataset.ready = "1";
    return;
  }
  $("viewer").hidden = false;
  $("run-name").textContent = run;
  describe();
  const kinds = S.kinds;
  sliderKind = kinds.includes("frame") ? "frame" : kinds[0];
  const gaps = (S.gaps && S.gaps[sliderKind]) || {};
  const union = (a, b) => [...new Set([...a, ...b])].sort((x, y) => x - y);
  steps = union(S.steps[sliderKind] || [], Object.keys(gaps).map(Number)); // a step a cache skipped whole is a gap too
  const layers = union(S.layers[sliderKind] || [], Object.values(gaps).flat());
  $("step").max = Math.max(0, steps.length - 1);
  $("step").value = Math.max(0, steps.length - 1);
  drawGaps(gaps, layers.length);
  // the batch item the maps are of: under guidance the conditional one first (the server's default), and
  // the unconditional one named as such, never shown under the prompt's words without saying so
  for (const it of S.items) option($("item"), it.slot, it.label);
  $("item").value = String(S.item);
  $("item-control").hidden = S.items.length < 2;
  option($("layer"), "mean", "mean of layers");
  for (const l of layers) option($("layer"), l, S.layer_names ? `${l}: ${S.layer_names[l]}` : `${l}`);
  option($("head"), "mean", "mean of heads");
  for (const h of S.heads || []) option($("head"), h, `head ${h}`);
  for (const k of ["video_to_text", "text_to_video"]) if (kinds.includes(k)) option($("word-kind"), k);
  for (const k of ["entropy", "received"]) if (kinds.includes(k)) option($("stat-kind"), k);
  for (const k of Object.keys(AUDIO_AXES)) if (kinds.includes(k)) option($("audio-kind"), k);
  for (const c of S.head_columns) option($("head-column"), c);
  for (const m of S.masks) option($("mask"), m);
  for (const p of ["none", ...((S.sparse && S.sparse.patterns) || [])]) option($("pattern"), p);
  S.tokens.forEach((t, i) => option($("token"), i, `${i}: ${t}`));
  labelItem();
  if (S.video_frames && !EMBEDDED && S.kinds.some((k) => k === "video_to_text" || k === "text_to_video")) {
    $("overlay-panel").hidden = false;
    $("pixel-frame").max = S.video_frames - 1;
    $("pixel-frame").addEventListener("input", drawOverlay);
    $("play").addEventListener("click", togglePlay);
  }
  if (S.video) {
    const url = fileUrl(run, "video");
    const element = S.video === "mp4" ? $("video-mp4") : $("video");
    if (url) {
      element.src = url;
      element.hidden = false;
      $("video-panel").hidden = false;
      $("video-note").textContent = EMBEDDED ? "" : S.video_note || "";
    }
  } else if (S.video_note) { // a video refused (outside the folder, or damaged): the panel says why
    $("video-panel").hidden = false;
    $("video-note").textContent = S.video_note;
  }
  // the middle till a click, or a recorded query's point where no 'full' row holds every point
  if (S.layout) point = !S.kinds.includes("full") && S.points && S.points.length ? S.points[0] : [S.layout.frames >> 1, S.layout.height >> 1, S.layout.width >> 1];
  restore(); // a link's view
  for (const id of KEPT) $(id).addEventListener("input", redraw);
  $("item").addEventListener("input", labelItem);
  await redraw();
}

async function listRuns(runs) {
  $("runs").hidden = false;
  const body = $("run-table").querySelector("tbody");
  for (const r of runs) {
    const tr = document.createElement("tr");
    tr.className = "run";
    tr.dataset.prompt = (r.prompt || "").toLowerCase();
    const thumb = document.createElement("td");
    if (r.thumbnail && !EMBEDDED) {
      const img = document.createElement("img");
      img.src = fileUrl(r.name, "thumbnail");
      img.alt = "frame map";
      thumb.append(img);
    }
    const cells = [r.name, r.error || r.prompt || "", r.status].map((text) => {
      const td = document.createElement("td");
      td.textContent = text;
      return td;
    });
    if (r.error) cells[1].className = "error"; // a run that cannot be read: why, in one line
    tr.append(thumb, ...cells);
    tr.addEventListener("click", () => (location.search = "?run=" + escaped(r.name)));
    body.append(tr);
  }
  $("search").addEventListener("input", () => {
    const q = $("search").value.toLowerCase();
    for (const tr of body.children) tr.hidden = !tr.dataset.prompt.includes(q);
  });
  document.body.dataset.ready = "1";
}

async function main() {
  const runs = await api("/api/runs");
  if (!run && runs.length === 1) run = runs[0].name;
  if (run) {
    $("all-runs").hidden = runs.length < 2;
    await openRun();
  } else {
    await listRuns(runs);
  }
}

main();
