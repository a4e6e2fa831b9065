// The replicadp web page (docs/ui.md): submit a request, watch it and the cluster, browse and re-run videos.
// Everything comes from the gateway's /v1 API with the key typed in; no framework, no build step.
"use strict";

const KEY = "replicadp.apiKey";       // sessionStorage: the key stays in this tab
const MINE = "replicadp.requests";    // localStorage: the requests sent from this browser
const POLL_MS = 1000;
const GALLERY_EVERY = 5;              // polls between gallery refreshes (and at once when a request completes)
const KEEP_MINE = 30;
const ENDED = new Set(["completed", "failed", "cancelled", "gone"]);
// The API's `param` -> the input that shows its error (several parameters share one input).
const FIELD_OF = {prompt: "prompt", negative_prompt: "negative_prompt", size: "size", width: "size",
  height: "size", num_frames: "length", seconds: "length", fps: "length", num_inference_steps: "num_inference_steps",
  guidance_scale: "guidance_scale", seed: "seed", priority: "priority", quality: "quality",
  input_reference: "input_reference", loras: "loras"};
const INPUT_OF = {length: "f-length"};  // the others are f-<field>

const $ = (id) => document.getElementById(id);
const state = {needKey: false, status: null, jobs: new Map(), videos: new Map(), polls: 0, detail: null};

class ApiError extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : `HTTP ${status}`);
    this.status = status;
    this.param = error ? error.param : null;
    this.code = error ? error.code : null;
  }
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const res = await fetch(path, {...options, headers});
  if (res.ok) return res;
  let error = null;
  try { error = (await res.json()).error; } catch (_) { /* not OpenAI's error object: the status says it */ }
  if (res.status === 401) askForKey(key ? "The API key was refused" : "This gateway needs an API key");
  throw new ApiError(res.status, error);
}

function askForKey(why) {
  if (state.needKey) return;
  state.needKey = true;
  showAlert(`${why}: enter it in "API key" above and press "Use key".`);
  $("api-key").setAttribute("aria-invalid", "true");
}

function showAlert(text) {
  $("alert").textContent = text;
  $("alert").hidden = !text;
}

function announce(text) {
  $("announce").textContent = text;
}

// --- my requests (localStorage) ----------------------------------------------------------------------------

function mine() {
  try { return JSON.parse(localStorage.getItem(MINE)) || []; } catch (_) { return []; }
}

function saveMine(list) {
  localStorage.setItem(MINE, JSON.stringify(list.slice(0, KEEP_MINE)));
}

function remember(entry) {
  saveMine([entry, ...mine().filter((e) => e.id !== entry.id)]);
}

function update(id, changes) {
  saveMine(mine().map((e) => (e.id === id ? {...e, ...changes} : e)));
}

function short(text, n = 60) {
  return text.length > n ? `${text.slice(0, n - 1)}…` : text;
}

function statusText(entry, job) {
  if (entry.state === "cancelled") return "cancelled";
  if (entry.state === "gone") return "no longer on the gateway";
  if (!job) return entry.state || "queued";
  if (job.status === "failed") return `failed: ${job.error ? job.error.message : "unknown error"}`;
  if (job.status === "in_progress") {
    const running = runningOf(job.id);
    const step = running && running.step != null ? `, step ${running.step} of ${running.total_steps}` : "";
    return `running on ${job.replica || "a replica"}${step} (${job.progress}%)`;
  }
  if (job.status === "completed") return `completed in ${job.inference_time_s.toFixed(1)} s on ${job.replica}`;
  return "queued";
}

function comparison(entry, job) {
  if (!entry.compareTo || !job || job.status !== "completed") return "";
  const same = job.frames_sha256 === entry.compareTo.frames_sha256;
  return same ? `Output matches the original (frames sha256 ${job.frames_sha256.slice(0, 12)}…).`
    : `Output differs from the original: frames sha256 ${job.frames_sha256.slice(0, 12)}… here, ` +
      `${entry.compareTo.frames_sha256.slice(0, 12)}… there.`;
}

function renderMine() {
  // Items are updated in place, never rebuilt: a focused Cancel button keeps its focus across polls.
  const list = mine();
  $("mine-empty").hidden = list.length > 0;
  const ul = $("requests");
  const items = new Map([...ul.children].map((li) => [li.dataset.id, li]));
  const wanted = list.map((entry) => fillItem(items.get(entry.id) || newItem(entry), entry, state.jobs.get(entry.id)));
  wanted.forEach((li, i) => { if (ul.children[i] !== li) ul.insertBefore(li, ul.children[i] || null); });
  for (const li of items.values()) if (!wanted.includes(li)) li.remove();
}

function newItem(entry) {
  const li = document.createElement("li");
  li.dataset.id = entry.id;
  const title = document.createElement("p");
  title.className = "prompt";
  title.textContent = short(entry.prompt);
  const bar = document.createElement("progress");
  bar.max = 100;
  bar.value = 0;
  bar.setAttribute("aria-label", `Progress of "${short(entry.prompt, 40)}"`);
  const status = document.createElement("p");
  status.className = "status";
  const match = document.createElement("p");
  match.className = "match";
  match.hidden = true;
  const actions = document.createElement("div");
  actions.className = "actions";
  li.append(title, bar, status, match, actions);
  return li;
}

function fillItem(li, entry, job) {
  const ended = entry.state === "cancelled" || entry.state === "gone";
  li.dataset.status = ended ? entry.state : job ? job.status : "queued";
  li.querySelector("progress").value = job ? job.progress : 0;
  li.querySelector(".status").textContent = statusText(entry, job);
  const match = li.querySelector(".match");
  match.textContent = comparison(entry, job);
  match.hidden = !match.textContent;
  if (match.textContent) match.dataset.match = String(job.frames_sha256 === entry.compareTo.frames_sha256);
  const live = !ENDED.has(li.dataset.status);
  const completed = job && job.status === "completed";
  const key = `${live}:${completed}`;
  const actions = li.querySelector(".actions");
  if (actions.dataset.key === key) return li;
  actions.dataset.key = key;
  const what = short(entry.prompt, 40);
  actions.replaceChildren();
  if (live) actions.append(button("Cancel", () => cancel(entry), `Cancel "${what}"`, "cancel"));
  if (completed) actions.append(button("View", () => openDetail(state.jobs.get(entry.id)), `View "${what}"`, "view"));
  if (!live) {
    actions.append(button("Remove", () => { saveMine(mine().filter((e) => e.id !== entry.id)); renderMine(); },
      `Remove "${what}" from this list`, "remove"));
  }
  return li;
}

function button(text, onClick, label, cls) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  if (label) b.setAttribute("aria-label", label);
  if (cls) b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

async function cancel(entry) {
  try {
    await api(`/v1/videos/${encodeURIComponent(entry.id)}`, {method: "DELETE"});
    update(entry.id, {state: "cancelled"});
    announce(`Cancelled "${short(entry.prompt, 40)}".`);
  } catch (err) {
    if (err.status === 404) update(entry.id, {state: "gone"});
    else announce(`Could not cancel: ${err.message}`);
  }
  renderMine();
}

async function pollMine() {
  let completed = false;
  await Promise.all(mine().filter((e) => !ENDED.has(e.state)).map(async (entry) => {
    try {
      const job = await (await api(`/v1/videos/${encodeURIComponent(entry.id)}`)).json();
      const before = state.jobs.get(entry.id);
      state.jobs.set(entry.id, job);
      if (ENDED.has(job.status)) {
        update(entry.id, {state: job.status});
        completed = completed || job.status === "completed";
      }
      if (!before || before.status !== job.status) announce(`"${short(entry.prompt, 40)}": ${statusText(entry, job)}.`);
    } catch (err) {
      if (err.status === 404) update(entry.id, {state: "gone"});
    }
  }));
  return completed;
}

async function fillEnded() {
  // Ended requests from an earlier visit: their job once, for the View button and the re-run comparison.
  await Promise.all(mine().filter((e) => e.state === "completed" && !state.jobs.has(e.id)).map(async (e) => {
    try { state.jobs.set(e.id, await (await api(`/v1/videos/${encodeURIComponent(e.id)}`)).json()); }
    catch (err) { if (err.status === 404) update(e.id, {state: "gone"}); }
  }));
}

// --- submitting --------------------------------------------------------------------------------------------

function clearErrors() {
  for (const p of document.querySelectorAll("#video-form .error")) p.textContent = "";
  for (const el of document.querySelectorAll("#video-form [aria-invalid]")) el.removeAttribute("aria-invalid");
}

function showError(err) {
  const field = FIELD_OF[err.param];
  const input = field && $(INPUT_OF[field] || `f-${field}`);
  if (input && !input.closest("[hidden]")) {
    $(`err-${field}`).textContent = err.message;
    input.setAttribute("aria-invalid", "true");
    input.focus();
  } else {
    $("form-error").textContent = `The gateway refused the request: ${err.message}`;
  }
}

// "style:0.8, motion" -> [{name: "style", scale: 0.8}, {name: "motion"}]; a scale that is not a number goes as
// typed, for the gateway to refuse naming the field.
function parseLoras(text) {
  return text.split(",").map((part) => part.trim()).filter(Boolean).map((part) => {
    const [name, scale] = part.split(":").map((x) => x.trim());
    if (scale === undefined) return {name};
    return {name, scale: scale !== "" && !Number.isNaN(Number(scale)) ? Number(scale) : scale};
  });
}

function formData() {
  const data = new FormData();
  const text = (id) => $(id).value.trim();
  for (const name of ["prompt", "negative_prompt", "size", "num_inference_steps", "guidance_scale", "seed", "priority"]) {
    if (text(`f-${name}`) !== "" || name === "prompt") data.append(name, name === "prompt" ? $("f-prompt").value : text(`f-${name}`));
  }
  if (text("f-length") !== "") data.append($("f-length-unit").value, text("f-length"));
  if (!$("quality-field").hidden) data.append("quality", $("f-quality").value);
  if (!$("loras-field").hidden && text("f-loras") !== "") data.append("loras", JSON.stringify(parseLoras(text("f-loras"))));
  const image = $("f-input_reference");
  if (!$("image-field").hidden && image.files.length) data.append("input_reference", image.files[0]);
  return data;
}

async function submit(data, compareTo) {
  const job = await (await api("/v1/videos", {method: "POST", body: data})).json();
  state.jobs.set(job.id, job);
  remember({id: job.id, prompt: job.prompt, created_at: job.created_at, state: "queued", compareTo});
  renderMine();
  announce(`Queued "${short(job.prompt, 40)}".`);
  return job;
}

async function onSubmit(event) {
  event.preventDefault();
  clearErrors();
  const go = $("submit");
  go.disabled = true;
  try {
    await submit(formData(), null);
  } catch (err) {
    if (err.status !== 401) showError(err);
  } finally {
    go.disabled = false;
  }
}

// --- the cluster -------------------------------------------------------------------------------------------

function runningOf(id) {
  const replicas = state.status ? state.status.replicas : [];
  const r = replicas.find((x) => x.running && x.running.id === id);
  return r ? r.running : null;
}

function seconds(s) {
  if (s == null) return "unknown";
  return s < 90 ? `about ${Math.round(s)} s` : `about ${Math.round(s / 60)} min`;
}

function renderStatus() {
  const st = state.status;
  const byPriority = Object.entries(st.queue_by_priority).map(([p, n]) => `${p} ${n}`).join(", ");
  const serving = st.replicas.filter((r) => r.serving).length;
  $("queue").textContent = `${st.queue_depth} waiting (${byPriority}); ${serving} of ${st.replicas.length} replicas serving` +
    (st.mean_request_s != null ? `; a request takes ${st.mean_request_s.toFixed(1)} s on average.` : ".");
  const priority = $("f-priority").value;
  $("wait").textContent = `Expected wait before a new ${priority} request starts: ${seconds(st.expected_wait_s[priority])}.`;
  const rows = st.replicas.map((r) => {
    const tr = document.createElement("tr");
    for (const [label, text] of [["Replica", r.name], ["Device", r.device || "?"], ["Model", r.model || "?"]]) {
      const td = document.createElement("td");
      td.dataset.label = label;
      td.textContent = text;
      tr.append(td);
    }
    const td = document.createElement("td");
    td.dataset.label = "State";
    if (!r.serving) td.textContent = "loading its model";
    else if (!r.running) td.textContent = "idle";
    else if (r.running.id == null) td.textContent = "busy";  // another tenant's request: not named
    else {
      const step = r.running.step != null ? `step ${r.running.step} of ${r.running.total_steps}` : "starting";
      td.textContent = `running ${r.running.id.slice(0, 8)}, ${step}`;
      if (r.running.total_steps) {
        const bar = document.createElement("progress");
        bar.max = r.running.total_steps;
        bar.value = r.running.step || 0;
        bar.setAttribute("aria-label", `Progress on ${r.name}`);
        td.append(document.createElement("br"), bar);
      }
    }
    tr.append(td);
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 4;
    td.textContent = "No live replica: requests wait in the queue until one starts.";
    tr.append(td);
    rows.push(tr);
  }
  $("replicas").tBodies[0].replaceChildren(...rows);
  // Offer what some live replica offers: a first frame (TI2V), a choice of fidelity.
  const multiples = st.replicas.map((r) => r.size_multiple).filter(Boolean);
  $("size-multiple").textContent = multiples.length ? `, multiples of ${Math.max(...multiples)}` : "";
  $("image-field").hidden = !st.replicas.some((r) => r.accepts_image);
  const qualities = [...new Set(st.replicas.filter((r) => r.qualities && r.qualities.length > 1).flatMap((r) => r.qualities))];
  const select = $("f-quality");
  if (qualities.join() !== [...select.options].map((o) => o.value).join()) {
    select.replaceChildren(...qualities.map((q) => new Option(q, q)));
  }
  $("quality-field").hidden = qualities.length === 0;
  const loras = [...new Set(st.replicas.flatMap((r) => r.loras || []))];
  $("loras-available").textContent = loras.join(", ");
  $("loras-field").hidden = loras.length === 0;
}

// --- videos ------------------------------------------------------------------------------------------------

function videoUrl(id) {
  // The <video> element cannot send the key: fetch the MP4 with it and play it from a blob: URL, once per video.
  if (!state.videos.has(id)) {
    const url = api(`/v1/videos/${encodeURIComponent(id)}/content`).then((r) => r.blob()).then((b) => URL.createObjectURL(b));
    url.catch(() => state.videos.delete(id));
    state.videos.set(id, url);
  }
  return state.videos.get(id);
}

function summary(job) {
  const p = job.params || {};
  return [["Seed", job.seed], ["Size", `${job.size}, ${job.num_frames} frames at ${job.fps} fps`],
    ["Steps", p.num_inference_steps], ["Replica", job.replica],
    ["Time", job.stage_durations ? `${job.inference_time_s.toFixed(1)} s inference, ${job.stage_durations.total.toFixed(1)} s total` : null]];
}

function metaList(pairs) {
  const dl = document.createElement("dl");
  dl.className = "meta";
  for (const [name, value] of pairs) {
    if (value == null) continue;
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = String(value);
    dl.append(dt, dd);
  }
  return dl;
}

function card(job) {
  const li = document.createElement("li");
  li.className = "card";
  li.dataset.videoId = job.id;
  const video = document.createElement("video");
  video.controls = true;
  video.loop = true;
  video.muted = true;
  video.playsInline = true;
  video.preload = "auto";
  video.setAttribute("aria-label", `Video: ${short(job.prompt, 80)}`);
  const prompt = document.createElement("p");
  prompt.className = "prompt";
  prompt.textContent = job.prompt;
  const actions = document.createElement("div");
  actions.className = "actions";
  const download = document.createElement("a");
  download.textContent = "Download";
  download.download = `${job.id}.mp4`;
  download.setAttribute("aria-label", `Download "${short(job.prompt, 40)}" (MP4)`);
  actions.append(button("Details", () => openDetail(job), `Details of "${short(job.prompt, 40)}"`, "view"), download);
  li.append(video, prompt, metaList(summary(job)), actions);
  videoUrl(job.id).then((url) => { video.src = url; download.href = url; }, (err) => {
    prompt.textContent = `${job.prompt} (video unavailable: ${err.message})`;
  });
  return li;
}

async function refreshGallery() {
  const list = await (await api("/v1/videos?limit=24")).json();
  const done = list.data.filter((j) => j.status === "completed");
  const ul = $("gallery");
  const cards = new Map([...ul.children].map((li) => [li.dataset.videoId, li]));
  // Existing cards stay where they are (moving a <video> would stop it): new ones go in before them.
  let next = ul.firstElementChild;
  for (const job of done) {
    state.jobs.set(job.id, state.jobs.get(job.id) || job);
    const existing = cards.get(job.id);
    if (existing) { next = existing.nextElementSibling; cards.delete(job.id); continue; }
    ul.insertBefore(card(job), next);
  }
  for (const gone of cards.values()) gone.remove();
  $("gallery-empty").hidden = done.length > 0;
}

// --- one video ---------------------------------------------------------------------------------------------

function rerunForm(job) {
  const p = job.params;
  const data = new FormData();
  data.append("prompt", p.prompt);
  data.append("negative_prompt", p.negative_prompt);
  data.append("seed", String(p.seed));
  data.append("size", `${p.width}x${p.height}`);
  data.append("num_frames", String(p.num_frames));
  data.append("num_inference_steps", String(p.num_inference_steps));
  data.append("guidance_scale", String(p.guidance_scale));
  data.append("fps", String(p.fps));
  if (p.quality != null) data.append("quality", p.quality);
  if (p.loras != null) data.append("loras", JSON.stringify(p.loras));
  return data;
}

function lorasText(loras) {
  return loras.map((l) => `${l.name}:${l.scale}`).join(", ");
}

function openDetail(job) {
  state.detail = job;
  const p = job.params || {};
  $("detail-title").textContent = short(job.prompt, 80);
  const pairs = [["Prompt", job.prompt], ["Negative prompt", p.negative_prompt || "(none)"], ...summary(job),
    ["Guidance", p.guidance_scale], ["Model", job.model], ["Created", new Date(job.created_at * 1000).toLocaleString()],
    ["Queued", job.stage_durations ? `${(job.stage_durations.queued || 0).toFixed(2)} s` : null],
    ["Peak memory", job.peak_memory_mb != null ? `${job.peak_memory_mb} MB` : null],
    ["First frame sha256", p.image_sha256], ["Frames sha256", job.frames_sha256], ["Video sha256", job.video_sha256],
    ["Job id", job.id]];
  if (p.quality != null) pairs.splice(5, 0, ["Fidelity", p.quality]);
  if (p.loras != null) pairs.splice(5, 0, ["LoRA adapters", lorasText(p.loras)]);
  $("detail-meta").replaceChildren(...metaList(pairs).childNodes);
  const rerun = $("rerun");
  rerun.disabled = !job.params || p.image_sha256 != null;
  $("detail-note").textContent = p.image_sha256 != null
    ? "This video started from an uploaded first frame, which the gateway does not keep: copy the inputs to the form and choose the image again." : "";
  $("detail-video").removeAttribute("src");
  videoUrl(job.id).then((url) => { $("detail-video").src = url; $("detail-download").href = url; });
  $("detail-download").download = `${job.id}.mp4`;
  $("detail").showModal();
}

async function rerun() {
  const job = state.detail;
  try {
    await submit(rerunForm(job), {id: job.id, frames_sha256: job.frames_sha256});
    $("detail").close();
    $("requests").querySelector("li button")?.focus();
  } catch (err) {
    $("detail-note").textContent = `The gateway refused the re-run: ${err.message}`;
  }
}

function copyToForm() {
  const p = state.detail.params;
  $("f-prompt").value = p.prompt;
  $("f-negative_prompt").value = p.negative_prompt;
  $("f-size").value = `${p.width}x${p.height}`;
  $("f-length").value = p.num_frames;
  $("f-length-unit").value = "num_frames";
  $("f-num_inference_steps").value = p.num_inference_steps;
  $("f-guidance_scale").value = p.guidance_scale;
  $("f-seed").value = p.seed;
  if (p.quality != null) $("f-quality").value = p.quality;
  $("f-loras").value = p.loras != null ? lorasText(p.loras) : "";
  $("detail").close();
  $("f-prompt").focus();
}

// --- the loop ----------------------------------------------------------------------------------------------

async function poll() {
  if (!state.needKey) {
    try {
      const [status, completed] = await Promise.all([api("/v1/status").then((r) => r.json()), pollMine()]);
      state.status = status;
      renderStatus();
      if (completed || state.polls % GALLERY_EVERY === 0) await refreshGallery();
      state.polls += 1;
      if (!state.needKey) showAlert("");
    } catch (err) {
      if (err.status !== 401) showAlert(`Cannot reach the gateway: ${err.message}. Retrying…`);
    }
    renderMine();
  }
  setTimeout(poll, POLL_MS);
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value.trim());
  $("api-key").removeAttribute("aria-invalid");
  state.needKey = false;
  state.videos.clear();
  showAlert("");
  announce("API key set.");
  fillEnded().then(renderMine);
}

function start() {
  $("api-key").value = sessionStorage.getItem(KEY) || "";
  $("key-form").addEventListener("submit", useKey);
  $("video-form").addEventListener("submit", onSubmit);
  $("random-seed").addEventListener("click", () => {
    $("f-seed").value = crypto.getRandomValues(new Uint32Array(1))[0];
    announce(`Seed set to ${$("f-seed").value}.`);
  });
  $("f-priority").addEventListener("change", () => state.status && renderStatus());
  $("detail-close").addEventListener("click", () => $("detail").close());
  $("detail").addEventListener("close", () => $("detail-video").pause());
  $("rerun").addEventListener("click", rerun);
  $("to-form").addEventListener("click", copyToForm);
  renderMine();
  fillEnded().then(renderMine);
  poll();
}

start();
