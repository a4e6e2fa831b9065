// What the page (/ui, ui.js) and a video's page (/ui/videos/<id>, video.js) share (docs/ui.md): the /v1 API with
// the key, "My requests" (localStorage), how a request's progress reads (from its job object and its model's recent
// pace), and a video's poster that plays in place.
"use strict";

const KEY = "replicadp.apiKey";       // sessionStorage: the key stays in this tab
const MINE = "replicadp.requests";    // localStorage: the requests sent from this browser
const KEEP_MINE = 30;
const POLL_MS = 1000;
const ENDED = new Set(["completed", "failed", "cancelled", "gone"]);
const AFTER_STEPS = new Set(["decoding", "encoding", "storing"]);
const WORDS = {queued: "queued", preempted: "queued again, to go on", loading_inputs: "loading inputs",
  denoising: "denoising", decoding: "decoding the video",
  encoding: "encoding the MP4", storing: "storing the video", cancelling: "cancelling", completed: "completed",
  failed: "failed", cancelled: "cancelled", gone: "no longer on the gateway"};

const $ = (id) => document.getElementById(id);
// jobs: the last job object fetched per id; models: /v1/status's per model (pace, after-steps time, final);
// bars: the highest share each request's bar has shown; paces: what a request's steps told of its length.
const state = {needKey: false, jobs: new Map(), blobs: new Map(), models: new Map(), bars: new Map(),
  paces: new Map(), okAt: null, onKey: () => {}, rerender: () => {}};

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
const usesKey = () => !!sessionStorage.getItem(KEY);

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

// A poster of the API as a blob: URL, fetched once per page with the key (an <img> cannot send it); the browser's
// HTTP cache keeps the bytes across pages (Cache-Control: immutable).
function blobUrl(path) {
  if (!state.blobs.has(path)) {
    const url = api(path).then((r) => r.blob()).then((b) => URL.createObjectURL(b));
    url.catch(() => state.blobs.delete(path));
    state.blobs.set(path, url);
  }
  return state.blobs.get(path);
}

// Where an <img> reads a poster: without a key, its URL; with one, a blob: URL fetched with it.
function posterUrl(job) {
  const path = `${jobPath(job.id)}/poster`;
  return usesKey() ? blobUrl(path) : Promise.resolve(path);
}

// Where a <video> reads a job's MP4: without a key, its URL; with one (a <video> cannot send it), a link the key
// signed (GET /v1/videos/<id>/links). Either way the browser streams it with range requests and plays it as it
// comes, rather than waiting for the whole file.
function videoUrl(job) {
  return usesKey() ? json(`${jobPath(job.id)}/links`).then((links) => links.content)
    : Promise.resolve(`${jobPath(job.id)}/content`);
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

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

// How long a request took: tenths under 10 s (a tiny model's request takes a fraction of a second).
const took = (s) => (s < 10 ? `${s.toFixed(1)} s` : dur(s));

function about(s) {
  return s == null ? "an unknown time" : s < 1 ? "a moment" : `about ${dur(s)}`;
}

// When a video was made, to tell apart two of one prompt: "14:05" today, "3 Dec 14:05" before.
function madeAt(unix) {
  const d = new Date(unix * 1000);
  const time = d.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"});
  if (d.toDateString() === new Date().toDateString()) return time;
  return `${d.toLocaleDateString([], {day: "numeric", month: "short"})} ${time}`;
}

// --- a video's poster, played in place on a click (the MP4 fetched only then) ---------------------------------

function thumb(job, onError) {
  const [w, h] = job.size.split("x").map(Number);
  const img = el("img", {alt: "", width: w, height: h, decoding: "async"});
  const box = el("button", {type: "button", className: "thumb"}, img,
    el("span", {className: "play", textContent: "▶"}));
  box.style.aspectRatio = `${w} / ${h}`;
  box.style.setProperty("--ratio", w / h);
  const label = (verb) => box.setAttribute("aria-label", `${verb} "${short(job.prompt, 60)}"`);
  label("Play");
  box.addEventListener("click", () => playIn(box, job, label).catch((err) => onError(err.message)));
  posterUrl(job).then((url) => { img.src = url; }, () => img.remove());
  return box;
}

async function playIn(box, job, label) {
  let video = box.querySelector("video");
  if (!video) {
    box.setAttribute("aria-busy", "true");
    let src;
    try {
      src = await videoUrl(job);
    } finally {
      box.removeAttribute("aria-busy");
    }
    video = el("video", {muted: true, loop: true, playsInline: true, preload: "auto", src});
    const img = box.querySelector("img");
    if (img) { video.poster = img.src; img.remove(); }
    video.addEventListener("play", () => { box.classList.add("playing"); label("Pause"); });
    video.addEventListener("pause", () => { box.classList.remove("playing"); label("Play"); });
    box.prepend(video);
  }
  if (video.paused) video.play().catch(() => {}); else video.pause();
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

const stored = (entry) => mine().find((e) => e.id === entry.id) || entry;  // as saved now (another call may have)

// Where a request is: the job's phase, or (a gateway without phases) what its status implies; "cancelling" from
// the moment the DELETE is answered until the job says it ended. Once the list says a request ended, that stands:
// a job fetched before (queued, say) is never shown over it.
function phaseOf(entry, job) {
  if (entry.state === "gone") return "gone";
  let phase = job && job.phase;
  if (job && !phase) {
    if (job.status === "failed") phase = job.error && job.error.code === "cancelled" ? "cancelled" : "failed";
    else if (job.status === "in_progress") phase = job.progress > 0 ? "denoising" : "loading_inputs";
    else phase = job.status;
  }
  if (!phase) phase = ENDED.has(entry.state) || entry.state === "cancelling" ? entry.state : "queued";
  if (ENDED.has(entry.state) && !ENDED.has(phase)) return entry.state;
  return entry.state === "cancelling" && !ENDED.has(phase) ? "cancelling" : phase;
}

function ordinal(n) {
  if (n === 1) return "next in line";
  const s = n % 100 >= 11 && n % 100 <= 13 ? "th" : ({1: "st", 2: "nd", 3: "rd"}[n % 10] || "th");
  return `${n}${s} in line`;
}

// How far a running request is, as a share of its time on the replica: its steps at their own pace (the
// denoising phase begins as the first step ends), then what follows the last step (decode, encode, store) as long
// as it took lately on its model (/v1/status's after_steps_s; unknown: the steps fill 90% and the rest creeps).
// Never less than the page showed before. {value: 0-99, left: seconds to go, or null}.
function progressOf(entry, job) {
  const phase = phaseOf(entry, job);
  if (!job || !(phase === "loading_inputs" || phase === "denoising" || AFTER_STEPS.has(phase))) {
    return {value: phase === "completed" ? 100 : 0, left: null};
  }
  const after = (state.models.get(job.model) || {}).after_steps_s;
  const memo = state.paces.get(job.id) || {};
  const now = Date.now() / 1000;
  let value = 0, left = null;
  if (phase === "denoising" && job.step && job.total_steps) {
    const pace = job.step > 1 && job.phase_elapsed_s ? job.phase_elapsed_s / (job.step - 1) : null;
    if (pace) memo.steps = pace * job.total_steps;
    const share = job.step / job.total_steps;
    const stepsLeft = pace ? pace * (job.total_steps - job.step) : null;
    if (memo.steps && after != null) {
      value = 100 * memo.steps * share / (memo.steps + after);
      left = stepsLeft + after;
    } else {
      value = 90 * share;
      left = stepsLeft;
      memo.stepsOnly = true;
    }
  } else if (AFTER_STEPS.has(phase)) {
    if (memo.since == null) memo.since = now - (phase === "decoding" ? job.phase_elapsed_s || 0 : 0);
    const t = now - memo.since;
    if (after) {
      const base = memo.steps ? memo.steps / (memo.steps + after) : 0.9;
      value = 100 * (base + (1 - base) * Math.min(0.97, t / after));
      left = Math.max(0, after - t);
    } else {
      value = 90 + 9 * (1 - Math.exp(-t / 20));
    }
  }
  state.paces.set(job.id, memo);
  value = Math.min(99, Math.max(value, state.bars.get(job.id) || 0));
  state.bars.set(job.id, value);
  return {value, left, stepsOnly: !!memo.stepsOnly && phase === "denoising"};
}

function leftText(p) {
  if (p.left == null) return "";
  if (p.left < 1) return " · finishing";
  return ` · about ${dur(p.left)} ${p.stepsOnly ? "of steps " : ""}left`;
}

function statusText(entry, job, p = progressOf(entry, job)) {
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
      return `denoising${j.step != null && j.total_steps ? ` · step ${j.step} of ${j.total_steps}` : ""}${on}` +
        `${leftText(p)}${all}`;
    case "cancelling":
      return `cancelling…${j.replica ? ` until ${j.replica} stops` : ""}${all}`;
    case "completed": {
      // elapsed_s counts from created_at, a whole second: never shown shorter than the replica's own time
      const s = job ? Math.max(j.elapsed_s || 0, (j.stage_durations || {}).total || 0) : entry.took;
      const inference = job ? j.inference_time_s : entry.inference;
      const where = job ? on : entry.replica ? ` on ${entry.replica}` : "";
      if (s == null) return "completed";
      return `completed in ${took(s)}` +
        (inference != null ? ` (${inference.toFixed(1)} s of inference${where})` : where);
    }
    case "failed":
      return `failed: ${j.error ? j.error.message : "unknown error"}`;
    case "cancelled": case "gone":
      return WORDS[phase];
    default:  // loading_inputs, decoding, encoding, storing
      return `${WORDS[phase] || phase}${on}${j.phase_elapsed_s != null ? ` · ${dur(j.phase_elapsed_s)}` : ""}` +
        `${leftText(p)}${all}`;
  }
}

// What a request asked for, in a line: "interactive · 64x64 · 9 frames · 2 steps · tiny" (a preview or a final says
// which it is).
function askedText(entry, job) {
  const j = job || {};
  const steps = (j.params && j.params.num_inference_steps) || entry.steps;
  const frames = j.num_frames || entry.frames;
  return [entry.finalOf ? "final" : entry.final ? "preview" : null, j.priority || entry.priority, j.size || entry.size,
    frames && plural(frames, "frame"), steps && plural(steps, "step"),
    state.models.size > 1 ? j.model || entry.model : null].filter(Boolean).join(" · ");
}

// The tab's title while a request of mine runs: "40% · denoising".
function titleOf(entries) {
  const live = entries.map((e) => [e, state.jobs.get(e.id)]).filter(([e, j]) => !ENDED.has(phaseOf(e, j)));
  const running = live.find(([, j]) => j && j.status === "in_progress") || live[0];
  if (!running) return "";
  const [entry, job] = running;
  const phase = phaseOf(entry, job);
  if (phase === "queued" && job && job.queue_position != null) return `queued #${job.queue_position}`;
  if (phase === "denoising" || AFTER_STEPS.has(phase)) {
    return `${Math.round(progressOf(entry, job).value)}% · ${WORDS[phase]}`;
  }
  return WORDS[phase] || phase;
}

function comparison(entry, job) {
  if (!entry.compareTo || !job || job.status !== "completed") return "";
  const same = job.frames_sha256 === entry.compareTo.frames_sha256;
  return same ? `Output matches the original (frames sha256 ${job.frames_sha256.slice(0, 12)}…).`
    : `Output differs from the original: frames sha256 ${job.frames_sha256.slice(0, 12)}… here, ` +
      `${entry.compareTo.frames_sha256.slice(0, 12)}… there.`;
}

// My requests in the order they run: running first, then queued in queue order, then the ended ones, newest first.
function inRunOrder(entries) {
  const rank = (e) => {
    const job = state.jobs.get(e.id);
    const phase = phaseOf(e, job);
    if (ENDED.has(phase)) return [2, -(e.created_at || 0)];
    if (phase !== "queued" && phase !== "preempted") return [0, e.created_at || 0];
    return [1, job && job.queue_position != null ? job.queue_position : Infinity, e.created_at || 0];
  };
  const ranks = new Map(entries.map((e) => [e.id, rank(e)]));
  const cmp = (a, b) => a.reduce((c, x, i) => c || (x < b[i] ? -1 : x > b[i] ? 1 : 0), 0);
  return [...entries].sort((a, b) => cmp(ranks.get(a.id), ranks.get(b.id)));
}

// Items are updated in place, never rebuilt: a focused Cancel button keeps its focus across polls.
function renderList(ul, entries) {
  const items = new Map([...ul.children].map((li) => [li.dataset.id, li]));
  const wanted = entries.map((entry) =>
    fillItem(items.get(entry.id) || newItem(entry), entry, state.jobs.get(entry.id)));
  wanted.forEach((li, i) => { if (ul.children[i] !== li) ul.insertBefore(li, ul.children[i] || null); });
  for (const li of items.values()) if (!wanted.includes(li)) li.remove();
}

function newItem(entry) {
  const bar = el("progress", {max: 100, value: 0});
  bar.setAttribute("aria-label", `Progress of "${short(entry.prompt, 40)}"`);
  const li = el("li", {}, el("p", {className: "prompt", textContent: short(entry.prompt, 120)}),
    el("p", {className: "asked hint"}), bar, el("p", {className: "status"}), el("div", {className: "media"}),
    el("p", {className: "match", hidden: true}), el("div", {className: "actions"}));
  li.dataset.id = entry.id;
  return li;
}

function fillItem(li, entry, job) {
  const phase = phaseOf(entry, job);
  const p = progressOf(entry, job);
  li.dataset.phase = phase;
  li.dataset.status = ENDED.has(phase) || phase === "cancelling" ? phase : job ? job.status : "queued";
  li.querySelector(".asked").textContent = askedText(entry, job);
  const bar = li.querySelector("progress");
  bar.hidden = ENDED.has(phase) && phase !== "completed";
  if (phase === "cancelling") bar.removeAttribute("value");  // busy: it stops at its next step, or once stored
  else bar.value = p.value;
  li.querySelector(".status").textContent = statusText(entry, job, p);
  const match = li.querySelector(".match");
  match.textContent = comparison(entry, job);
  match.hidden = !match.textContent;
  if (match.textContent) match.dataset.match = String(job.frames_sha256 === entry.compareTo.frames_sha256);
  const media = li.querySelector(".media");
  if (phase === "completed" && !media.firstChild && (job || entry.size)) {  // the result where the request was
    const shown = job || {id: entry.id, prompt: entry.prompt, size: entry.size};
    media.append(thumb(shown, (why) => { li.querySelector(".status").textContent = `Video unavailable: ${why}`; }));
  }
  const final = finalOf(entry, job);
  const live = !ENDED.has(phase);
  const key = `${live}:${phase === "cancelling"}:${phase === "completed"}:${final}:${entry.final || ""}`;
  const actions = li.querySelector(".actions");
  if (actions.dataset.key === key) return li;
  actions.dataset.key = key;
  const what = short(entry.prompt, 40);
  actions.replaceChildren();
  if (live && phase !== "cancelling") {
    actions.append(button("Cancel", () => cancel(entry), `Cancel "${what}"`, "cancel"));
  }
  if (phase === "completed") {
    const view = el("a", {className: "button view", href: `/ui/videos/${encodeURIComponent(entry.id)}`,
      textContent: "View"});
    view.setAttribute("aria-label", `View "${what}"`);
    actions.append(view);
    if (final && !entry.final) {
      actions.append(button(`Make the final (${final})`, () => makeFinal(entry, job, final),
        `Make the final of "${what}" on ${final}: the same prompt, seed and size`, "final primary"));
    }
  }
  if (!live) {
    actions.append(button("Remove", () => { saveMine(mine().filter((e) => e.id !== entry.id)); state.rerender(); },
      `Remove "${what}" from this list`, "remove"));
  }
  return li;
}

// The exact model that makes the final of a preview made on a few-step model (/v1/status's `final`), if any.
function finalOf(entry, job) {
  const model = (job && job.model) || entry.model;
  return phaseOf(entry, job) === "completed" && model ? (state.models.get(model) || {}).final || null : null;
}

// The request that makes a preview's final: its prompt, negative prompt, size, length and seed on `model`, whose
// own steps and guidance it gets (they are left out).
function finalForm(job, model) {
  const p = job.params || {};
  const data = new FormData();
  for (const [k, v] of [["prompt", p.prompt], ["negative_prompt", p.negative_prompt || ""],
    ["size", `${p.width}x${p.height}`], ["num_frames", p.num_frames], ["fps", p.fps], ["seed", p.seed],
    ["priority", job.priority || "normal"], ["model", model]]) if (v !== "" && v != null) data.append(k, String(v));
  return data;
}

async function makeFinal(entry, job, model) {
  job = job || await json(jobPath(entry.id));
  try {
    const sent = await submit(finalForm(job, model), {finalOf: entry.id, steps: null});
    update(entry.id, {final: sent.id});
    announce(`The final of "${short(entry.prompt, 40)}" is queued on ${model}.`);
  } catch (err) {
    if (err.status !== 401) announce(`The gateway refused the final: ${err.message}`);
  }
  state.rerender();
}

async function cancel(entry) {
  try {
    await api(jobPath(entry.id), {method: "DELETE"});
    if (!ENDED.has(stored(entry).state)) update(entry.id, {state: "cancelling"});
    announce(`Cancelling "${short(entry.prompt, 40)}".`);
  } catch (err) {
    if (err.status === 404) update(entry.id, {state: "gone"});
    else announce(`Could not cancel: ${err.message}`);
  }
  state.rerender();
}

// Polls the jobs of `entries` that have not ended; true when one of them completed. A job that ends leaves its
// summary in the list (how long it took), which a later visit shows without asking again.
async function pollEntries(entries) {
  let completed = false;
  await Promise.all(entries.filter((e) => !ENDED.has(e.state)).map(async (entry) => {
    try {
      const job = await json(jobPath(entry.id));
      const before = phaseOf(entry, state.jobs.get(entry.id));
      const now = stored(entry);  // a cancel may have been answered while this GET was on its way
      if (ENDED.has(now.state)) return;
      state.jobs.set(entry.id, job);
      const phase = phaseOf(now, job);
      if (ENDED.has(phase)) {
        update(entry.id, {state: phase, ...summary(job)});
        completed = completed || phase === "completed";
      }
      if (before !== phase) announce(`"${short(entry.prompt, 40)}": ${statusText({...now, state: phase}, job)}.`);
    } catch (err) {
      if (err.status !== 404) throw err;
      state.jobs.delete(entry.id);
      const was = stored(entry).state;  // a queued job cancelled is forgotten at once: 404
      if (!ENDED.has(was)) update(entry.id, {state: was === "cancelling" ? "cancelled" : "gone"});
    }
  }));
  return completed;
}

function summary(job) {
  if (job.status !== "completed") return {};
  return {took: Math.max(job.elapsed_s || 0, (job.stage_durations || {}).total || 0), inference: job.inference_time_s,
    replica: job.replica, size: job.size, frames: job.num_frames, model: job.model,
    steps: job.params ? job.params.num_inference_steps : undefined};
}

// Completed requests from an earlier visit whose job a re-run is compared with: their job, once.
async function fillCompared(entries) {
  const unread = entries.filter((e) => e.compareTo && e.state === "completed" && !state.jobs.has(e.id));
  await Promise.all(unread.map(async (e) => {
    try {
      state.jobs.set(e.id, await json(jobPath(e.id)));
    } catch (err) {
      if (err.status === 404) update(e.id, {state: "gone"});
    }
  }));
}

// Send a request; `extra`: what the list keeps with it (what it was compared with, whose final it is, its steps).
async function submit(data, extra = {}) {
  const job = await json("/v1/videos", {method: "POST", body: data});
  state.jobs.set(job.id, job);
  remember({id: job.id, prompt: job.prompt, created_at: job.created_at, state: "queued", model: job.model,
    size: job.size, frames: job.num_frames, priority: job.priority, ...extra});
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
    note.textContent = stale
      ? `Last updated ${dur((Date.now() - state.okAt) / 1000)} ago: the gateway does not answer.` : "";
  }
}
