// The page /ui (docs/ui.md): send a request, watch it and the cluster, browse the videos. Needs common.js.
"use strict";

const GALLERY_EVERY = 5;  // polls between gallery refreshes (and at once when a request of mine completes)
const PAGE = 12;          // videos per gallery page ("Load more" asks for the next)
const SHOW_MINE = 8;      // "My requests" shown before "Show all"
const EXAMPLES = [["fox in snow", "a red fox trotting through fresh snow at dawn"],
  ["waves", "waves breaking on a rocky shore, slow motion"], ["paper boat", "a paper boat drifting down a rain gutter"],
  ["balloon", "a hot-air balloon rising over misty hills at sunrise"]];
const PRESETS = [["480p landscape", 832, 480], ["720p", 1280, 704], ["portrait", 480, 832], ["square", 512, 512]];
// What the gateway fills in for what a request leaves out, until /v1/status says (its `defaults`, per model).
const FALLBACK = {size: "832x480", num_frames: 33, num_inference_steps: 30, guidance_scale: 5.0, fps: 24};
const LABEL = {prompt: "Prompt", negative_prompt: "Negative prompt", size: "Size", length: "Length",
  num_inference_steps: "Steps", guidance_scale: "Guidance", seed: "Seed", priority: "Priority", quality: "Fidelity",
  loras: "LoRA adapters", input_reference: "First frame", model: "Model"};
// The API's `param` -> the field that shows its error (several parameters share one field).
const FIELD_OF = {width: "size", height: "size", num_frames: "length", seconds: "length", fps: "length"};
const CHECKED = ["prompt", "size", "length", "num_inference_steps", "guidance_scale", "seed", "loras"];
const INT = /^[+-]?\d+$/;
const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)$/;

const ui = {status: null, polls: 0, showAll: false, cursor: undefined, hasMore: false, touched: new Set(),
  defaulted: null, gallery: new Map()};

// --- the form ----------------------------------------------------------------------------------------------

const custom = () => $("f-size-preset").value === "custom";
const sizeText = () => (custom() ? $("f-size").value.trim() : $("f-size-preset").value);
const models = () => (ui.status && ui.status.models) || [];
// The model the form sends to: the one chosen, else the deployment's default (or its only one).
const chosen = () => models().find((m) => m.id === $("f-model").value) || null;
const defaults = () => ({...FALLBACK, ...((chosen() || {}).defaults || (ui.status && ui.status.defaults) || {})});

function inputOf(field) {
  if (field === "size") return custom() ? $("f-size") : $("f-size-preset");
  return $(field === "length" ? "f-length" : `f-${field}`);
}

// The live replicas of the model the form sends to (all of them while the page knows no model).
function replicasOf() {
  const all = ui.status ? ui.status.replicas : [];
  const model = chosen();
  return model ? all.filter((r) => r.model === model.id) : all;
}

function multiple() {
  const all = replicasOf().map((r) => r.size_multiple).filter(Boolean);
  return all.length ? Math.max(...all) : null;
}

function presets() {
  // The labelled sizes, rounded to what the live replicas take; the one chosen stays chosen.
  const m = multiple() || 1;
  const round = (v) => Math.max(m, Math.round(v / m) * m);
  const options = PRESETS.map(([name, w, h]) => [`${round(w)}x${round(h)}`, `${name} · ${round(w)}×${round(h)}`]);
  options.push(["custom", "custom…"]);
  const select = $("f-size-preset");
  if (options.map((o) => o[0]).join() === [...select.options].map((o) => o.value).join()) return;
  const was = select.selectedIndex;
  select.replaceChildren(...options.map(([value, text]) => new Option(text, value)));
  select.selectedIndex = Math.max(0, was);
}

function setSize(text) {
  const preset = [...$("f-size-preset").options].find((o) => o.value === text);
  $("f-size-preset").value = preset ? text : "custom";
  if (!preset) $("f-size").value = text;
  $("f-size").hidden = !custom();
}

function formatNumber(v) {
  return typeof v === "number" && Number.isInteger(v) && v < 100 ? v.toFixed(1) : String(v);
}

function applyDefaults() {
  // The chosen model's defaults shown as values (and sent as shown), in the fields the user has not touched; the
  // fields its recipe fixes (a few-step model's steps and guidance) hold its values, read-only.
  const d = defaults();
  const fixed = new Set((chosen() || {}).fixed || []);
  const put = (field, fill) => { if (!ui.touched.has(field) || fixed.has(field)) fill(); };
  put("size", () => setSize(String(d.size)));
  put("length", () => { $("f-length").value = d.num_frames; $("f-length-unit").value = "num_frames"; });
  put("num_inference_steps", () => { $("f-num_inference_steps").value = d.num_inference_steps; });
  put("guidance_scale", () => { $("f-guidance_scale").value = formatNumber(d.guidance_scale); });
  for (const field of ["num_inference_steps", "guidance_scale"]) {
    $(`f-${field}`).readOnly = fixed.has(field);
    if (fixed.has(field)) setError(field, "");
  }
  const recipe = (chosen() || {}).recipe;
  $("hint-recipe").hidden = !fixed.size;
  $("hint-recipe").textContent = fixed.size
    ? `Steps and guidance are fixed by ${chosen().id}'s recipe: ${recipe}.` : "";
  ui.defaulted = chosen() ? chosen().id : "";
}

// The error of one field, as the user typed it ("" when fine): every value is checked as typed, never replaced.
function check(field) {
  const raw = inputOf(field).value;
  const text = raw.trim();
  const label = LABEL[field];
  const whole = (min, what = "a whole number") => {
    if (text === "") return `${label}: empty: give ${what}`;
    if (!INT.test(text)) return `${label}: "${raw}" is not ${what}`;
    if (Number(text) < min) return `${label}: ${text} is less than ${min}`;
    return "";
  };
  switch (field) {
    case "prompt": return text ? "" : "Prompt: empty: say what the video shows";
    case "size": {
      const m = /^(\d+)\s*[x×]\s*(\d+)$/i.exec(text);
      if (!m) return `Size: "${raw}" is not WIDTHxHEIGHT, like 832x480`;
      const multipleOf = multiple() || 1;
      const bad = [m[1], m[2]].map(Number).find((v) => v < 1 || v % multipleOf);
      return bad === undefined ? "" : `Size: ${bad} is not a multiple of ${multipleOf}, which these replicas need`;
    }
    case "length": {
      const frames = $("f-length-unit").value === "num_frames";
      const error = whole(1, frames ? "a whole number of frames" : "a whole number of seconds");
      if (error || !frames || (Number(text) - 1) % 4 === 0) return error;
      return `Length: ${text} frames: must be of the form 4k+1 (1, 5, 9, …, 33, …)`;
    }
    case "num_inference_steps": return whole(1);
    case "seed": return whole(0);
    case "guidance_scale":
      if (text === "") return "Guidance: empty: give a number";
      if (!NUMBER.test(text)) return `Guidance: "${raw}" is not a number`;
      return Number(text) < 0 ? `Guidance: ${text} is less than 0` : "";
    case "loras": {
      if ($("loras-field").hidden) return "";
      const bad = parseLoras(text).find((l) => !l.name || typeof l.scale === "string");
      if (!bad) return "";
      return `LoRA adapters: "${bad.name}${bad.scale !== undefined ? `:${bad.scale}` : ""}" is not NAME or NAME:SCALE`;
    }
    default: return "";
  }
}

function setError(field, message) {
  const input = inputOf(field);
  $(`err-${field}`).textContent = message;
  if (message) {
    input.setAttribute("aria-invalid", "true");
    const folded = input.closest("details");
    if (folded) folded.open = true;  // a bad field is never hidden in the folded settings
  } else {
    for (const other of document.querySelectorAll(`#video-form [aria-invalid]`)) {
      const described = (other.getAttribute("aria-describedby") || "").split(" ");
      if (described.includes(`err-${field}`)) other.removeAttribute("aria-invalid");
    }
  }
}

function errors() {
  return [...document.querySelectorAll("#video-form .error[id^=err-]")].filter((p) => p.textContent)
    .map((p) => p.id.slice(4));
}

function validateAll() {
  // Every field at once: each bad one named beside it, and all of them in one line under the form.
  for (const field of CHECKED) setError(field, check(field));
  const bad = errors();
  $("form-error").textContent = bad.length ? `Fix ${bad.length === 1 ? "this field" : `these ${bad.length} fields`}: ` +
    `${bad.map((f) => LABEL[f]).join(", ")}.` : "";
  if (bad.length) {
    inputOf(bad[0]).focus();
    announce($("form-error").textContent);
  }
  return !bad.length;
}

function recheck(field) {
  // As a field is edited: its error goes as soon as it is fixed (it is never added while typing).
  if (!$(`err-${field}`).textContent) return;
  setError(field, check(field));
  if (!errors().length) $("form-error").textContent = "";
}

function fieldOf(target) {
  const id = target.id.replace(/^f-/, "");
  return {"size-preset": "size", "length-unit": "length"}[id] || id;
}

// "style:0.8, motion" -> [{name: "style", scale: 0.8}, {name: "motion"}]; a scale that is not a number stays text.
function parseLoras(text) {
  return text.split(",").map((part) => part.trim()).filter(Boolean).map((part) => {
    const [name, scale] = part.split(":").map((x) => x.trim());
    if (scale === undefined) return {name};
    return {name, scale: NUMBER.test(scale) ? Number(scale) : scale};
  });
}

function formData() {
  const data = new FormData();
  const text = (id) => $(id).value.trim();
  data.append("prompt", $("f-prompt").value);
  if (!$("model-field").hidden) data.append("model", $("f-model").value);
  if (text("f-negative_prompt")) data.append("negative_prompt", $("f-negative_prompt").value);
  data.append("size", sizeText().toLowerCase().replace("×", "x").replace(/\s/g, ""));
  data.append($("f-length-unit").value, text("f-length"));
  for (const name of ["num_inference_steps", "guidance_scale", "seed", "priority"]) {
    data.append(name, text(`f-${name}`));
  }
  if (!$("quality-field").hidden) data.append("quality", $("f-quality").value);
  if (!$("loras-field").hidden && text("f-loras")) data.append("loras", JSON.stringify(parseLoras(text("f-loras"))));
  const image = $("f-input_reference");
  if (!$("image-field").hidden && image.files.length) data.append("input_reference", image.files[0]);
  return data;
}

function showServerError(err) {
  const field = FIELD_OF[err.param] || err.param;
  if (LABEL[field] && !inputOf(field).closest("[hidden]")) {
    setError(field, err.message);
    inputOf(field).focus();
  } else {
    $("form-error").textContent = `The gateway refused the request: ${err.message}`;
  }
}

async function onSubmit(event) {
  event.preventDefault();
  if (!validateAll()) return;
  const go = $("submit");
  go.disabled = true;
  try {
    const job = await submit(formData(), {steps: Number($("f-num_inference_steps").value)});
    showSent(job);
  } catch (err) {
    if (err.status !== 401) showServerError(err);
  } finally {
    go.disabled = false;
  }
}

// After Generate: say so under the button, and bring the request's item into view (below the form on a phone,
// at the top of the other column on a wide screen), marked for a moment.
function showSent(job) {
  const li = document.querySelector(`#requests li[data-id="${CSS.escape(job.id)}"]`);
  const where = job.queue_position != null ? `, ${ordinal(job.queue_position)}` : "";
  $("sent").replaceChildren(`Sent: "${short(job.prompt, 40)}" is queued${where}. `,
    el("a", {href: "#mine", textContent: "See it in My requests"}));
  if (!li) return;
  li.classList.add("new");
  setTimeout(() => li.classList.remove("new"), 4000);
  const box = li.getBoundingClientRect();
  if (box.top < 0 || box.bottom > innerHeight) li.scrollIntoView({block: "nearest"});
}

// What a request takes on a replica of `model`, from its request_cost (fitted to recent jobs) at the pace its
// steps go now (`load`): trusted only for a size within a factor of the jobs it was fitted to.
const COST_RANGE = 4;

function units(steps) {
  const [w, h] = sizeText().split(/\s*[x×]\s*/i).map(Number);
  const n = Number($("f-length").value);
  const seconds = $("f-length-unit").value === "seconds" ? n * defaults().fps : n;
  const frames = seconds % 4 === 1 ? seconds : Math.floor(seconds / 4) * 4 + 1;
  return w * h * frames / 1e6 * steps;
}

// Seconds on a replica of `model` for the form's request (its own steps where its recipe fixes them); null when
// unknown (no recent job, or none of about this size).
function runSeconds(model) {
  const cost = model.request_cost;
  if (cost == null) return null;
  const steps = (model.fixed || []).includes("num_inference_steps") ? model.defaults.num_inference_steps
    : Number($("f-num_inference_steps").value);
  const u = units(steps);
  if (u < cost.min_units / COST_RANGE || u > cost.max_units * COST_RANGE) return null;
  return (cost.fixed_s + cost.per_unit_s * u) * (model.load || 1);
}

function renderCost() {
  const st = ui.status;
  if (!st) return;
  const model = chosen() || {request_cost: st.request_cost, expected_wait_s: st.expected_wait_s, load: 1,
    defaults: st.defaults, fixed: []};
  const priority = $("f-priority").value;
  const wait = (model.expected_wait_s || {})[priority];
  const waitText = wait == null ? `the wait for a replica (${priority}) is unknown` : wait < 1
    ? `starts at once (${priority})` : `starts after about ${dur(wait)} in the ${priority} queue`;
  const valid = !["size", "length", "num_inference_steps"].some((f) => check(f));
  let text;
  if (!valid) text = `Cost: shown once size, length and steps are valid; ${waitText}.`;
  else if (model.request_cost == null) text = `Cost: unknown until a request completes on these replicas; ${waitText}.`;
  else {
    const run = runSeconds(model);
    text = run == null ? `Cost: unknown for this size (no recent request of about its size); ${waitText}.`
      : `${run < 1 ? "Under a second" : `About ${dur(run)}`} on a replica; ${waitText}` +
        (wait ? `: about ${dur(run + wait)} in all.` : ".");
  }
  $("cost").textContent = text;
  // Each model offered with what the form's request would take there.
  for (const option of $("f-model").options) {
    const m = models().find((x) => x.id === option.value);
    if (!m) continue;
    const run = valid ? runSeconds(m) : null;
    const label = [m.id, m.recipe ? `few-step (${m.defaults.num_inference_steps} steps)` : null,
      run != null ? about(run + (m.expected_wait_s[priority] || 0)) : null].filter(Boolean).join(" · ");
    if (option.textContent !== label) option.textContent = label;
  }
}

async function prefillFrom(id) {
  // /ui?from=<id>: a video's inputs in the form ("Edit in the form" on its page).
  const job = await json(jobPath(id));
  const p = job.params;
  if (!p) return;
  $("f-prompt").value = p.prompt;
  $("f-negative_prompt").value = p.negative_prompt || "";
  setSize(`${p.width}x${p.height}`);
  $("f-length").value = p.num_frames;
  $("f-length-unit").value = "num_frames";
  $("f-num_inference_steps").value = p.num_inference_steps;
  $("f-guidance_scale").value = formatNumber(p.guidance_scale);
  $("f-seed").value = p.seed;
  if (job.priority) $("f-priority").value = job.priority;
  if (p.quality != null) $("f-quality").value = p.quality;
  $("f-loras").value = (p.loras || []).map((l) => `${l.name}:${l.scale}`).join(", ");
  ui.prefillModel = job.model;
  if ([...$("f-model").options].some((o) => o.value === job.model)) $("f-model").value = job.model;
  for (const field of Object.keys(LABEL)) ui.touched.add(field);
  applyDefaults();
  if (p.image_sha256) {
    $("form-error").textContent = "This video started from an uploaded first frame: choose the image again.";
  }
  renderCost();
}

// --- my requests -------------------------------------------------------------------------------------------

const foot = {all: null, clear: null, cancelAll: null};

function renderMine() {
  const list = mine();
  const ordered = inRunOrder(list);
  $("mine-empty").hidden = list.length > 0;
  renderList($("requests"), ui.showAll ? ordered : ordered.slice(0, SHOW_MINE));
  foot.all.hidden = list.length <= SHOW_MINE;
  foot.all.textContent = ui.showAll ? "Show fewer" : `Show all ${list.length}`;
  foot.all.setAttribute("aria-expanded", String(ui.showAll));
  foot.clear.hidden = !list.some((e) => ENDED.has(e.state));
  const live = list.filter((e) => !ENDED.has(e.state) && e.state !== "cancelling");
  foot.cancelAll.hidden = live.length < 2;
  foot.cancelAll.textContent = `Cancel all ${live.length}`;
  const title = titleOf(list);
  document.title = title ? `${title} — replicadp` : "replicadp";
}

function clearFinished() {
  const list = mine();
  const kept = list.filter((e) => !ENDED.has(e.state));
  saveMine(kept);
  announce(`Cleared ${list.length - kept.length} finished requests from this list.`);
  renderMine();
  $("mine-title").focus();
}

async function cancelAll() {
  const live = mine().filter((e) => !ENDED.has(e.state) && e.state !== "cancelling");
  await Promise.all(live.map(cancel));
  announce(`Cancelling ${live.length} requests.`);
}

// --- the cluster -------------------------------------------------------------------------------------------

function startsIn(s) {
  return s == null ? "unknown" : s < 1 ? "at once" : `in about ${dur(s)}`;
}

// What a replica runs, as the person sees it: a request of theirs by its prompt and its job's phase and step (the
// job, polled every second, is fresher than the cluster's snapshot: a request that ended is not shown running).
function replicaState(r, entries) {
  if (!r.serving) return {text: "loading its model"};
  const running = r.running;
  let job = running && running.id ? state.jobs.get(running.id) : null;
  const ended = (j) => j && ENDED.has(phaseOf(entries.get(j.id) || {}, j));
  if (!running || ended(job)) {
    job = [...entries.values()].map((e) => state.jobs.get(e.id))
      .find((j) => j && j.status === "in_progress" && j.replica === r.name && !ended(j));
    if (!job) return {text: "idle"};
  } else if (!running.id) {
    return {text: "busy (a request of another API key)"};
  }
  const of = job || running;  // a job of mine, fresher; else what the snapshot says of a request of my key
  const phase = job ? phaseOf(entries.get(job.id) || {}, job)
    : running.phase || (running.step != null ? "denoising" : "loading_inputs");
  const [step, total] = [of.step, of.total_steps];
  const what = of.prompt ? `"${short(of.prompt, 50)}"` : "a request of yours";
  const doing = phase === "denoising" && step != null && total ? `denoising, step ${step} of ${total}` : WORDS[phase];
  return {text: `${what}: ${doing}`, phase, step, total};
}

function queueLine(m, serving) {
  // Per model: what waits (cancelled requests left out: they never run) and when a request sent now would start.
  const priorities = Object.keys(m.queue_by_priority);
  const each = (f) => priorities.map((p) => `${p} ${f(p)}`).join(", ");
  const waiting = priorities.reduce((n, p) => n + m.queue_by_priority[p], 0);
  return `${waiting} waiting (${each((p) => m.queue_by_priority[p])}). A request sent now starts: ` +
    `${each((p) => startsIn(m.expected_wait_s[p]))}. ${serving} replica${serving === 1 ? "" : "s"} serving.`;
}

function renderStatus() {
  const st = ui.status;
  state.models = new Map(models().map((m) => [m.id, m]));
  renderModels();
  const servingOf = (id) => st.replicas.filter((r) => r.serving && (id == null || r.model === id)).length;
  const lines = models().length ? models().map((m) => (models().length > 1 ? `${m.id}: ` : "") +
    queueLine(m, servingOf(m.id))) : [queueLine({queue_by_priority: st.queue_by_priority,
    expected_wait_s: st.expected_wait_s}, servingOf(null))];
  $("queue").textContent = lines.join(" ");
  const entries = new Map(mine().map((e) => [e.id, e]));
  const rows = st.replicas.map((r) => {
    const tr = el("tr");
    for (const [label, text] of [["Replica", r.name], ["Device", r.device || "?"], ["Model", r.model || "?"]]) {
      const td = el("td", {textContent: text});
      td.dataset.label = label;
      tr.append(td);
    }
    const now = replicaState(r, entries);
    const box = el("div", {className: "state"}, el("span", {textContent: now.text}));
    if (now.phase && now.phase !== "loading_inputs" && now.phase !== "queued") {
      const bar = el("progress", {max: now.total || 1});
      if (now.phase === "denoising" && now.total) bar.value = now.step || 0;
      bar.setAttribute("aria-label", `Progress on ${r.name}`);
      box.append(bar);
    }
    const td = el("td", {}, box);
    td.dataset.label = "State";
    tr.append(td);
    return tr;
  });
  const none = "No live replica: requests wait in the queue until one starts.";
  if (!rows.length) rows.push(el("tr", {}, el("td", {colSpan: 4, textContent: none})));
  $("replicas").tBodies[0].replaceChildren(...rows);
  renderOffers();
  renderAbout();
  renderCost();
}

function renderModels() {
  // Several models (a fleet, or a few-step model beside the exact one): the form offers them by name.
  const list = models();
  const select = $("f-model");
  if (list.map((m) => m.id).join() !== [...select.options].map((o) => o.value).join()) {
    // The deployment's default model, else a few-step one (preview first, then "Make the final"), else the first.
    const was = select.value || ui.prefillModel || ui.status.default_model || (list.find((m) => m.recipe) || {}).id;
    select.replaceChildren(...list.map((m) => new Option(m.id, m.id)));
    if (list.some((m) => m.id === was)) select.value = was;
  }
  $("model-field").hidden = list.length < 2;
  if (ui.defaulted !== (chosen() ? chosen().id : "")) applyDefaults();
}

function renderOffers() {
  // Offer what some live replica of the chosen model offers: a first frame (TI2V), a choice of fidelity, adapters.
  const here = replicasOf();
  const m = multiple();
  $("size-multiple").textContent = m ? `, multiples of ${m}` : "";
  presets();
  $("image-field").hidden = !here.some((r) => r.accepts_image);
  const qualities = [...new Set(here.filter((r) => r.qualities && r.qualities.length > 1).flatMap((r) => r.qualities))];
  const select = $("f-quality");
  if (qualities.join() !== [...select.options].map((o) => o.value).join()) {
    select.replaceChildren(...qualities.map((q) => new Option(q, q)));
  }
  $("quality-field").hidden = qualities.length === 0;
  const loras = [...new Set(here.flatMap((r) => r.loras || []))];
  $("loras-available").textContent = loras.join(", ");
  $("loras-field").hidden = loras.length === 0;
}

function renderAbout() {
  // The header says what runs here: the models and how many replicas serve them.
  const st = ui.status;
  const serving = st.replicas.filter((r) => r.serving).length;
  const names = models().map((m) => m.id);
  const what = names.length ? names.join(" and ") : "no model yet";
  $("served").textContent = `${what} on ${serving} replica${serving === 1 ? "" : "s"}`;
}

// --- the gallery: a poster each (a few kB), the MP4 fetched only when played ----------------------------------

function card(job) {
  const li = el("li", {className: "card"});
  const hint = el("p", {className: "hint"});
  const link = el("a", {className: "prompt", href: `/ui/videos/${encodeURIComponent(job.id)}`,
    textContent: job.prompt});
  hint.textContent = [madeAt(job.created_at), job.seed != null ? `seed ${job.seed}` : null, job.size,
    plural(job.num_frames, "frame"), job.params ? plural(job.params.num_inference_steps, "step") : null,
    models().length > 1 ? job.model : null, job.replica].filter(Boolean).join(" · ");
  li.append(thumb(job, (why) => { hint.textContent = `Video unavailable: ${why}`; }), link, hint);
  li.dataset.videoId = job.id;
  li.dataset.created = job.created_at;
  return li;
}

function addCards(jobs, before) {
  const ul = $("gallery");
  const have = new Set([...ul.children].map((li) => li.dataset.videoId));
  for (const job of jobs) {
    if (job.status !== "completed") continue;
    ui.gallery.set(job.id, job);
    if (!have.has(job.id)) ul.insertBefore(card(job), before);
  }
}

async function refreshGallery() {
  // The newest page: new videos go in before the cards there (a card is never moved: a playing video would
  // stop); a card newer than the page's oldest that it no longer lists was deleted.
  const list = await json(`/v1/videos?limit=${PAGE}`);
  const ul = $("gallery");
  const listed = new Set(list.data.map((j) => j.id));
  const oldest = Math.min(...list.data.map((j) => j.created_at));
  for (const li of [...ul.children]) {
    if (!listed.has(li.dataset.videoId) && (!list.has_more || Number(li.dataset.created) > oldest)) li.remove();
  }
  let next = ul.firstElementChild;
  for (const job of list.data) {
    const existing = [...ul.children].find((li) => li.dataset.videoId === job.id);
    if (existing) next = existing.nextElementSibling;
    else addCards([job], next);
  }
  if (ui.cursor === undefined) [ui.cursor, ui.hasMore] = [list.last_id, list.has_more];
  $("more").hidden = !ui.hasMore;
  $("gallery-empty").hidden = ul.children.length > 0;
  renderExamples();
}

async function loadMore() {
  const list = await json(`/v1/videos?limit=${PAGE}&after=${encodeURIComponent(ui.cursor)}`);
  addCards(list.data, null);
  [ui.cursor, ui.hasMore] = [list.last_id || ui.cursor, list.has_more];
  $("more").hidden = !ui.hasMore;
  $("gallery-empty").hidden = $("gallery").children.length > 0;
}

function renderExamples() {
  // An example the deployment has made (a video of its prompt in the gallery) shows that video's poster.
  for (const chip of $("examples").querySelectorAll("button.example")) {
    if (chip.querySelector("img")) continue;
    const made = [...ui.gallery.values()].find((j) => j.prompt === chip.dataset.prompt);
    if (!made) continue;
    const img = el("img", {alt: "", decoding: "async"});
    posterUrl(made).then((url) => { img.src = url; chip.prepend(img); }, () => {});
  }
}

// --- the loop ----------------------------------------------------------------------------------------------

async function poll() {
  if (!state.needKey) {
    try {
      const [status, completed] = await Promise.all([json("/v1/status"), pollEntries(mine())]);
      ui.status = status;
      renderStatus();
      if (completed || ui.polls % GALLERY_EVERY === 0) await refreshGallery();
      ui.polls += 1;
      if (!state.needKey) showAlert("");
      markFresh(true, [$("live"), $("mine")], $("updated"));
    } catch (err) {
      if (err.status !== 401) {
        showAlert(`Cannot reach the gateway: ${err.message}. Retrying…`);
        markFresh(false, [$("live"), $("mine")], $("updated"));
      }
    }
    renderMine();
  }
  setTimeout(poll, POLL_MS);
}

// Finished requests of an earlier visit that say neither how long they took nor their size: their job, once.
async function fillEnded(entries) {
  await Promise.all(entries.filter((e) => e.state === "completed" && e.took == null).map(async (e) => {
    try {
      update(e.id, summary(await json(jobPath(e.id))));
    } catch (err) {
      if (err.status === 404) update(e.id, {state: "gone"});
    }
  }));
}

function start() {
  state.rerender = renderMine;
  setUpKey(() => { ui.cursor = undefined; $("gallery").replaceChildren(); fillCompared(mine()).then(renderMine); });
  presets();
  setSize(FALLBACK.size);
  $("video-form").addEventListener("submit", onSubmit);
  for (const type of ["input", "change"]) {  // a select may say only "change"
    $("video-form").addEventListener(type, (event) => {
      const field = fieldOf(event.target);
      if (field === "model") {
        renderOffers();
        applyDefaults();
      } else {
        ui.touched.add(field);
      }
      if (LABEL[field]) recheck(field);
      renderCost();
    });
  }
  $("f-size-preset").addEventListener("change", () => {
    $("f-size").hidden = !custom();
    if (custom()) $("f-size").focus();
  });
  for (const [name, text] of EXAMPLES) {
    const chip = button("", () => {
      $("f-prompt").value = text;
      ui.touched.add("prompt");
      recheck("prompt");
      $("f-prompt").focus();
    }, `Use the example prompt "${text}"`, "example");
    chip.append(el("span", {textContent: name}));
    chip.dataset.prompt = text;
    $("examples").append(chip);
  }
  $("random-seed").addEventListener("click", () => {
    $("f-seed").value = crypto.getRandomValues(new Uint32Array(1))[0];
    recheck("seed");
    announce(`Seed set to ${$("f-seed").value}.`);
  });
  foot.all = button("", () => { ui.showAll = !ui.showAll; renderMine(); }, null, "show-all");
  foot.cancelAll = button("", cancelAll, "Cancel all my requests that have not ended", "cancel-all");
  foot.clear = button("Clear finished", clearFinished, "Clear finished requests from this list", "clear");
  $("mine-foot").append(foot.all, foot.cancelAll, foot.clear);
  $("mine-title").tabIndex = -1;
  $("more").addEventListener("click", () => loadMore().catch((err) => announce(`Could not load more: ${err.message}`)));
  const from = new URLSearchParams(location.search).get("from");
  if (from) {
    prefillFrom(from).catch((err) => { $("form-error").textContent = `Could not read that video: ${err.message}`; });
  }
  renderMine();
  fillCompared(mine()).then(renderMine);
  fillEnded(mine()).then(renderMine);
  poll();
}

start();
