// What the page (/ui, ui.js) and a video's page (/ui/videos/<id>, video.js) share (docs/ui.md): the /v1 API with
// the key, "My requests" (localStorage) and how a request's progress reads, all from its job object.
"use strict";

const KEY = "replicadp.apiKey";       // sessionStorage: the key stays in this tab
const MINE = "replicadp.requests";    // localStorage: the requests sent from this browser
const KEEP_MINE = 30;
const POLL_MS = 1000;
const ENDED = new Set(["completed", "failed", "cancelled", "gone"]);
const WORDS = {queued: "queued", preempted: "queued again, to go on", loading_inputs: "loading inputs",
  denoising: "denoising", decoding: "decoding the video",
  encoding: "encoding the MP4", storing: "storing the video", cancelling: "cancelling", completed: "completed",
  failed: "failed", cancelled: "cancelled", gone: "no longer on the gateway"};

const $ = (id) => document.getElementById(id);
const state = {needKey: false, jobs: new Map(), blobs: new Map(), okAt: null, onKey: () => {}, rerender: () => {}};

class ApiError extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : `HTTP ${status}`);
    this.status = status;
    this.param = error ? error.param : null;
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

const json = (path, options) => api(path, options).then((r) => r.json());
const jobPath = (id) => `/v1/videos/${encodeURIComponent(id)}`;

// The key box shows only once the gateway asks for a key (a 401), or while this tab holds one.
function askForKey(why) {
  if (state.needKey) return;
  state.needKey = true;
  $("key-form").hidden = false;
  showAlert(`${why}: enter it in "API key" above and press "Use key".`);
  $("api-key").setAttribute("aria-invalid", "true");
}

function setUpKey(onKey) {
  state.onKey = onKey;
  $("api-key").value = sessionStorage.getItem(KEY) || "";
  $("key-form").hidden = !$("api-key").value;
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").removeAttribute("aria-invalid");
    state.needKey = false;
    state.blobs.clear();
    showAlert("");
    announce("API key set.");
    state.onKey();
  });
}

function showAlert(text) {
  $("alert").textContent = text;
  $("alert").hidden = !text;
}

function announce(text) {
  $("announce").textContent = text;
}

// A file of the API (a poster, an MP4) as a blob: URL, fetched once per page with the key (an <img> or <video>
// cannot send it); the browser's HTTP cache keeps the bytes across pages (Cache-Control: immutable).
function blobUrl(path) {
  if (!state.blobs.has(path)) {
    const url = api(path).then((r) => r.blob()).then((b) => URL.createObjectURL(b));
    url.catch(() => state.blobs.delete(path));
    state.blobs.set(path, url);
  }
  return state.blobs.get(path);
}

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function button(text, onClick, label, cls) {
  const b = el("button", {type: "button", textContent: text, className: cls || ""});
  if (label) b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

function short(text, n = 60) {
  return text.length > n ? `${text.slice(0, n - 1)}…` : text;
}

// 7 -> "7 s", 75 -> "1 min 15 s", 7300 -> "2 h 02 min"
function dur(s) {
  const t = Math.max(0, Math.round(s));
  const two = (n) => String(n).padStart(2, "0");
  const m = Math.round(t / 60);
  if (t >= 3600) return `${Math.floor(m / 60)} h ${two(m % 60)} min`;
  return t < 60 ? `${t} s` : `${Math.floor(t / 60)} min ${two(t % 60)} s`;
}

function about(s) {
  return s == null ? "an unknown time" : s < 1 ? "a moment" : `about ${dur(s)}`;
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

// Where a request is: the job's phase, or (a gateway without phases) what its status implies; "cancelling" from
// the moment the DELETE is answered until the job says it ended.
function phaseOf(entry, job) {
  if (entry.state === "gone") return "gone";
  let phase = job && job.phase;
  if (job && !phase) {
    if (job.status === "failed") phase = job.error && job.error.code === "cancelled" ? "cancelled" : "failed";
    else if (job.status === "in_progress") phase = job.progress > 0 ? "denoising" : "loading_inputs";
    else phase = job.status;
  }
  if (!phase) phase = ENDED.has(entry.state) || entry.state === "cancelling" ? entry.state : "queued";
  return entry.state === "cancelling" && !ENDED.has(phase) ? "cancelling" : phase;
}

function ordinal(n) {
  if (n === 1) return "next in line";
  const s = n % 100 >= 11 && n % 100 <= 13 ? "th" : ({1: "st", 2: "nd", 3: "rd"}[n % 10] || "th");
  return `${n}${s} in line`;
}

function statusText(entry, job) {
  const phase = phaseOf(entry, job);
  const j = job || {};
  const on = j.replica ? ` on ${j.replica}` : "";
  const all = j.elapsed_s != null ? ` · ${dur(j.elapsed_s)} in all` : "";
  switch (phase) {
    case "queued":
      return ["queued", j.queue_position != null ? ordinal(j.queue_position) : null,
        j.expected_start_s != null ? `starts in ${about(j.expected_start_s)}` : null,
        j.elapsed_s != null ? `waiting ${dur(j.elapsed_s)}` : null].filter(Boolean).join(" · ");
    case "preempted":
      return [`queued again · stopped at step ${j.step} of ${j.total_steps}${on} for a request that goes first`,
        j.queue_position != null ? ordinal(j.queue_position) : null,
        "goes on from there"].filter(Boolean).join(" · ");
    case "denoising":
      return `denoising${j.step != null && j.total_steps ? ` · step ${j.step} of ${j.total_steps}` : ""}${on}${all}`;
    case "cancelling":
      return `cancelling…${j.replica ? ` until ${j.replica} stops` : ""}${all}`;
    case "completed": {
      if (!job) return "completed";
      // elapsed_s counts from created_at, a whole second: never shown shorter than the replica's own time
      const took = Math.max(j.elapsed_s || 0, (j.stage_durations || {}).total || 0);
      return `completed in ${dur(took)}` + (j.inference_time_s != null ? ` (${j.inference_time_s.toFixed(1)} s of inference${on})` : on);
    }
    case "failed":
      return `failed: ${j.error ? j.error.message : "unknown error"}`;
    case "cancelled": case "gone":
      return WORDS[phase];
    default:  // loading_inputs, decoding, encoding, storing
      return `${WORDS[phase] || phase}${on}${j.phase_elapsed_s != null ? ` · ${dur(j.phase_elapsed_s)}` : ""}${all}`;
  }
}

// The tab's title while a request of mine runs: "40% · denoising".
function titleOf(entries) {
  const live = entries.map((e) => [e, state.jobs.get(e.id)]).filter(([e]) => !ENDED.has(e.state));
  const running = live.find(([e, j]) => j && j.status === "in_progress") || live[0];
  if (!running) return "";
  const [entry, job] = running;
  const phase = phaseOf(entry, job);
  if (phase === "denoising") return `${job.progress}% · denoising`;
  if (phase === "queued" && job && job.queue_position != null) return `queued #${job.queue_position}`;
  return WORDS[phase] || phase;
}

function comparison(entry, job) {
  if (!entry.compareTo || !job || job.status !== "completed") return "";
  const same = job.frames_sha256 === entry.compareTo.frames_sha256;
  return same ? `Output matches the original (frames sha256 ${job.frames_sha256.slice(0, 12)}…).`
    : `Output differs from the original: frames sha256 ${job.frames_sha256.slice(0, 12)}… here, ` +
      `${entry.compareTo.frames_sha256.slice(0, 12)}… there.`;
}

// Items are updated in place, never rebuilt: a focused Cancel button keeps its focus across polls.
function renderList(ul, entries) {
  const items = new Map([...ul.children].map((li) => [li.dataset.id, li]));
  const wanted = entries.map((entry) => fillItem(items.get(entry.id) || newItem(entry), entry, state.jobs.get(entry.id)));
  wanted.forEach((li, i) => { if (ul.children[i] !== li) ul.insertBefore(li, ul.children[i] || null); });
  for (const li of items.values()) if (!wanted.includes(li)) li.remove();
}

function newItem(entry) {
  const bar = el("progress", {max: 100, value: 0});
  bar.setAttribute("aria-label", `Progress of "${short(entry.prompt, 40)}"`);
  const li = el("li", {}, el("p", {className: "prompt", textContent: short(entry.prompt, 120)}), bar,
    el("p", {className: "status"}), el("p", {className: "match", hidden: true}), el("div", {className: "actions"}));
  li.dataset.id = entry.id;
  return li;
}

function fillItem(li, entry, job) {
  const phase = phaseOf(entry, job);
  li.dataset.phase = phase;
  li.dataset.status = ENDED.has(phase) || phase === "cancelling" ? phase : job ? job.status : "queued";
  const bar = li.querySelector("progress");
  if (["decoding", "encoding", "storing", "cancelling"].includes(phase)) bar.removeAttribute("value");  // busy, no share
  else bar.value = phase === "completed" ? 100 : job && !ENDED.has(phase) ? job.progress : 0;
  li.querySelector(".status").textContent = statusText(entry, job);
  const match = li.querySelector(".match");
  match.textContent = comparison(entry, job);
  match.hidden = !match.textContent;
  if (match.textContent) match.dataset.match = String(job.frames_sha256 === entry.compareTo.frames_sha256);
  const live = !ENDED.has(phase);
  const key = `${live}:${phase === "cancelling"}:${phase === "completed"}`;
  const actions = li.querySelector(".actions");
  if (actions.dataset.key === key) return li;
  actions.dataset.key = key;
  const what = short(entry.prompt, 40);
  actions.replaceChildren();
  if (live && phase !== "cancelling") actions.append(button("Cancel", () => cancel(entry), `Cancel "${what}"`, "cancel"));
  if (phase === "completed") {
    const view = el("a", {className: "button view", href: `/ui/videos/${encodeURIComponent(entry.id)}`, textContent: "View"});
    view.setAttribute("aria-label", `View "${what}"`);
    actions.append(view);
  }
  if (!live) {
    actions.append(button("Remove", () => { saveMine(mine().filter((e) => e.id !== entry.id)); state.rerender(); },
      `Remove "${what}" from this list`, "remove"));
  }
  return li;
}

async function cancel(entry) {
  try {
    await api(jobPath(entry.id), {method: "DELETE"});
    update(entry.id, {state: "cancelling"});
    announce(`Cancelling "${short(entry.prompt, 40)}".`);
  } catch (err) {
    if (err.status === 404) update(entry.id, {state: "gone"});
    else announce(`Could not cancel: ${err.message}`);
  }
  state.rerender();
}

// Polls the jobs of `entries` that have not ended; true when one of them completed.
async function pollEntries(entries) {
  let completed = false;
  await Promise.all(entries.filter((e) => !ENDED.has(e.state)).map(async (entry) => {
    try {
      const job = await json(jobPath(entry.id));
      const before = phaseOf(entry, state.jobs.get(entry.id));
      state.jobs.set(entry.id, job);
      const phase = phaseOf(entry, job);
      if (ENDED.has(phase)) {
        update(entry.id, {state: phase});
        completed = completed || phase === "completed";
      }
      if (before !== phase) announce(`"${short(entry.prompt, 40)}": ${statusText({...entry, state: phase}, job)}.`);
    } catch (err) {
      if (err.status === 404) update(entry.id, {state: entry.state === "cancelling" ? "cancelled" : "gone"});
      else throw err;
    }
  }));
  return completed;
}

// Completed requests from an earlier visit that a re-run is compared with: their job, once.
async function fillCompared(entries) {
  await Promise.all(entries.filter((e) => e.compareTo && e.state === "completed" && !state.jobs.has(e.id)).map(async (e) => {
    try { state.jobs.set(e.id, await json(jobPath(e.id))); } catch (err) { if (err.status === 404) update(e.id, {state: "gone"}); }
  }));
}

async function submit(data, compareTo) {
  const job = await json("/v1/videos", {method: "POST", body: data});
  state.jobs.set(job.id, job);
  remember({id: job.id, prompt: job.prompt, created_at: job.created_at, state: "queued", compareTo});
  announce(`Queued "${short(job.prompt, 40)}".`);
  state.rerender();
  return job;
}

// The page's "Last updated" line and greyed sections while the gateway does not answer.
function markFresh(ok, sections, note) {
  if (ok) state.okAt = Date.now();
  const stale = !ok && state.okAt != null;
  for (const s of sections) s.classList.toggle("stale", stale);
  if (note) {
    note.hidden = !stale;
    note.textContent = stale ? `Last updated ${dur((Date.now() - state.okAt) / 1000)} ago: the gateway does not answer.` : "";
  }
}
