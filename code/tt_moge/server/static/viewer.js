// The page's 3D view: a textured triangle mesh from a GLB file, drawn with WebGL 2, orbit / pan / zoom; or,
// for a clip, its fused point cloud and camera path (parseSceneGLB: POINTS and LINES with vertex colours).
// Reads the GLB the server writes for the view (tt_moge.server.ui.view_mesh): one mesh, one primitive with
// POSITION, TEXCOORD_0 and uint32 indices, a base colour texture (JPEG or PNG) embedded in the binary chunk.
// Drawn unlit: the texture is the photo, so the first frame, from the camera's own position and field of
// view, looks like the photo itself. A click (not a drag, not a double click) on the mesh reports the texture
// coordinates under it (pickUV: the mesh drawn once more into an integer target, read at that one pixel), so
// the page can measure there; marks (setMarks) show the measured points and the segment between them.

const GLB_MAGIC = 0x46546c67, CHUNK_JSON = 0x4e4f534a, CHUNK_BIN = 0x004e4942;
const COMPONENTS = { SCALAR: 1, VEC2: 2, VEC3: 3, VEC4: 4 };
const ARRAYS = { 5121: Uint8Array, 5123: Uint16Array, 5125: Uint32Array, 5126: Float32Array };

export function parseGLB(buffer) {
  const view = new DataView(buffer);
  if (buffer.byteLength < 20 || view.getUint32(0, true) !== GLB_MAGIC) throw new Error("not a GLB file");
  let offset = 12, json = null, bin = null;
  while (offset + 8 <= buffer.byteLength) {
    const length = view.getUint32(offset, true), type = view.getUint32(offset + 4, true);
    const body = buffer.slice(offset + 8, offset + 8 + length);
    if (type === CHUNK_JSON) json = JSON.parse(new TextDecoder().decode(body));
    else if (type === CHUNK_BIN) bin = body;
    offset += 8 + length;
  }
  if (!json || !bin) throw new Error("GLB without its JSON or binary chunk");
  const primitive = json.meshes[0].primitives[0];
  const accessor = (index) => {
    const a = json.accessors[index], bv = json.bufferViews[a.bufferView];
    const Type = ARRAYS[a.componentType];
    const start = (bv.byteOffset || 0) + (a.byteOffset || 0);
    return { data: new Type(bin, start, a.count * COMPONENTS[a.type]), min: a.min, max: a.max, count: a.count };
  };
  const mesh = {
    position: accessor(primitive.attributes.POSITION),
    uv: accessor(primitive.attributes.TEXCOORD_0),
    indices: accessor(primitive.indices),
    texture: null,
  };
  const material = json.materials && json.materials[primitive.material];
  const texInfo = material && material.pbrMetallicRoughness && material.pbrMetallicRoughness.baseColorTexture;
  if (texInfo) {
    const image = json.images[json.textures[texInfo.index].source];
    const bv = json.bufferViews[image.bufferView];
    mesh.texture = new Blob([new Uint8Array(bin, bv.byteOffset || 0, bv.byteLength)], { type: image.mimeType });
  }
  return mesh;
}

// A clip's scene GLB (tt_moge.video.files.scene_glb_bytes, as trimesh writes it): every primitive with its mode
// (0 POINTS: the fused cloud; 1 LINES: the camera path and frusta), POSITION (float VEC3) and COLOR_0 (uint8
// normalised VEC4). Node transforms are the identity there.
export function parseSceneGLB(buffer) {
  const view = new DataView(buffer);
  if (buffer.byteLength < 20 || view.getUint32(0, true) !== GLB_MAGIC) throw new Error("not a GLB file");
  let offset = 12, json = null, bin = null;
  while (offset + 8 <= buffer.byteLength) {
    const length = view.getUint32(offset, true), type = view.getUint32(offset + 4, true);
    const body = buffer.slice(offset + 8, offset + 8 + length);
    if (type === CHUNK_JSON) json = JSON.parse(new TextDecoder().decode(body));
    else if (type === CHUNK_BIN) bin = body;
    offset += 8 + length;
  }
  if (!json || !bin) throw new Error("GLB without its JSON or binary chunk");
  const accessor = (index) => {
    const a = json.accessors[index], bv = json.bufferViews[a.bufferView];
    const start = (bv.byteOffset || 0) + (a.byteOffset || 0);
    return { data: new ARRAYS[a.componentType](bin, start, a.count * COMPONENTS[a.type]), min: a.min, max: a.max, count: a.count };
  };
  const parts = [], lo = [Infinity, Infinity, Infinity], hi = [-Infinity, -Infinity, -Infinity];
  for (const mesh of json.meshes || []) {
    for (const primitive of mesh.primitives) {
      const position = accessor(primitive.attributes.POSITION);
      const color = primitive.attributes.COLOR_0 === undefined ? null : accessor(primitive.attributes.COLOR_0);
      const mode = primitive.mode === undefined ? 4 : primitive.mode;
      if (mode !== 0 && mode !== 1) continue;
      parts.push({ mode, position, color });
      if (mode === 0) for (let i = 0; i < 3; i++) { lo[i] = Math.min(lo[i], position.min[i]); hi[i] = Math.max(hi[i], position.max[i]); }
    }
  }
  return { parts, min: lo, max: hi };
}

// ---------------------------------------------------------------------------------------- 4x4 matrices
function perspective(fovY, aspect, near, far) {
  const f = 1 / Math.tan(fovY / 2), nf = 1 / (near - far);
  return [f / aspect, 0, 0, 0, 0, f, 0, 0, 0, 0, (far + near) * nf, -1, 0, 0, 2 * far * near * nf, 0];
}
function sub(a, b) { return [a[0] - b[0], a[1] - b[1], a[2] - b[2]]; }
function cross(a, b) { return [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]]; }
function normalize(a) { const n = Math.hypot(a[0], a[1], a[2]) || 1; return [a[0] / n, a[1] / n, a[2] / n]; }
function dot(a, b) { return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]; }
function lookAt(eye, target, up) {
  const z = normalize(sub(eye, target)), x = normalize(cross(up, z)), y = cross(z, x);
  return [x[0], y[0], z[0], 0, x[1], y[1], z[1], 0, x[2], y[2], z[2], 0, -dot(x, eye), -dot(y, eye), -dot(z, eye), 1];
}
function multiply(a, b) {  // column-major a * b
  const out = new Array(16);
  for (let c = 0; c < 4; c++) for (let r = 0; r < 4; r++) {
    let s = 0;
    for (let k = 0; k < 4; k++) s += a[k * 4 + r] * b[c * 4 + k];
    out[c * 4 + r] = s;
  }
  return out;
}

const VERTEX_SHADER = `#version 300 es
in vec3 position; in vec2 uv; uniform mat4 mvp; uniform float size; out vec2 v_uv;
void main() { v_uv = uv; gl_Position = mvp * vec4(position, 1.0); gl_PointSize = size; }`;
const FRAGMENT_SHADER = `#version 300 es
precision mediump float; in vec2 v_uv; uniform sampler2D tex; out vec4 color;
void main() { color = vec4(texture(tex, v_uv).rgb, 1.0); }`;

// the texture coordinates of the nearest surface, bit for bit, and a hit flag, into an RGBA32UI target
const PICK_FRAGMENT_SHADER = `#version 300 es
precision highp float; in vec2 v_uv; out uvec4 color;
void main() { color = uvec4(floatBitsToUint(v_uv.x), floatBitsToUint(v_uv.y), 1u, 0u); }`;
const CLICK_SLOP_PX = 4, DOUBLE_CLICK_MS = 300;
const MARK_COLORS = [[0.95, 0.2, 0.1, 1], [0.1, 0.45, 0.95, 1]];  // A, B: those of the marks on the maps

const POINT_VERTEX_SHADER = `#version 300 es
in vec3 position; in vec4 color; uniform mat4 mvp; uniform float size; out vec4 v_color;
void main() { v_color = color; gl_Position = mvp * vec4(position, 1.0); gl_PointSize = size; }`;
const POINT_FRAGMENT_SHADER = `#version 300 es
precision mediump float; in vec4 v_color; out vec4 color;
void main() { color = vec4(v_color.rgb, 1.0); }`;

export class MeshViewer {
  constructor(canvas) {
    this.canvas = canvas;
    const gl = canvas.getContext("webgl2", { antialias: true });
    if (!gl) throw new Error("this browser has no WebGL 2: the 3D view cannot be shown (the maps and downloads still work)");
    this.gl = gl;
    this.program = this.#program(VERTEX_SHADER, FRAGMENT_SHADER);
    this.pointProgram = this.#program(POINT_VERTEX_SHADER, POINT_FRAGMENT_SHADER);
    this.pickProgram = this.#program(VERTEX_SHADER, PICK_FRAGMENT_SHADER);
    this.pickTarget = null;
    this.marks = null;
    this.onClick = null;  // (clientX, clientY) of a click on the view: set by the page
    this.mesh = null;
    this.scene = null;
    this.pointMode = false;  // a photo's mesh drawn as its vertices only (setPointMode)
    this.frames = 0;
    this.#bindInput();
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  // A vertex buffer of `data` bound to the attribute `name` of `program`, in the bound vertex array.
  #attribute(program, name, data, size, type, normalized = false) {
    const gl = this.gl, buffer = gl.createBuffer();
    gl.bindBuffer(gl.ARRAY_BUFFER, buffer);
    gl.bufferData(gl.ARRAY_BUFFER, data, gl.STATIC_DRAW);
    const location = gl.getAttribLocation(program, name);
    gl.enableVertexAttribArray(location);
    gl.vertexAttribPointer(location, size, type, normalized, 0, 0);
    return buffer;
  }

  #program(vs, fs) {
    const gl = this.gl, program = gl.createProgram();
    for (const [type, source] of [[gl.VERTEX_SHADER, vs], [gl.FRAGMENT_SHADER, fs]]) {
      const shader = gl.createShader(type);
      gl.shaderSource(shader, source);
      gl.compileShader(shader);
      if (!gl.getShaderParameter(shader, gl.COMPILE_STATUS)) throw new Error(gl.getShaderInfoLog(shader));
      gl.attachShader(program, shader);
    }
    gl.linkProgram(program);
    if (!gl.getProgramParameter(program, gl.LINK_STATUS)) throw new Error(gl.getProgramInfoLog(program));
    return program;
  }

  // Show a parsed GLB (parseGLB). camera: {fovYDeg, distance, wrap}: the photo's vertical field of view and the
  // distance of the orbit centre (the median depth); the first view is from the photo's camera. wrap (a
  // panorama): the texture repeats across u, as glTF's default sampler does, for the seam's faces past u = 1.
  async load(mesh, camera) {
    const gl = this.gl;
    this.clear();
    const vao = gl.createVertexArray();
    gl.bindVertexArray(vao);
    const buffers = [["position", mesh.position, 3], ["uv", mesh.uv, 2]].map(
      ([name, acc, size]) => this.#attribute(this.program, name, acc.data, size, gl.FLOAT));
    const indices = gl.createBuffer();
    gl.bindBuffer(gl.ELEMENT_ARRAY_BUFFER, indices);
    gl.bufferData(gl.ELEMENT_ARRAY_BUFFER, mesh.indices.data, gl.STATIC_DRAW);
    buffers.push(indices);
    gl.bindVertexArray(null);

    const texture = gl.createTexture();
    gl.bindTexture(gl.TEXTURE_2D, texture);
    if (mesh.texture) {
      const bitmap = await createImageBitmap(mesh.texture);
      gl.pixelStorei(gl.UNPACK_ALIGNMENT, 1);
      gl.texImage2D(gl.TEXTURE_2D, 0, gl.RGB, gl.RGB, gl.UNSIGNED_BYTE, bitmap);
      gl.generateMipmap(gl.TEXTURE_2D);
      gl.texParameteri(gl.TEXTURE_2D, gl.TEXTURE_MIN_FILTER, gl.LINEAR_MIPMAP_LINEAR);
      bitmap.close();
    } else {
      gl.texImage2D(gl.TEXTURE_2D, 0, gl.RGB, 1, 1, 0, gl.RGB, gl.UNSIGNED_BYTE, new Uint8Array([160, 160, 160]));
    }
    gl.texParameteri(gl.TEXTURE_2D, gl.TEXTURE_WRAP_S, camera.wrap ? gl.REPEAT : gl.CLAMP_TO_EDGE);
    gl.texParameteri(gl.TEXTURE_2D, gl.TEXTURE_WRAP_T, gl.CLAMP_TO_EDGE);

    const lo = mesh.position.min || [-1, -1, -1], hi = mesh.position.max || [1, 1, 1];
    const extent = Math.hypot(hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2]) || 1;
    const distance = camera.distance > 0 && isFinite(camera.distance) ? camera.distance : Math.max(-lo[2], 1e-3);
    this.mesh = { vao, buffers, texture, count: mesh.indices.count, vertices: mesh.position.count, extent };
    this.home = { fovY: (camera.fovYDeg > 0 ? camera.fovYDeg : 50) * Math.PI / 180, distance,
                  target: [0, 0, -distance], yaw: 0, pitch: 0 };
    this.reset();
  }

  // Show a clip's scene (parseSceneGLB): the cloud as points, the path and frusta as lines. camera: as for
  // load (the first frame's field of view and median depth): the first view is from the first camera.
  loadScene(scene, camera) {
    const gl = this.gl;
    this.clear();
    const parts = [];
    for (const part of scene.parts) {
      const vao = gl.createVertexArray();
      gl.bindVertexArray(vao);
      const buffers = [this.#attribute(this.pointProgram, "position", part.position.data, 3, gl.FLOAT)];
      if (part.color) buffers.push(this.#attribute(this.pointProgram, "color", part.color.data, 4, gl.UNSIGNED_BYTE, true));
      else gl.vertexAttrib4f(gl.getAttribLocation(this.pointProgram, "color"), 0.6, 0.6, 0.6, 1);
      gl.bindVertexArray(null);
      parts.push({ vao, buffers, mode: part.mode === 0 ? gl.POINTS : gl.LINES, count: part.position.count });
    }
    const lo = scene.min, hi = scene.max;
    const extent = isFinite(lo[0]) ? Math.hypot(hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2]) || 1 : 1;
    const distance = camera.distance > 0 && isFinite(camera.distance) ? camera.distance : Math.max(extent / 2, 1e-3);
    this.scene = { parts, extent };
    this.home = { fovY: (camera.fovYDeg > 0 ? camera.fovYDeg : 50) * Math.PI / 180, distance,
                  target: [0, 0, -distance], yaw: 0, pitch: 0 };
    this.reset();
  }

  clear() {
    const gl = this.gl;
    if (this.mesh) {
      gl.deleteVertexArray(this.mesh.vao);
      this.mesh.buffers.forEach((b) => gl.deleteBuffer(b));
      gl.deleteTexture(this.mesh.texture);
    }
    if (this.scene) {
      for (const part of this.scene.parts) {
        gl.deleteVertexArray(part.vao);
        part.buffers.forEach((b) => gl.deleteBuffer(b));
      }
    }
    this.mesh = null;
    this.scene = null;
    this.setMarks([]);
  }

  // The measured points, [x, y, z] in the camera space of tt_moge (x right, y down, z forward; null: none),
  // drawn over the mesh as dots and, for two, the segment between them; [] removes them.
  setMarks(points) {
    const gl = this.gl;
    if (this.marks) { gl.deleteVertexArray(this.marks.vao); this.marks.buffers.forEach((b) => gl.deleteBuffer(b)); }
    this.marks = null;
    const shown = points.map((p, i) => [p, i]).filter(([p]) => p);
    if (shown.length) {
      const position = new Float32Array(shown.flatMap(([p]) => [p[0], -p[1], -p[2]]));  // to the GLB's axes
      const color = new Float32Array(shown.flatMap(([, i]) => MARK_COLORS[i]));
      const vao = gl.createVertexArray();
      gl.bindVertexArray(vao);
      const buffers = [this.#attribute(this.pointProgram, "position", position, 3, gl.FLOAT),
                       this.#attribute(this.pointProgram, "color", color, 4, gl.FLOAT)];
      gl.bindVertexArray(null);
      this.marks = { vao, buffers, count: shown.length };
    }
    this.canvas.dataset.marks = String(shown.length);
    this.draw();
  }

  // The texture coordinates [u, v] (glTF's: v down from the top) of the mesh under the client point (x, y),
  // or null where no face is: the mesh is drawn once more, for that one pixel, into an integer target.
  pickUV(clientX, clientY) {
    if (!this.mesh) return null;
    const gl = this.gl, canvas = this.canvas, rect = canvas.getBoundingClientRect();
    const x = Math.floor((clientX - rect.left) * canvas.width / rect.width);
    const y = canvas.height - 1 - Math.floor((clientY - rect.top) * canvas.height / rect.height);
    if (x < 0 || y < 0 || x >= canvas.width || y >= canvas.height) return null;
    const target = this.#pickTarget(canvas.width, canvas.height);
    gl.bindFramebuffer(gl.FRAMEBUFFER, target.framebuffer);
    gl.viewport(0, 0, canvas.width, canvas.height);
    gl.enable(gl.SCISSOR_TEST);
    gl.scissor(x, y, 1, 1);
    gl.clearBufferuiv(gl.COLOR, 0, new Uint32Array(4));
    gl.clearBufferfi(gl.DEPTH_STENCIL, 0, 1, 0);
    gl.enable(gl.DEPTH_TEST);
    gl.useProgram(this.pickProgram);
    gl.uniformMatrix4fv(gl.getUniformLocation(this.pickProgram, "mvp"), false, new Float32Array(this.#mvp(canvas.width, canvas.height)));
    gl.bindVertexArray(this.mesh.vao);
    gl.drawElements(gl.TRIANGLES, this.mesh.count, gl.UNSIGNED_INT, 0);
    gl.bindVertexArray(null);
    const out = new Uint32Array(4);
    gl.readPixels(x, y, 1, 1, gl.RGBA_INTEGER, gl.UNSIGNED_INT, out);
    gl.disable(gl.SCISSOR_TEST);
    gl.bindFramebuffer(gl.FRAMEBUFFER, null);
    if (!out[2]) return null;
    const uv = new Float32Array(out.buffer, 0, 2);
    return [uv[0], uv[1]];
  }

  #pickTarget(width, height) {
    const gl = this.gl;
    if (this.pickTarget && this.pickTarget.width === width && this.pickTarget.height === height) return this.pickTarget;
    if (this.pickTarget) {
      gl.deleteFramebuffer(this.pickTarget.framebuffer);
      gl.deleteTexture(this.pickTarget.color);
      gl.deleteRenderbuffer(this.pickTarget.depth);
    }
    const color = gl.createTexture();
    gl.bindTexture(gl.TEXTURE_2D, color);
    gl.texStorage2D(gl.TEXTURE_2D, 1, gl.RGBA32UI, width, height);
    const depth = gl.createRenderbuffer();
    gl.bindRenderbuffer(gl.RENDERBUFFER, depth);
    gl.renderbufferStorage(gl.RENDERBUFFER, gl.DEPTH24_STENCIL8, width, height);
    const framebuffer = gl.createFramebuffer();
    gl.bindFramebuffer(gl.FRAMEBUFFER, framebuffer);
    gl.framebufferTexture2D(gl.FRAMEBUFFER, gl.COLOR_ATTACHMENT0, gl.TEXTURE_2D, color, 0);
    gl.framebufferRenderbuffer(gl.FRAMEBUFFER, gl.DEPTH_STENCIL_ATTACHMENT, gl.RENDERBUFFER, depth);
    gl.bindFramebuffer(gl.FRAMEBUFFER, null);
    this.pickTarget = { framebuffer, color, depth, width, height };
    return this.pickTarget;
  }

  // Draw the mesh as its vertices (on: each kept pixel of the mesh's grid as a dot in its colour, no surface
  // between them: what the model measured, without the triangles' interpolation) or as its triangles (off).
  // Picking stays on the triangles: a click between dots still finds the surface there.
  setPointMode(on) {
    this.pointMode = Boolean(on);
    this.canvas.dataset.mode = this.pointMode ? "points" : "mesh";
    this.draw();
  }

  reset() {
    if (!this.home) return;
    this.orbit = { target: [...this.home.target], distance: this.home.distance, yaw: 0, pitch: 0 };
    this.draw();
  }

  draw() {
    if (this.pending) return;
    this.pending = requestAnimationFrame(() => { this.pending = 0; this.#render(); });
  }

  #render() {
    const gl = this.gl, canvas = this.canvas, ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio)), height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
    gl.viewport(0, 0, width, height);
    gl.clearColor(0.94, 0.94, 0.95, 1);
    gl.clear(gl.COLOR_BUFFER_BIT | gl.DEPTH_BUFFER_BIT);
    if (!(this.mesh || this.scene)) return;
    const mvp = this.#mvp(width, height);
    gl.enable(gl.DEPTH_TEST);
    gl.disable(gl.CULL_FACE);
    if (this.scene) {
      gl.useProgram(this.pointProgram);
      gl.uniformMatrix4fv(gl.getUniformLocation(this.pointProgram, "mvp"), false, new Float32Array(mvp));
      gl.uniform1f(gl.getUniformLocation(this.pointProgram, "size"), Math.max(1, Math.round(2 * ratio)));
      for (const part of this.scene.parts) {
        gl.bindVertexArray(part.vao);
        gl.drawArrays(part.mode, 0, part.count);
      }
      gl.bindVertexArray(null);
      this.frames += 1;
      this.canvas.dataset.frames = String(this.frames);
      return;
    }
    gl.useProgram(this.program);
    gl.uniformMatrix4fv(gl.getUniformLocation(this.program, "mvp"), false, new Float32Array(mvp));
    gl.activeTexture(gl.TEXTURE0);
    gl.bindTexture(gl.TEXTURE_2D, this.mesh.texture);
    gl.uniform1i(gl.getUniformLocation(this.program, "tex"), 0);
    gl.uniform1f(gl.getUniformLocation(this.program, "size"), Math.max(1, Math.round(3 * ratio)));  // dots
    gl.bindVertexArray(this.mesh.vao);
    if (this.pointMode) gl.drawArrays(gl.POINTS, 0, this.mesh.vertices);
    else gl.drawElements(gl.TRIANGLES, this.mesh.count, gl.UNSIGNED_INT, 0);
    gl.bindVertexArray(null);
    if (this.marks) this.#drawMarks(mvp, ratio);
    this.frames += 1;
    this.canvas.dataset.frames = String(this.frames);
  }

  #mvp(width, height) {  // the orbit camera's projection x view, for a drawing buffer of width x height
    const o = this.orbit, cp = Math.cos(o.pitch), shown = this.mesh || this.scene;
    const eye = [o.target[0] + o.distance * Math.sin(o.yaw) * cp, o.target[1] + o.distance * Math.sin(o.pitch),
                 o.target[2] + o.distance * Math.cos(o.yaw) * cp];
    const near = Math.max(o.distance * 0.01, 1e-4), far = (o.distance + shown.extent) * 4;
    return multiply(perspective(this.home.fovY, width / height, near, far), lookAt(eye, o.target, [0, 1, 0]));
  }

  #drawMarks(mvp, ratio) {  // over everything: a measured point stays visible behind the surface
    const gl = this.gl;
    gl.disable(gl.DEPTH_TEST);
    gl.useProgram(this.pointProgram);
    gl.uniformMatrix4fv(gl.getUniformLocation(this.pointProgram, "mvp"), false, new Float32Array(mvp));
    gl.uniform1f(gl.getUniformLocation(this.pointProgram, "size"), Math.round(9 * ratio));
    gl.bindVertexArray(this.marks.vao);
    if (this.marks.count === 2) gl.drawArrays(gl.LINES, 0, 2);
    gl.drawArrays(gl.POINTS, 0, this.marks.count);
    gl.bindVertexArray(null);
    gl.enable(gl.DEPTH_TEST);
  }

  #pan(dx, dy) {
    const o = this.orbit, scale = 2 * o.distance * Math.tan(this.home.fovY / 2) / Math.max(1, this.canvas.clientHeight);
    const right = [Math.cos(o.yaw), 0, -Math.sin(o.yaw)];
    const up = [-Math.sin(o.yaw) * Math.sin(o.pitch), Math.cos(o.pitch), -Math.cos(o.yaw) * Math.sin(o.pitch)];
    for (let i = 0; i < 3; i++) o.target[i] += (-dx * right[i] + dy * up[i]) * scale;
  }

  #zoom(factor) {
    this.orbit.distance = Math.min(Math.max(this.orbit.distance * factor, this.home.distance * 1e-3), this.home.distance * 1e3);
  }

  #bindInput() {
    const canvas = this.canvas, pointers = new Map();
    let pinch = 0;
    canvas.addEventListener("contextmenu", (e) => e.preventDefault());
    let clickTimer = 0;
    canvas.addEventListener("pointerdown", (e) => {
      canvas.setPointerCapture(e.pointerId);
      pointers.set(e.pointerId, { x: e.clientX, y: e.clientY, x0: e.clientX, y0: e.clientY, single: pointers.size === 0 && e.button === 0,
                                  pan: e.button === 2 || e.shiftKey });
      if (pointers.size === 2) { const [a, b] = [...pointers.values()]; pinch = Math.hypot(a.x - b.x, a.y - b.y); }
    });
    canvas.addEventListener("pointermove", (e) => {
      const p = pointers.get(e.pointerId);
      if (!p || !(this.mesh || this.scene)) return;
      const dx = e.clientX - p.x, dy = e.clientY - p.y;
      p.x = e.clientX; p.y = e.clientY;
      if (pointers.size === 2) {
        const [a, b] = [...pointers.values()], d = Math.hypot(a.x - b.x, a.y - b.y);
        if (pinch > 0 && d > 0) this.#zoom(pinch / d);
        pinch = d;
      } else if (p.pan) {
        this.#pan(dx, dy);
      } else {
        this.orbit.yaw -= dx * 0.005;
        this.orbit.pitch = Math.min(Math.max(this.orbit.pitch + dy * 0.005, -1.55), 1.55);
      }
      this.draw();
    });
    const up = (e) => { pointers.delete(e.pointerId); pinch = 0; };
    // a click: one button-0 pointer that did not move; reported after DOUBLE_CLICK_MS unless a second click
    // (a double click: back to the first view) comes first
    canvas.addEventListener("pointerup", (e) => {
      const p = pointers.get(e.pointerId);
      up(e);
      if (!p || !p.single || Math.hypot(e.clientX - p.x0, e.clientY - p.y0) > CLICK_SLOP_PX) return;
      if (clickTimer) { clearTimeout(clickTimer); clickTimer = 0; return; }
      const [x, y] = [e.clientX, e.clientY];
      clickTimer = setTimeout(() => { clickTimer = 0; if (this.onClick) this.onClick(x, y); }, DOUBLE_CLICK_MS);
    });
    canvas.addEventListener("pointercancel", up);
    canvas.addEventListener("wheel", (e) => {
      if (!(this.mesh || this.scene)) return;
      e.preventDefault();
      this.#zoom(Math.exp(e.deltaY * 0.001));
      this.draw();
    }, { passive: false });
    canvas.addEventListener("dblclick", () => this.reset());
  }
}
