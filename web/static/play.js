// The worldstream play page: one WebSocket to the gateway (web/page_protocol.py has the message formats).
// No build step: plain browser JavaScript. `window.worldstream` holds what the HUD shows (tests read it too).
"use strict";

// The key names, the limits and the error codes come from the gateway's `hello` (state.hello): none is written here.
const MOUSE_DEG_PER_PX = 0.15; // mouse look sensitivity: degrees of yaw/pitch per pixel of motion
const FRAME_HEADER_BYTES = 16; // kind u8, format u8, header u16, chunk u32, frame u16, frames u16, revision i32
const MIME = { 1: "image/jpeg", 2: "image/webp" };
const KEEP = 2000; // bounded logs: the page never grows without end in a long session

const $ = (id) => document.getElementById(id);
const state = {
  connected: false, hello: null, session: null, opened: null, closed: null, busyTries: 0,
  chunks: [],          // chunk facts as they arrived (bounded), each with the page's input→photon values
  chunkByIndex: new Map(),
  painted: 0, paintLog: [], orderErrors: 0, droppedPage: 0, droppedGateway: { superseded: 0, late: 0 },
  i2p: [], c2o: [], gatewayI2p: [], paintTimes: [], chunkTimes: [], bytes: 0, bytesLog: [],
  errors: [], stats: null, lastApplied: -1,
  drained: null,       // the server's `draining` notice: the session was saved as it stopped
};
window.worldstream = state; // (and `window.worldstream.input`, below)

// ------------------------------------------------------------------------------------------ connection

const params = new URLSearchParams(location.search);
const token = params.get("token");
const shared = params.get("watch") ? { session: params.get("watch"), token: params.get("key") || "" } : null;
let forkOf = params.get("fork"); // a fork link: this tab opens a session restored from it (once: then as any page)
let ws = null;

function connect() {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws` +
    (token ? `?token=${encodeURIComponent(token)}` : "");
  ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => { state.connected = true; setLink("connected", "ok"); updateButtons(); };
  ws.onmessage = (event) => (typeof event.data === "string" ? onText(JSON.parse(event.data)) : onFrame(event.data));
  ws.onclose = async (event) => {
    const wasConnected = state.connected;
    state.connected = false;
    state.session = null;
    updateButtons();
    setLink("disconnected", "bad");
    if (!wasConnected) return diagnose();
    showBanner(`Disconnected from the gateway${event.reason ? `: ${event.reason}` : ""} (code ${event.code}). ` +
      "The session was closed on the server. Reload the page to reconnect.");
  };
}

async function diagnose() {
  // A refused WebSocket tells the page nothing: ask the health check why.
  try {
    const reply = await fetch(`/healthz${token ? `?token=${encodeURIComponent(token)}` : ""}`);
    if (reply.status === 401) return showBanner("Access token missing or wrong: open the URL the gateway printed.");
    if (reply.ok) return showBanner("The gateway refused this page's WebSocket (origin not allowed). Open the page " +
      "from the address the gateway printed, or start it with --allow-origin.");
    showBanner(`The gateway answered ${reply.status}: ${await reply.text()}`);
  } catch (error) {
    showBanner("The gateway is not reachable. Is `python -m web` still running (and the SSH tunnel up)?");
  }
}

function send(message) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message));
}

// ------------------------------------------------------------------------------------------ messages

function onText(message) {
  switch (message.type) {
    case "hello":
      if (!Array.isArray(message.keys) || !message.errors || !message.limits
          || !Number.isFinite(message.limits.max_mouse_degrees)) { // a gateway older than this page
        showBanner("this page is newer than its gateway (its hello lacks the keys and limits): reload the page");
        return;
      }
      state.hello = message; // keys, limits, errors: what this page must not hard-code
      for (const code of Object.keys(ERRORS)) { // wording for a code the gateway never sends is a stale page
        if (!(code in message.errors)) console.warn(`the gateway sends no error code ${code}`);
      }
      if (shared && !state.session) send({ type: "watch", ...shared }); // a share link: watch, read-only
      else if (forkOf && !state.session) fork(forkOf);
      break;
    case "opened": onOpened(message); break;
    case "watching": onOpened({ ...message, watching: true }); break;
    case "chunk": onChunk(message); break;
    case "closed": onClosed(message); break;
    case "stats": state.stats = message; break;
    case "trace": saveTrace(message); break;
    case "prompt": onPrompt(message); break;
    case "saved": onSaved(message); break;
    case "error": onError(message); break;
    case "migrated": showBanner(`the session moved to replica ${message.replica}: it resumes from chunk ${message.chunk}`); break;
    case "draining": onDraining(message); break;
  }
  updateButtons();
  renderHud();
}

function onOpened(message) {
  Object.assign(state, {
    session: message.session, opened: message, closed: null, busyTries: 0, chunks: [], chunkByIndex: new Map(),
    painted: 0, paintLog: [], orderErrors: 0, droppedPage: 0, i2p: [], c2o: [], gatewayI2p: [], paintTimes: [],
    chunkTimes: [], bytes: 0, bytesLog: [], lastApplied: -1, stats: null, prompts: [], watching: !!message.watching,
    missed: 0, saves: [], drained: null,
  });
  forkOf = null; // the fork link's session is open: Start opens new ones from an image
  $("fork").hidden = true; // until this session is saved
  input.reset();
  input.mouseSent = [0, 0];
  const canvas = $("video");
  canvas.width = message.width;
  canvas.height = message.height;
  canvas.style.aspectRatio = `${message.width} / ${message.height}`;
  $("summary").hidden = true;
  hideBanner();
  $("hint").textContent = state.watching ? "Watching a shared session, read-only: its player steers."
    : "Click the video, then hold W/A/S/D and look with the mouse or I/J/K/L.";
  // the share link: anyone with it watches this session read-only (the watch token is unguessable)
  const share = new URLSearchParams({ watch: message.session, key: message.watch_token || "" });
  if (token) share.set("token", token);
  $("share").href = `${location.origin}${location.pathname}?${share}`;
  $("share").hidden = state.watching || !message.watch_token;
  canvas.focus();
  updateButtons();
}

function onChunk(message) {
  const chunk = { ...message, arrived: performance.now(), i2p: [] };
  const previous = state.chunks[state.chunks.length - 1];
  if (previous && chunk.index !== previous.index + 1) state.orderErrors++;
  state.chunks.push(chunk);
  state.chunkByIndex.set(chunk.index, chunk);
  if (state.chunks.length > KEEP) state.chunkByIndex.delete(state.chunks.shift().index);
  state.chunkTimes.push(chunk.arrived);
  state.lastApplied = Math.max(state.lastApplied, chunk.revision);
  if (chunk.control_to_output_s != null) push(state.c2o, chunk.control_to_output_s * 1000);
  for (const value of Object.values(chunk.gateway_input_to_photon_s || {})) push(state.gatewayI2p, value * 1000);
  state.droppedGateway = chunk.dropped;
  state.missed += chunk.missed || 0; // a watcher that fell behind: chunks the server dropped for it
}

function onPrompt(message) {
  state.prompts.push(message);  // revision r is used from chunk message.chunk on (a later one may supersede it)
  showBanner(`New prompt (revision ${message.revision}) from chunk ${message.chunk}.`, true);
}

function showForkLink(snapshot) {
  const link = new URLSearchParams({ fork: snapshot });
  if (token) link.set("token", token);
  $("fork").href = `${location.origin}${location.pathname}?${link}`;
  $("fork").hidden = false; // a snapshot outlives its session: the link stays once the session ends
}

function onDraining(message) {
  // The server stops and no router moves the session: it was saved, and the fork link opens it again once a
  // server serves this gateway (the same snapshot folder).
  state.drained = message;
  showForkLink(message.snapshot);
  showBanner(`The server is stopping. Your world was saved at chunk ${message.chunk}: ` +
    "Fork from the last save resumes it once the server is back.");
}

function onSaved(message) {
  state.saves.push(message); // the newest is what the fork link opens
  if (state.saves.length > 100) state.saves.shift();
  showForkLink(message.snapshot);
  showBanner(`Saved at chunk ${message.chunk} (${(message.bytes / 2 ** 20).toFixed(1)} MiB, the stream paused ` +
    `${Math.round(message.pause_s * 1000)} ms). Fork opens a new tab from there.`, true);
}

function save() {
  if (state.session && !state.watching) send({ type: "save" });
}

function fork(snapshot) {
  // A session restored from a snapshot: the open header alone, no image (the snapshot holds the whole state).
  const header = new TextEncoder().encode(JSON.stringify({
    type: "open", restore: snapshot, live: true, pause_when_idle: $("pause").checked }));
  const message = new Uint8Array(4 + header.length);
  new DataView(message.buffer).setUint32(0, header.length, true);
  message.set(header, 4);
  ws.send(message);
  showBanner("Forking: the server restores the saved session on every stage…", true);
}

function setPrompt() {
  if (!state.session) return;
  const text = JSON.stringify({ type: "prompt", prompt: $("prompt").value });
  const size = new TextEncoder().encode(text).length, limit = state.hello.limits.max_text_bytes;
  if (size > limit) return showBanner(`This prompt is ${size} bytes as sent; the gateway takes up to ${limit}.`);
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(text);
}

function onClosed(message) {
  state.closed = message;
  state.session = null;
  $("share").hidden = true;
  input.reset();
  if (document.pointerLockElement) document.exitPointerLock(); // give the mouse back: nothing to steer now
  updateButtons();
  renderSummary(message);
  const why = { complete: "the session reached its length", client: "stopped", disconnect: "the client went silent",
                failed: "a stage failed", shutdown: "the server shut down",
                unwatched: "you stopped watching",
                drained: state.drained ? "the server stopped; it saved the world first (Fork from the last save " +
                  "resumes it)" : "the server stopped; it saved the world first, and its player can resume it" }[
    message.reason] || message.reason;
  $("hint").textContent = `Session ended: ${why}. Its trace can still be downloaded.`;
}

const ERRORS = {
  busy: (e) => `The server is full: ${e.message}.`,
  bad_image: (e) => `The server could not use this image: ${e.message}. Use a PNG or JPEG.`,
  rank_failed: (e) => `A rank of the server failed and the job is ending: ${e.message}. Restart the server ` +
    "(a Slurm batch job requeues itself); then reload this page.",
  shutdown: (e) => `The server is shutting down: ${e.message}. Start it again, then reload this page.`,
  failed: (e) => `A stage failed for this session: ${e.message}. Other sessions are unaffected; start again.`,
  server_unreachable: (e) => e.message,
  too_large: (e) => `Too large: ${e.message}.`,
  bad_request: (e) => `Refused: ${e.message}.`,
};

function onError(error) {
  state.errors.push(error);
  if (state.errors.length > 100) state.errors.shift();
  if (error.code !== "busy") forkOf = null; // a refused fork (e.g. the snapshot is gone) is not retried
  if (error.code === "busy" && error.retry_after_s != null && state.busyTries < 10) {
    state.busyTries++;
    return retryLater(error, error.retry_after_s);
  }
  // the server's end after a drain is expected: the banner keeps saying the world was saved and how to resume it
  if (state.drained && !state.session && (error.code === "shutdown" || error.code === "server_gone")) return;
  const meaning = state.hello && state.hello.errors[error.code]; // the gateway's words for a code without ours
  const text = (ERRORS[error.code] || ((e) => `${meaning || e.code}: ${e.message}`))(error);
  showBanner(text);
}

let retryTimer = null;
function retryLater(error, seconds) {
  let left = Math.ceil(seconds);
  const tick = () => {
    showBanner(`${ERRORS.busy(error)} Retrying in ${left} s (try ${state.busyTries} of 10)…`, true);
    if (left-- <= 0) { clearInterval(retryTimer); retryTimer = null; start(); }
  };
  clearInterval(retryTimer);
  retryTimer = setInterval(tick, 1000);
  tick();
}

// ------------------------------------------------------------------------------------------ frames
// Latest-frame display: at most one picture decoding and one waiting to be drawn. A newer frame replaces an older
// one that was not drawn yet (counted in `droppedPage`); nothing queues behind a slow page.

let waiting = null;   // newest received frame not yet decoding: {head, blob}
let decoding = false;
let ready = null;     // decoded, not yet drawn: {head, bitmap}

function onFrame(buffer) {
  const view = new DataView(buffer);
  const size = view.getUint16(2, true);
  const head = { chunk: view.getUint32(4, true), frame: view.getUint16(8, true), frames: view.getUint16(10, true),
                 revision: view.getInt32(12, true), bytes: buffer.byteLength };
  state.bytes += buffer.byteLength;
  state.bytesLog.push([performance.now(), buffer.byteLength]);
  if (waiting) state.droppedPage++;
  waiting = { head, blob: new Blob([buffer.slice(size || FRAME_HEADER_BYTES)], { type: MIME[view.getUint8(1)] }) };
  decodeNext();
}

async function decodeNext() {
  if (decoding || !waiting) return;
  const { head, blob } = waiting;
  waiting = null;
  decoding = true;
  try {
    const bitmap = await createImageBitmap(blob);
    if (ready) { state.droppedPage++; ready.bitmap.close(); }
    ready = { head, bitmap };
    requestAnimationFrame(paint);
  } catch (error) {
    state.errors.push({ code: "decode", message: String(error) });
  } finally {
    decoding = false;
    decodeNext();
  }
}

function paint() {
  if (!ready) return;
  const { head, bitmap } = ready;
  ready = null;
  const canvas = $("video");
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  const now = performance.now();
  const last = state.paintLog[state.paintLog.length - 1];
  if (last && (head.chunk < last[0] || (head.chunk === last[0] && head.frame <= last[1]))) state.orderErrors++;
  state.paintLog.push([head.chunk, head.frame]);
  if (state.paintLog.length > KEEP) state.paintLog.shift();
  state.painted++;
  state.paintTimes.push(now);
  // Input-to-photon: every input revision this frame shows for the first time, timed on this page's clock.
  const chunk = state.chunkByIndex.get(head.chunk);
  for (const [revision, sentAt] of input.sent) {
    if (revision > head.revision) break;
    const ms = now - sentAt;
    push(state.i2p, ms);
    if (chunk) chunk.i2p.push({ revision, ms });
    input.sent.delete(revision);
  }
}

// ------------------------------------------------------------------------------------------ input

const input = {
  held: new Set(), taps: new Set(), pressedAt: new Map(), revision: 0, mouse: [0, 0], sent: new Map(),
  mouseSent: [0, 0], // all mouse motion sent in this session (degrees): what the applied chunks must add up to
  reset() {
    const had = this.held.size > 0;
    this.held.clear(); this.taps.clear(); this.pressedAt.clear(); this.mouse = [0, 0];
    if (had && state.session) this.flush(true); // tell the server the keys are up; nothing to say otherwise
    renderKeys();
  },
  // Send the whole state (held keys, taps and mouse motion since the last send) with the next revision.
  flush(force = false) {
    const moved = this.mouse[0] !== 0 || this.mouse[1] !== 0;
    if (!state.session || state.watching || (!force && !moved && this.taps.size === 0)) return;
    const limits = state.hello.limits;
    if (this.revision >= limits.max_revision) return showBanner("This tab sent all the input it may: reload it.");
    const revision = ++this.revision;
    const turn = limits.max_mouse_degrees; // one state's motion on each axis
    const message = { type: "state", keys: [...this.held].sort(), taps: [...this.taps].sort(),
                      mouse: this.mouse.map((v) => Math.max(-turn, Math.min(turn, v))), revision };
    this.taps.clear();
    this.mouse = [0, 0];
    this.mouseSent = this.mouseSent.map((v, i) => v + message.mouse[i]);
    send(message);
    this.sent.set(revision, performance.now());
    if (this.sent.size > 1024) this.sent.delete(this.sent.keys().next().value);
  },
};

state.input = input;

function keyOf(event) {
  const key = event.key.length === 1 ? event.key.toLowerCase() : "";
  const keys = state.hello ? state.hello.keys : []; // the model's key names, from the gateway
  return keys.includes(key) && !event.ctrlKey && !event.metaKey && !event.altKey ? key : null;
}

function typing(event) {
  return ["INPUT", "TEXTAREA"].includes(event.target.tagName);
}

document.addEventListener("keydown", (event) => {
  const key = keyOf(event);
  if (!key || typing(event) || !state.session || state.watching) return;
  event.preventDefault();
  if (event.repeat || input.held.has(key)) return;
  input.held.add(key);
  input.flush(true);
  input.pressedAt.set(key, input.revision);
  renderKeys();
});

document.addEventListener("keyup", (event) => {
  const key = keyOf(event);
  if (!key || !input.held.has(key)) return;
  input.held.delete(key);
  // A press that no chunk has applied yet would be lost between two cuts: send it as a tap, which moves exactly
  // one chunk. (A chunk already in flight may have taken the held key too; it then acts on two chunks.)
  if ((input.pressedAt.get(key) ?? 0) > state.lastApplied) input.taps.add(key);
  input.pressedAt.delete(key);
  input.flush(true);
  renderKeys();
});

window.addEventListener("blur", () => input.reset()); // keys released while away would stay held otherwise

const canvas = () => $("video");
let dragging = null;
document.addEventListener("mousedown", (event) => {
  if (event.target !== canvas() || !state.session) return;
  canvas().focus();
  if (document.pointerLockElement !== canvas()) {
    dragging = { x: event.clientX, y: event.clientY };
    const request = canvas().requestPointerLock?.();
    if (request && request.catch) request.catch(() => {}); // refused (e.g. headless): dragging still looks around
  }
});
document.addEventListener("mouseup", () => { dragging = null; });
document.addEventListener("mousemove", (event) => {
  if (!state.session) return;
  let dx = 0, dy = 0;
  if (document.pointerLockElement === canvas()) {
    dx = event.movementX; dy = event.movementY;
  } else if (dragging) {
    dx = event.clientX - dragging.x; dy = event.clientY - dragging.y;
    dragging = { x: event.clientX, y: event.clientY };
  } else {
    return;
  }
  input.mouse[0] += dx * MOUSE_DEG_PER_PX;
  input.mouse[1] += dy * MOUSE_DEG_PER_PX;
});

// Mouse motion is sent at most once per animation frame (a mouse reports far more often than the model can use).
function inputLoop() {
  input.flush(false);
  requestAnimationFrame(inputLoop);
}

// ------------------------------------------------------------------------------------------ setup

let image = null; // {bytes: ArrayBuffer, name}

async function useFile(file) {
  // the open message holds the image, its JSON header and the header's length (before hello: the gateway checks)
  const limits = state.hello && state.hello.limits;
  const limit = limits ? limits.max_upload_bytes - 4 - limits.max_header_bytes : Infinity;
  if (!["image/png", "image/jpeg"].includes(file.type)) return showBanner(`${file.name}: use a PNG or JPEG image.`);
  if (file.size > limit) return showBanner(`${file.name} is ${(file.size / 2 ** 20).toFixed(1)} MiB; the gateway ` +
    `takes up to ${(limit / 2 ** 20).toFixed(1)} MiB.`);
  image = { bytes: await file.arrayBuffer(), name: file.name };
  $("thumb").src = URL.createObjectURL(file);
  $("drop-text").textContent = `${file.name} (${Math.round(file.size / 1024)} KiB)`;
  hideBanner();
  updateButtons();
}

async function useSample() {
  try {
    const reply = await fetch("/sample.png");
    if (!reply.ok || image) return;
    const blob = await reply.blob();
    image = { bytes: await blob.arrayBuffer(), name: "sample" };
    $("thumb").src = URL.createObjectURL(blob);
    $("drop-text").textContent = "the sample image (drop or pick another)";
    updateButtons();
  } catch (error) { /* no sample: the user picks one */ }
}

function start() {
  if (forkOf && state.connected && !state.session) return fork(forkOf); // a busy server's retry of a fork
  if (!image || !state.connected || state.session) return;
  const seed = Number($("seed").value || 0);
  const chunks = $("chunks").value ? Number($("chunks").value) : null;
  if (!Number.isSafeInteger(seed) || seed < 0) return showBanner("The seed must be a whole number >= 0.");
  if (chunks !== null && (!Number.isSafeInteger(chunks) || chunks < 1)) return showBanner("Chunks must be >= 1.");
  const header = new TextEncoder().encode(JSON.stringify({
    type: "open", prompt: $("prompt").value, seed, num_chunks: chunks, live: true,
    pause_when_idle: $("pause").checked }));
  const message = new Uint8Array(4 + header.length + image.bytes.byteLength);
  new DataView(message.buffer).setUint32(0, header.length, true);
  message.set(header, 4);
  message.set(new Uint8Array(image.bytes), 4 + header.length);
  ws.send(message);
  $("start").disabled = true;
  showBanner("Opening a session: the server prepares every stage's caches…", true);
}

function stop() {
  clearInterval(retryTimer);
  retryTimer = null;
  if (state.session) send({ type: "close" });
}

function saveTrace(message) {
  const blob = new Blob([JSON.stringify(message.trace)], { type: "application/json" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `worldstream-${message.session}.trace.json`;
  document.body.appendChild(link);
  link.click();
  link.remove();
}

// ------------------------------------------------------------------------------------------ HUD

function push(list, value) {
  list.push(value);
  if (list.length > KEEP) list.shift();
}

function quantile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.round(q * (sorted.length - 1)))];
}

function rate(times, windowMs) {
  const now = performance.now();
  while (times.length && times[0] < now - windowMs) times.shift();
  return times.length / (windowMs / 1000);
}

const ms = (v) => (v == null ? "–" : `${Math.round(v)} ms`);

function latencyLine(values, last) {
  if (!values.length) return "–";
  return `${ms(last)} · p50 ${ms(quantile(values, 0.5))} · p90 ${ms(quantile(values, 0.9))} (n=${values.length})`;
}

function renderHud() {
  const last = state.chunks[state.chunks.length - 1];
  const opened = state.opened;
  $("h-session").textContent = opened ? `${opened.session} · ${opened.width}×${opened.height} @ ${opened.fps} fps` +
    (state.session ? "" : " (ended)") : "–";
  $("h-chunk").textContent = last ? `${last.index}${opened && opened.num_chunks ? ` of ${opened.num_chunks}` : ""}` +
    ` · revision ${last.revision}` + (last.steps ? ` · ${last.steps} denoising steps` +
    (last.steps_changed ? ` (${last.steps_changed})` : "") : "") : "–";
  $("h-applied").textContent = last ? `keys ${last.keys.join("").toUpperCase() || "none"} · mouse ` +
    `${last.mouse.map((v) => v.toFixed(1)).join("°, ")}°` : "–";
  const pending = (state.prompts || []).filter((p) => !last || p.chunk > last.index).length;
  const saved = (state.saves || [])[(state.saves || []).length - 1];
  $("h-snapshot").textContent = saved ? `${saved.snapshot} · chunk ${saved.chunk} · ` +
    `${(saved.bytes / 2 ** 20).toFixed(1)} MiB · paused ${Math.round(saved.pause_s * 1000)} ms, written in ` +
    `${Math.round(saved.write_s * 1000)} ms` : (opened && opened.restored ? `forked from ${opened.restored} at chunk ` +
    `${opened.first_chunk}` : "–");
  $("h-prompt").textContent = last ? `revision ${last.prompt_revision || 0}` +
    (pending ? ` · ${pending} change${pending > 1 ? "s" : ""} coming` : "") : "–";
  const painted = rate(state.paintTimes, 2000);
  const chunkRate = rate(state.chunkTimes, 3000);
  const media = opened ? chunkRate * opened.frames_per_chunk / opened.fps : 0;
  $("h-fps").textContent = opened ? `${painted.toFixed(1)} fps shown · ${chunkRate.toFixed(1)} chunks/s ` +
    `(${media.toFixed(1)}× real time)` : "–";
  $("h-c2o").textContent = latencyLine(state.c2o, last && last.control_to_output_s != null
    ? last.control_to_output_s * 1000 : null);
  const lastI2p = state.i2p[state.i2p.length - 1];
  $("h-i2p").textContent = latencyLine(state.i2p, lastI2p) +
    (state.gatewayI2p.length ? ` · at the gateway p50 ${ms(quantile(state.gatewayI2p, 0.5))}` : "");
  const gate = state.droppedGateway || { superseded: 0, late: 0 };
  $("h-dropped").textContent = `${gate.superseded} older frames (a newer chunk came) · ${gate.late} late at the ` +
    `gateway · ${state.droppedPage} in this page · ${state.painted} shown` +
    (state.orderErrors ? ` · ${state.orderErrors} OUT OF ORDER` : "") +
    (state.missed ? ` · ${state.missed} chunks missed (this watcher fell behind)` : "");
  const idle = (state.closed && state.closed.summary && state.closed.summary.dit_idle) ||
    (state.stats && state.stats.session && state.stats.session.dit_idle);
  $("h-idle").textContent = idle ? idleLine(idle) : "–";
  const bytesPerS = state.bytesLog.filter(([t]) => t > performance.now() - 2000).reduce((a, [, b]) => a + b, 0) / 2;
  $("h-bytes").textContent = state.bytes ? `${(bytesPerS / 1024).toFixed(0)} KiB/s · ${(state.bytes / 2 ** 20)
    .toFixed(1)} MiB in all (${state.hello ? state.hello.format : "?"})` : "–";
  while (state.bytesLog.length && state.bytesLog[0][0] < performance.now() - 2000) state.bytesLog.shift();
}

function idleLine(idle) {
  const causes = Object.entries(idle.by_cause || {}).filter(([, c]) => c.count > 0);
  if (!causes.length) return "none";
  return causes.map(([cause, c]) => `${cause} ${(100 * (c.fraction || 0)).toFixed(0)}%`).join(" · ") +
    ` (${(100 * (idle.fraction || 0)).toFixed(0)}% in all)`;
}

function renderSummary(message) {
  const s = message.summary || {};
  const pct = (v) => (v == null ? "–" : `${Math.round(v * 1000)} ms`);
  const lat = s.latency_s || {}, period = s.chunk_period_s || {}, first = s.time_to_first_frame_s || {};
  const rows = [
    ["reason", message.reason + (message.error ? ` (${message.error})` : "")],
    ["chunks · frames", `${s.chunks ?? "–"} · ${s.frames ?? "–"}`],
    ["first frame", `${pct(first.from_open)} from open · ${pct(first.from_first_control)} from the first control`],
    ["control→output", `p50 ${pct(lat.p50)} · p90 ${pct(lat.p90)} · p99 ${pct(lat.p99)}`],
    ["chunk period", `p50 ${pct(period.p50)} · p90 ${pct(period.p90)}`],
    ["real-time factor", s.real_time_factor == null ? "–" : `${s.real_time_factor.toFixed(2)} (below 1 keeps up)`],
    ["DiT idle", s.dit_idle ? idleLine(s.dit_idle) : "–"],
    ["released", s.released ? Object.entries(s.released).map(([k, v]) => `${k} ${v.join(",")}`).join(" · ") : "–"],
  ];
  const list = $("summary-list");
  list.replaceChildren();
  for (const [name, value] of rows) {
    const dt = document.createElement("dt"); dt.textContent = name;
    const dd = document.createElement("dd"); dd.textContent = value;
    list.append(dt, dd);
  }
  $("summary").hidden = false;
}

function renderKeys() {
  for (const kbd of document.querySelectorAll("#help kbd")) {
    kbd.classList.toggle("held", input.held.has(kbd.textContent.toLowerCase()));
  }
}

function setLink(text, kind) {
  const link = $("link");
  link.textContent = text;
  link.className = `pill ${kind}`;
}

function showBanner(text, info = false) {
  $("banner-text").textContent = text;
  $("banner").className = info ? "info" : "";
  $("banner").hidden = false;
  $("banner-retry").hidden = !retryTimer;
}

function hideBanner() { $("banner").hidden = true; }

function updateButtons() {
  $("start").disabled = !(state.connected && image && !state.session);
  $("stop").disabled = !state.session;
  $("set-prompt").disabled = !state.session;
  $("save").disabled = !state.session || state.watching;
  $("trace").disabled = !state.chunks.length;
}

// ------------------------------------------------------------------------------------------ wiring

$("image").addEventListener("change", (event) => event.target.files[0] && useFile(event.target.files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  if (event.dataTransfer.files[0]) useFile(event.dataTransfer.files[0]);
});
$("start").addEventListener("click", () => { state.busyTries = 0; start(); });
$("stop").addEventListener("click", stop);
$("set-prompt").addEventListener("click", setPrompt);
$("save").addEventListener("click", save);
$("trace").addEventListener("click", () => send({ type: "trace" }));
$("banner-close").addEventListener("click", () => { clearInterval(retryTimer); retryTimer = null; hideBanner(); });
$("banner-retry").addEventListener("click", () => { clearInterval(retryTimer); retryTimer = null; start(); });
setInterval(() => { if (state.session) send({ type: "stats" }); }, 2000);
setInterval(renderHud, 250);
connect();
useSample();
requestAnimationFrame(inputLoop);
