// The page of `tt-moge serve` (tt_moge/server/ui.py): pick or drop a photo, POST it to /ui/api/predict (the
// same auth, limits and admission as POST /predict), then show the maps, the numbers and the 3D view, and
// fetch the downloads on request. A short video clip goes to /ui/api/predict_video (as POST /predict/video,
// tt_moge/server/video.py): the numbers, the fused scene with the camera path, the clip's files.
// Errors are the API's JSON {code, detail}, shown as they come.
import { MeshViewer, parseGLB, parseSceneGLB } from "./viewer.js";

const $ = (id) => document.getElementById(id);
const state = { file: null, config: null, viewer: null, result: null, busy: false };
// Timestamps (performance.now(), ms) of the last run, for people and for the benchmark (perf/ui).
window.ttMoge = { runs: 0 };

function setState(name) { document.body.dataset.state = name; }

function showError(title, detail, retry) {
  $("error-title").textContent = title;
  $("error-detail").textContent = detail || "";
  $("retry").hidden = !retry;
  $("error").hidden = false;
}
function hideError() { $("error").hidden = true; }

function progress(text) {
  $("progress").hidden = !text;
  $("progress-text").textContent = text || "";
}

// An API error response -> a title and a line for people (the detail is the API's own message).
async function describe(status, bodyText) {
  let body = null;
  try { body = JSON.parse(bodyText); } catch { /* not JSON: a proxy's page */ }
  const code = body && body.code, detail = body && body.detail ? body.detail : (bodyText || "").slice(0, 300);
  if (status === 503) return { title: "Busy, retry:", detail, retry: true, code };
  if (status === 401) {
    $("key-row").hidden = false;
    return { title: "API key needed:", detail: "enter this server's API key above and run again (" + detail + ")", code };
  }
  if (status === 413) return { title: "Too large:", detail, code };
  if (status === 0) return { title: "No answer from the server:", detail: "is it still running?", retry: true };
  return { title: code ? `${code}:` : `HTTP ${status}:`, detail, code };
}

function authHeaders() {
  // Percent-encoded UTF-8: a browser refuses a header beyond Latin-1 and sends Latin-1 as single bytes, so a
  // non-ASCII key as typed would never match; the server decodes this form (docs/server.md, --api-key).
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${encodeURIComponent(key)}` } : {};
}

// ------------------------------------------------------------------------------------------------ input
const VIDEO_NAME = /\.(mp4|mov|mkv|webm|avi|m4v|mpe?g)$/i;
function isVideo(file) { return (file.type || "").startsWith("video/") || VIDEO_NAME.test(file.name || ""); }

async function choose(file) {
  if (!file) return;
  state.file = file;
  const preview = $("preview");
  if (preview.src.startsWith("blob:")) URL.revokeObjectURL(preview.src);
  const video = isVideo(file);
  document.body.dataset.kind = video ? "video" : "photo";
  $("video-options").hidden = !video;
  if (video) { preview.removeAttribute("src"); preview.hidden = true; }
  else { preview.src = URL.createObjectURL(file); preview.hidden = false; }
  // An image twice as wide as high is offered as a 360-degree panorama (and run as one unless unticked).
  const panorama = !video && isPanoramaSize(await imageSize(preview));
  $("panorama-row").hidden = !panorama;
  $("panorama").checked = panorama;
  photoOptionsEnabled();
  $("drop-text").textContent = `${file.name} (${(file.size / 1024).toFixed(0)} KiB): drop or click for another`;
  $("run").disabled = false;
  run();
}

async function imageSize(img) {  // [width, height] of the preview once decoded (its one decode), or null
  try { await img.decode(); return [img.naturalWidth, img.naturalHeight]; } catch { return null; }
}

function isPanoramaSize(size) {  // the server's own rule (tt_moge.panorama.geometry.check_panorama_size)
  const tolerance = (state.config && state.config.panorama_aspect_tolerance) || 0.01;
  return !!size && size[1] >= 8 && Math.abs(size[0] / size[1] - 2) <= 2 * tolerance;
}

function asPanorama() { return !$("panorama-row").hidden && $("panorama").checked; }

function photoOptionsEnabled() {  // a panorama takes apply_mask only: the other call options are greyed out
  for (const o of (state.config && state.config.options) || []) {
    if (o.name !== "apply_mask") $(o.name).disabled = asPanorama();
  }
}

function bindInput() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => {
    choose(e.target.files[0]);
    e.target.value = "";  // choosing the same file again runs it again
  });
  for (const name of ["dragenter", "dragover"]) {
    drop.addEventListener(name, (e) => { e.preventDefault(); drop.classList.add("over"); });
  }
  for (const name of ["dragleave", "drop"]) drop.addEventListener(name, () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); choose(e.dataTransfer.files[0]); });
  $("demo").addEventListener("click", async () => {
    progress("fetching the demo image…");
    const r = await fetch("/ui/demo.png");
    progress("");
    if (!r.ok) { const d = await describe(r.status, await r.text()); showError(d.title, d.detail); return; }
    choose(new File([await r.blob()], "demo.png", { type: "image/png" }));
  });
  $("run").addEventListener("click", run);
  $("retry").addEventListener("click", run);
  $("panorama").addEventListener("change", photoOptionsEnabled);
}

// ------------------------------------------------------------------------------------------------- run
function post(url, file, onUploaded) {  // XMLHttpRequest: it reports upload progress, fetch does not
  return new Promise((resolve) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url);
    // The file's own type (from its name when the system gave none); the server answers an unsupported
    // one with its 415 message.
    const byName = /\.png$/i.test(file.name) ? "image/png" : /\.jpe?g$/i.test(file.name) ? "image/jpeg"
      : VIDEO_NAME.test(file.name) ? "video/mp4" : "application/octet-stream";
    xhr.setRequestHeader("Content-Type", file.type || byName);
    for (const [k, v] of Object.entries(authHeaders())) xhr.setRequestHeader(k, v);
    xhr.upload.onprogress = (e) => {
      if (e.lengthComputable && e.loaded < e.total) progress(`uploading… ${Math.round(100 * e.loaded / e.total)} %`);
    };
    xhr.upload.onload = onUploaded;
    xhr.onload = () => resolve({ status: xhr.status, text: xhr.responseText });
    xhr.onerror = () => resolve({ status: 0, text: "" });
    xhr.send(file);
  });
}

async function run() {
  if (!state.file || state.busy) return;
  state.busy = true;
  hideError();
  setState("running");
  $("run").disabled = true;
  clearResult();
  const marks = { start: performance.now() };
  window.ttMoge.last = marks;
  const started = Date.now();
  let stage = "uploading…";
  const spinner = document.querySelector("#progress .spinner");
  // Once a second: the page stays (nearly) idle while the server works, even where it shares its CPU.
  const tick = setInterval(() => {
    const seconds = Math.round((Date.now() - started) / 1000);
    spinner.style.transform = `rotate(${90 * seconds}deg)`;
    progress(`${stage} ${seconds} s`);
  }, 1000);
  progress(stage);
  try {
    const video = isVideo(state.file), panorama = !video && asPanorama();
    const query = panorama ? panoramaQuery() : optionQuery(video);
    const route = video ? "/ui/api/predict_video" : panorama ? "/ui/api/predict_panorama" : "/ui/api/predict";
    const running = video ? "running the clip…" : panorama ? "running the 12 views…" : "running the model…";
    const r = await post(`${route}?${query}`, state.file, () => { stage = running; });
    marks.response = performance.now();
    if (r.status !== 200) {
      const d = await describe(r.status, r.text);
      setState("error");
      showError(d.title, d.detail, d.retry);
      document.body.dataset.errorCode = d.code || String(r.status);
      return;
    }
    const result = JSON.parse(r.text);
    state.result = result;
    marks.server = { timing_ms: result.summary.timing_ms, page_ms: result.page_ms, view: result.view };
    if (video) {
      showClipNumbers(result);
      showDownloads(result);
      stage = "loading the 3D scene…";
      await showScene(result, marks);
      marks.done = performance.now();
      setState("done");
      return;
    }
    showMaps(result);
    if (panorama) showPanoramaNumbers(result); else showNumbers(result);
    showDownloads(result);
    stage = "loading the 3D view…";
    await showView(result, marks);
    marks.done = performance.now();
    setState("done");
  } catch (err) {
    setState("error");
    showError("Error:", String(err && err.message ? err.message : err));
  } finally {
    clearInterval(tick);
    progress("");
    state.busy = false;
    $("run").disabled = !state.file;
    window.ttMoge.runs += 1;
  }
}

function clearResult() {
  state.result = null;
  measure.picks = [];
  measure.seq += 1;  // an answer still on its way is for the old result
  drawPicks();
  $("measure").hidden = true;
  for (const id of MAPS) {
    $(id).hidden = true;
    $(id).closest("figure").hidden = false;
    $(id).removeAttribute("src");
  }
  $("numbers").hidden = true;
  $("downloads").hidden = true;
  $("view-info").textContent = "";
  $("view-points-row").hidden = true;
  $("view-message").hidden = false;
  $("view-message").textContent = "The 3D scene appears here";
  delete document.body.dataset.errorCode;
  if (state.viewer) state.viewer.clear();
}

function showClipNumbers(result) {
  const s = result.summary;
  for (const id of MAPS) $(id).closest("figure").hidden = true;
  const t = s.timing_ms || {};
  const rows = [
    ["size", "Frames", `${s.frames} of ${s.width} × ${s.height} px${s.fps ? ` at ${s.fps.toFixed(2)} fps` : ""}`, [s.width, s.height]],
    ["registered", "Registered", `${s.registered} of ${s.frames}${s.relocalised ? `, ${s.relocalised} found again by descriptor matching` : ""}${s.failed.length ? " (the others are flagged)" : ""}${s.chains.length > 1 ? `; ${s.chains.length} chains (a new one after each cut), the view shows chain ${s.main_chain}` : ""}`, s.registered],
    ["fov_x_deg", "Horizontal field of view (the clip's)", fmt(1, "°")(s.fov_x_deg), s.fov_x_deg],
    ["path_length_m", "Camera path", fmt(2, " m")(s.path_length_m), s.path_length_m],
    ["scale", "Metric scale (median, min – max)", s.scale.median === null ? "n/a" : `${s.scale.median.toFixed(3)} (${s.scale.min.toFixed(3)} – ${s.scale.max.toFixed(3)})`, s.scale],
    ["cloud_points", "Fused cloud", `${s.cloud_points.toLocaleString()} points (voxel ${fmt(3, " m")(s.voxel_size_m)})`, s.cloud_points],
    ["timing", "Server time", t.total ? `${(t.total / 1000).toFixed(2)} s` : "n/a", t],
  ];
  fillNumbers(rows, s);
}

// rows: [key, label, text, value] -> the numbers table (each row keeps its value as JSON), and the summary JSON
function fillNumbers(rows, summary) {
  const body = $("numbers-table").tBodies[0];
  body.replaceChildren();
  for (const [key, label, text, value] of rows) {
    const row = body.insertRow();
    row.dataset.key = key;
    row.dataset.value = JSON.stringify(value);
    row.insertCell().textContent = label;
    row.insertCell().textContent = text;
  }
  $("summary-json").textContent = JSON.stringify(summary, null, 2);
  $("numbers").hidden = false;
}

function showPanoramaNumbers(result) {
  const s = result.summary, t = s.timing_ms || {}, range = result.depth_range_m;
  const merged = s.views - s.views_failed.length;
  fillNumbers([
    ["size", "Panorama", `${s.width} × ${s.height} px (360° × 180°)`, [s.width, s.height]],
    ["valid_fraction", "Valid pixels", fmt(1, " %")(100 * s.valid_fraction), s.valid_fraction],
    ["median_distance_m", "Median distance", fmt(2, " m")(s.median_distance_m), s.median_distance_m],
    ["views", "Views merged", `${merged} of ${s.views}`, merged],
    ["merge", "Merge", `${s.merge_iterations} CG steps, residual ${s.merge_residual === null ? "n/a" : s.merge_residual.toExponential(1)}${s.merge_converged ? "" : " (not converged)"}`, s.merge_converged],
    ["depth_range", "Distance colour range", range[0] === null ? "n/a" : `${range[0].toFixed(2)} – ${range[1].toFixed(2)} m (1st – 99th percentile)`, range],
    ["timing", "Server time", t.total ? `${(t.total / 1000).toFixed(2)} s (the 12 views and the merge ${(t.panorama / 1000).toFixed(2)} s)` : "n/a", t],
  ], s);
}

async function showScene(result, marks) {
  const message = $("view-message");
  if (!makeViewer(message)) return;
  const r = await fetch(result.view.url);
  if (!r.ok) { const d = await describe(r.status, await r.text()); message.textContent = `${d.title} ${d.detail}`; return; }
  const glb = await r.arrayBuffer();
  marks.viewBytes = glb.byteLength;
  const s = result.summary;
  const fovY = 2 * Math.atan(s.height / 2 / s.intrinsics_pixels[1][1]) * 180 / Math.PI;
  state.viewer.loadScene(parseSceneGLB(glb), { fovYDeg: fovY, distance: result.view.distance });
  await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));  // drawn
  marks.view = performance.now();
  message.hidden = true;
  $("view-info").textContent = `· ${result.view.points.toLocaleString()} points, ${result.view.cameras} cameras (red: the path and frusta), ${(glb.byteLength / 1048576).toFixed(1)} MB`;
}

function showMaps(result) {
  for (const id of MAPS) {
    const url = result.images[id];
    $(id).hidden = !url;
    $(id).closest("figure").hidden = !url;  // no normal map from a model without a normal head
    if (url) $(id).src = url;
  }
  $("depth").closest("figure").querySelector("figcaption").textContent = result.kind === "panorama"
    ? "Distance from the viewpoint (metres, colour bar on the right)" : "Depth (metres, colour bar on the right)";
  showMeasure(null, []);
  $("measure").hidden = false;
}

// ------------------------------------------------------------------------------------------------ measure
// Click two pixels on a map (depth, normal or mask: each on the photo's pixel grid) -> their 3D points, read
// from the result's arrays by GET /ui/results/<id>/points, and the distance between them in metres; a third
// click starts a new pair.
const MAPS = ["depth", "normal", "mask"];
const measure = { picks: [], seq: 0 };

function pixelAt(img, e) {  // the photo's pixel under the pointer, or null (outside it: the depth colour bar)
  const rect = img.getBoundingClientRect();
  const x = Math.floor((e.clientX - rect.left - img.clientLeft) * img.naturalWidth / img.clientWidth);
  const y = Math.floor((e.clientY - rect.top - img.clientTop) * img.naturalHeight / img.clientHeight);
  const s = state.result && state.result.summary;
  return s && x >= 0 && y >= 0 && x < s.width && y < s.height ? [x, y] : null;
}

// The photo's pixel at the texture coordinates [u, v] of the 3D view (glTF's, v down; a panorama's seam
// faces reach past u = 1), or null
function pixelAtUV(uv) {
  const s = state.result && state.result.summary;
  if (!uv || !s) return null;
  const x = ((Math.floor(uv[0] * s.width) % s.width) + s.width) % s.width, y = Math.floor(uv[1] * s.height);
  return y >= 0 && y < s.height ? [x, y] : null;
}

async function pick(pixel) {
  if (!pixel || !state.result || !state.result.points) return;
  if (measure.picks.length === 2) measure.picks = [];
  measure.picks.push(pixel);
  drawPicks();
  const seq = ++measure.seq;
  const query = measure.picks.map(([x, y]) => `at=${x},${y}`).join("&");
  try {
    const r = await fetch(`${state.result.points}?${query}`);
    if (seq !== measure.seq) return;  // a newer click is on its way
    if (!r.ok) { const d = await describe(r.status, await r.text()); showMeasure(`${d.title} ${d.detail}`); return; }
    const points = (await r.json()).points;
    showMeasure(null, points);
    if (state.viewer) state.viewer.setMarks(points.map((p) => p.point));
  } catch (err) {
    if (seq === measure.seq) showMeasure(`No answer from the server: ${err}`);
  }
}

function showMeasure(error, points = []) {
  const box = $("measure-text");
  box.dataset.pixels = JSON.stringify(measure.picks);
  delete box.dataset.distance;
  const lines = [];
  if (error) lines.push(error);
  for (const [i, p] of points.entries()) {
    const where = `${"AB"[i]} at (${p.pixel.join(", ")})`;
    lines.push(p.point === null ? `${where}: no 3D point (masked out)`
      : `${where}: ${depthWord()} ${p.depth_m.toFixed(3)} m${p.valid ? "" : " (outside the mask)"}`);
  }
  if (!error && points.length === 2 && points[0].point && points[1].point) {
    const distance = Math.hypot(...points[0].point.map((v, k) => v - points[1].point[k]));
    box.dataset.distance = String(distance);
    lines.push(`A to B: ${distance.toFixed(3)} m`);
  } else if (!error && points.length < 2) {
    lines.push(points.length ? "Click a second point." : `Click two points on a map or on the 3D view for their ${depthWord()} and the distance between them.`);
  }
  box.replaceChildren(...lines.map((line) => Object.assign(document.createElement("div"), { textContent: line })));
  if (box.dataset.distance) box.lastChild.className = "distance";
}

function depthWord() { return state.result && state.result.kind === "panorama" ? "distance" : "depth"; }

function drawPicks() {
  for (const id of MAPS) {
    const img = $(id), svg = img.nextElementSibling;
    svg.replaceChildren();
    if (img.hidden || !img.naturalWidth || !measure.picks.length) continue;
    svg.setAttribute("viewBox", `0 0 ${img.naturalWidth} ${img.naturalHeight}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const unit = img.naturalWidth / Math.max(1, img.clientWidth);  // photo pixels per screen pixel
    const add = (name, attrs) => {
      const el = document.createElementNS(svg.namespaceURI, name);  // the SVG namespace
      for (const [k, v] of Object.entries({ "stroke-width": 2 * unit, ...attrs })) el.setAttribute(k, v);
      svg.append(el);
    };
    const [a, b] = measure.picks.map(([x, y]) => [x + 0.5, y + 0.5]);
    if (b) add("line", { x1: a[0], y1: a[1], x2: b[0], y2: b[1] });
    for (const [i, [x, y]] of [a, b].filter(Boolean).entries()) add("circle", { cx: x, cy: y, r: 6 * unit, class: i ? "b" : "a" });
  }
}

function bindMeasure() {
  for (const id of MAPS) $(id).addEventListener("click", (e) => pick(pixelAt($(id), e)));
  window.addEventListener("resize", drawPicks);  // the marks' size is in screen pixels
}

// ------------------------------------------------------------------------------------------------ numbers
const fmt = (digits, unit = "") => (v) => (v === null || v === undefined ? "n/a" : `${Number(v).toFixed(digits)}${unit}`);
// The rows of the numbers table: the image size, one row per number of the summary that the output definitions
// say how to show (GET /ui/api/config: numbers, from tt_moge.output.SUMMARY_SHOWN), the depth colour range and
// the server time.
function numberRows() {
  const numbers = (state.config && state.config.numbers) || [];
  return [
    ["size", "Image", (s) => `${s.width} × ${s.height} px`],
    ...numbers.map((n) => [n.key, n.label, (v) => (v === null || v === undefined ? "n/a" : `${(n.scale * Number(v)).toFixed(n.digits)}${n.unit}`)]),
    ["depth_range", "Depth colour range", null],
    ["timing", "Server time", null],
  ];
}

function showNumbers(result) {
  const s = result.summary, rows = [];
  for (const [key, label, format] of numberRows()) {
    let text, value;
    if (key === "size") { value = [s.width, s.height]; text = format(s); }
    else if (key === "depth_range") {
      value = result.depth_range_m;
      text = value[0] === null ? "n/a" : `${value[0].toFixed(2)} – ${value[1].toFixed(2)} m (1st – 99th percentile)`;
    } else if (key === "timing") {
      value = s.timing_ms;
      const t = s.timing_ms;
      text = `${(t.total / 1000).toFixed(2)} s (model ${(t.device / 1000).toFixed(2)} s, queue ${(t.queue / 1000).toFixed(2)} s, maps and 3D view ${(t.encode / 1000).toFixed(2)} s)`;
    } else { value = s[key]; text = format(value); }
    rows.push([key, label, text, value]);
  }
  fillNumbers(rows, s);
}

// ---------------------------------------------------------------------------------------------- downloads
const DOWNLOAD_LABELS = {
  "clip.npz": ["npz", "every array of the clip (the POST /predict/video layout)"],
  "poses.json": ["poses", "per frame: pose, scales, intrinsics, registration"],
  "trajectory.txt": ["TUM", "the registered frames' poses, TUM format"],
  "scene.ply": ["PLY", "the fused cloud and the camera path"],
  "scene.glb": ["GLB", "the fused cloud, the camera path and frusta"],
  "result.npz": ["npz", "every array (the POST /predict layout)"],
  "mesh.glb": ["GLB", "textured mesh, full resolution"],
  "points.ply": ["PLY", "coloured point cloud with normals"],
  "depth.exr": ["EXR", "depth, float32 metres"],
  "view.glb": ["view GLB", "the light mesh of the 3D view"],
};

function downloadName(name) {
  const stem = (state.file && state.file.name ? state.file.name.replace(/\.[^.]*$/, "") : "moge") || "moge";
  return name === "result.npz" || name === "clip.npz" ? `${stem}.npz` : `${stem}_${name}`;
}

function showDownloads(result) {
  const box = $("download-buttons");
  box.replaceChildren();
  for (const [name, url] of Object.entries(result.downloads)) {
    const [label, title] = DOWNLOAD_LABELS[name] || [name, name];
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.title = title;
    button.dataset.file = name;
    button.addEventListener("click", () => download(button, url, downloadName(name)));
    box.append(button);
  }
  $("download-status").textContent = "";
  $("downloads").hidden = false;
}

async function download(button, url, filename) {
  button.disabled = true;
  const status = $("download-status");
  status.textContent = `preparing ${filename}…`;
  try {
    const r = await fetch(url, { headers: authHeaders() });
    if (!r.ok) {
      const d = await describe(r.status, await r.text());
      status.textContent = `${d.title} ${d.detail}`;
      return;
    }
    const blob = await r.blob();
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = filename;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 60000);
    status.textContent = `${filename}: ${(blob.size / 1048576).toFixed(1)} MB`;
    status.dataset.done = filename;
  } catch (err) {
    status.textContent = `download failed: ${err}`;
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------------------------------------ 3D view
// The page's one MeshViewer (made at start-up, tried again at each result; a click on its mesh measures there),
// or false after saying why there is none (no WebGL 2)
function makeViewer(message) {
  if (!state.viewer) {
    try { state.viewer = new MeshViewer($("view")); } catch (err) { message.textContent = String(err.message); return false; }
    state.viewer.onClick = (x, y) => pick(pixelAtUV(state.viewer.pickUV(x, y)));
  }
  return true;
}

async function showView(result, marks) {
  const message = $("view-message");
  if (!result.view.url) {
    message.textContent = "No 3D view: no valid pixel off depth edges";
    return;
  }
  if (!makeViewer(message)) return;
  const r = await fetch(result.view.url);
  if (!r.ok) { const d = await describe(r.status, await r.text()); message.textContent = `${d.title} ${d.detail}`; return; }
  const glb = await r.arrayBuffer();
  marks.viewBytes = glb.byteLength;
  marks.viewFetched = performance.now();
  // a photo: from its own camera, orbiting its median depth; a panorama: from its centre (the orbit centre a
  // step ahead, so that dragging looks around), 75 degrees high
  const s = result.summary;
  const camera = result.kind === "panorama" ? { fovYDeg: 75, distance: 0.02 * (s.median_distance_m || 1), wrap: true }
    : { fovYDeg: s.fov_y_deg, distance: s.median_depth_m };
  await state.viewer.load(parseGLB(glb), camera);
  state.viewer.setPointMode($("view-points").checked);  // as the reader left it for the previous photo
  $("view-points-row").hidden = false;
  await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));  // drawn
  marks.view = performance.now();
  message.hidden = true;
  const v = result.view;
  $("view-info").textContent = `· ${v.vertices.toLocaleString()} vertices, ${v.faces.toLocaleString()} triangles (a vertex per ${v.step}×${v.step} pixels), ${(glb.byteLength / 1048576).toFixed(1)} MB`;
}

// ----------------------------------------------------------------------------------------------- start-up
async function watchServer() {
  const status = $("server-status");
  for (;;) {
    try {
      const r = await fetch("/ready");
      if (r.ok) { status.textContent = "ready"; status.className = "status ok"; return; }
      const body = await r.json().catch(() => ({}));
      status.textContent = body.detail && body.detail.includes("failed") ? "model failed to load" : "loading the model…";
      status.className = "status wait";
    } catch { status.textContent = "server unreachable"; status.className = "status bad"; }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

// One control per call option of the server (GET /ui/api/config: name, kind, default, help, choices, bounds),
// with the option's name as its id; optionQuery() sends what they show.
function buildOptions(options, box = $("options")) {
  for (const o of options) {
    const label = document.createElement("label");
    let input;
    if (o.kind === "bool") {
      label.className = "check";
      input = document.createElement("input");
      input.type = "checkbox";
      input.checked = o.default;
      label.append(input, ` ${o.name}`);
    } else if (o.kind === "choice") {
      input = document.createElement("select");
      for (const value of o.choices) input.append(new Option(value, value, value === o.default, value === o.default));
      label.append(`${o.name} `, input);
    } else {
      input = document.createElement("input");
      input.type = o.kind === "number" ? "number" : "text";
      if (o.bounds) { [input.min, input.max] = o.bounds; input.step = "any"; }
      input.placeholder = o.default === null ? "not given" : String(o.default);
      label.append(`${o.name} `, input);
    }
    input.id = o.name;
    const help = document.createElement("small");
    help.textContent = o.help;
    label.append(help);
    box.append(label);
  }
}

function panoramaQuery() {  // a panorama's only option (its views' field of view is fixed)
  const mask = $("apply_mask");
  return new URLSearchParams({ apply_mask: mask ? String(mask.checked) : "true" });
}

function optionQuery(video) {
  const query = new URLSearchParams();
  const config = state.config || {};
  for (const o of [...(config.options || []), ...(video ? config.video_options || [] : [])]) {
    const input = $(o.name);
    if (o.kind === "bool") query.set(o.name, input.checked ? "true" : "false");
    else if (input.value.trim() !== "") query.set(o.name, input.value.trim());
  }
  return query;
}

async function start() {
  bindInput();
  bindMeasure();
  try {
    state.config = await (await fetch("/ui/api/config")).json();
    if (state.config.auth) $("key-row").hidden = false;
    buildOptions(state.config.options || []);
    buildOptions(state.config.video_options || [], $("video-options"));
  } catch { /* the page still works with the server's defaults; a 401 shows the key field */ }
  makeViewer($("view-message"));
  $("view-points").addEventListener("change", (e) => state.viewer && state.viewer.setPointMode(e.target.checked));
  watchServer();
}

start();
