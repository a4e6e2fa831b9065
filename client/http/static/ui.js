// The page /ui (docs/ui.md): send a request, watch it and the cluster, browse the videos. Needs common.js.
"use strict";

const GALLERY_EVERY = 5;  // polls between gallery refreshes (and at once when a request of mine completes)
const PAGE = 12;          // videos per gallery page ("Load more" asks for the next)
const SHOW_MINE = 8;      // "My requests" shown before "Show all"
const EXAMPLES = [["fox in snow", "a red fox trotting through fresh snow at dawn"],
  ["waves", "waves breaking on a rocky shore, slow motion"], ["paper boat", "a paper boat drifting down a rain gutter"],
  ["balloon", "a hot-air balloon rising over misty hills at sunrise"]];
const PRESETS = [["480p landscape", 832, 480], ["720p", 1280, 704], ["portrait", 480, 832], ["square", 512, 512]];
// What the gateway fills in for what a request leaves out, until /v1/status says (its `defaults`).
const FALLBACK = {size: "832x480", num_frames: 33, num_inference_steps: 30, guidance_scale: 5.0, fps: 24};
const LABEL = {prompt: "Prompt", negative_prompt: "Negative prompt", size: "Size", length: "Length",
  num_inference_steps: "Steps", guidance_scale: "Guidance", seed: "Seed", priority: "Priority", quality: "Fidelity",
  loras: "LoRA adapters", input_reference: "First frame"};
// The API's `param` -> the field that shows its error (several parameters share one field).
const FIELD_OF = {width: "size", height: "size", num_frames: "length", seconds: "length", fps: "length"};
const CHECKED = ["prompt", "size", "length", "num_inference_steps", "guidance_scale", "seed", "loras"];
const INT = /^[+-]?\d+$/;
const NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)$/;

const ui = {status: null, polls: 0, showAll: false, cursor: undefined, hasMore: false, touched: new Set(), defaulted: false};

// --- the form ----------------------------------------------------------------------------------------------

const custom = () => $("f-size-preset").value === "custom";
const sizeText = () => (custom() ? $("f-size").value.trim() : $("f-size-preset").value);
const defaults = () => ({...FALLBACK, ...((ui.status && ui.status.defaults) || {})});

function inputOf(field) {
  if (field === "size") return custom() ? $("f-size") : $("f-size-preset");
  return $(field === "length" ? "f-length" : `f-${field}`);
}

function multiple() {
  const all = ui.status ? ui.status.replicas.map((r) => r.size_multiple).filter(Boolean) : [];
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
  const chosen = select.selectedIndex;
  select.replaceChildren(...options.map(([value, text]) => new Option(text, value)));
  select.selectedIndex = Math.max(0, chosen);
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
  // The gateway's defaults shown as values (and sent as shown), in the fields the user has not touched.
  const d = defaults();
  const put = (field, fill) => { if (!ui.touched.has(field)) fill(); };
  put("size", () => setSize(String(d.size)));
  put("length", () => { $("f-length").value = d.num_frames; $("f-length-unit").value = "num_frames"; });
  put("num_inference_steps", () => { $("f-num_inference_steps").value = d.num_inference_steps; });
  put("guidance_scale", () => { $("f-guidance_scale").value = formatNumber(d.guidance_scale); });
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
      return bad ? `LoRA adapters: "${bad.name}${bad.scale !== undefined ? `:${bad.scale}` : ""}" is not NAME or NAME:SCALE` : "";
    }
    default: return "";
  }
}

function setError(field, message) {
  const input = inputOf(field);
  $(`err-${field}`).textContent = message;
  if (message) input.setAttribute("aria-invalid", "true");
  else for (const other of document.querySelectorAll(`#video-form [aria-invalid]`)) {
    if ((other.getAttribute("aria-describedby") || "").split(" ").includes(`err-${field}`)) other.removeAttribute("aria-invalid");
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
  if (text("f-negative_prompt")) data.append("negative_prompt", $("f-negative_prompt").value);
  data.append("size", sizeText().toLowerCase().replace("×", "x").replace(/\s/g, ""));
  data.append($("f-length-unit").value, text("f-length"));
  for (const name of ["num_inference_steps", "guidance_scale", "seed", "priority"]) data.append(name, text(`f-${name}`));
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
    await submit(formData(), null);
  } catch (err) {
    if (err.status !== 401) showServerError(err);
  } finally {
    go.disabled = false;
  }
}

// What a request takes on a replica, from /v1/status's request_cost (fitted to recent jobs): trusted only for a
// size within a factor of the jobs it was fitted to.
const COST_RANGE = 4;

function renderCost() {
  const st = ui.status;
  if (!st) return;
  const priority = $("f-priority").value;
  const wait = (st.expected_wait_s || {})[priority];
  const waitText = wait == null ? `the wait for a replica (${priority}) is unknown` : wait < 1
    ? `starts at once (${priority})` : `starts after about ${dur(wait)} in the ${priority} queue`;
  const model = st.request_cost;
  let text;
  if (["size", "length", "num_inference_steps"].some((f) => check(f))) {
    text = `Cost: shown once size, length and steps are valid; ${waitText}.`;
  } else if (model == null) text = `Cost: unknown until a request completes on these replicas; ${waitText}.`;
  else {
    const [w, h] = sizeText().split(/\s*[x×]\s*/i).map(Number);
    const n = Number($("f-length").value);
    const seconds = $("f-length-unit").value === "seconds" ? n * defaults().fps : n;
    const frames = seconds % 4 === 1 ? seconds : Math.floor(seconds / 4) * 4 + 1;
    const units = w * h * frames / 1e6 * Number($("f-num_inference_steps").value);
    if (units < model.min_units / COST_RANGE || units > model.max_units * COST_RANGE) {
      text = `Cost: unknown for this size (no recent request of about its size); ${waitText}.`;
    } else {
      const run = model.fixed_s + model.per_unit_s * units;
      text = `About ${dur(run)} on a replica; ${waitText}` + (wait ? `: about ${dur(run + wait)} in all.` : ".");
    }
  }
  $("cost").textContent = text;
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
  for (const field of Object.keys(LABEL)) ui.touched.add(field);
  if (p.image_sha256) $("form-error").textContent = "This video started from an uploaded first frame: choose the image again.";
  renderCost();
}

// --- my requests -------------------------------------------------------------------------------------------

const foot = {all: null, clear: null};

function renderMine() {
  const list = mine();
  $("mine-empty").hidden = list.length > 0;
  renderList($("requests"), ui.showAll ? list : list.slice(0, SHOW_MINE));
  foot.all.hidden = list.length <= SHOW_MINE;
  foot.all.textContent = ui.showAll ? "Show fewer" : `Show all ${list.length}`;
  foot.all.setAttribute("aria-expanded", String(ui.showAll));
  foot.clear.hidden = !list.some((e) => ENDED.has(e.state));
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

function renderStatus() {
  const st = ui.status;
  const priorities = Object.keys(st.queue_by_priority);
  const serving = st.replicas.filter((r) => r.serving).length;
  const each = (f) => priorities.map((p) => `${p} ${f(p)}`).join(", ");
  $("queue").textContent = `${st.queue_depth} waiting (${each((p) => st.queue_by_priority[p])}). A request sent now ` +
    `starts: ${each((p) => startsIn(st.expected_wait_s[p]))}. ${serving} of ${st.replicas.length} replicas serving.`;
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
  // Offer what some live replica offers: a first frame (TI2V), a choice of fidelity, LoRA adapters.
  const m = multiple();
  $("size-multiple").textContent = m ? `, multiples of ${m}` : "";
  presets();
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
  renderCost();
}

// --- the gallery: a poster each (a few kB), the MP4 fetched only when played ----------------------------------

function card(job) {
  const [w, h] = job.size.split("x").map(Number);
  const img = el("img", {alt: "", width: w, height: h, decoding: "async"});
  const thumb = el("button", {type: "button", className: "thumb"}, img, el("span", {className: "play", textContent: "▶"}));
  thumb.style.aspectRatio = `${w} / ${h}`;
  thumb.setAttribute("aria-label", `Play "${short(job.prompt, 60)}"`);
  const link = el("a", {className: "prompt", href: `/ui/videos/${encodeURIComponent(job.id)}`, textContent: job.prompt});
  const facts = [job.seed != null ? `seed ${job.seed}` : null, job.size, `${job.num_frames} frames`,
    job.params ? `${job.params.num_inference_steps} steps` : null, job.replica].filter(Boolean).join(" · ");
  const li = el("li", {className: "card"}, thumb, link, el("p", {className: "hint", textContent: facts}));
  li.dataset.videoId = job.id;
  li.dataset.created = job.created_at;
  thumb.addEventListener("click", () => play(li, job));
  blobUrl(`${jobPath(job.id)}/poster`).then((url) => { img.src = url; }, () => img.remove());
  return li;
}

async function play(li, job) {
  const thumb = li.querySelector(".thumb");
  let video = thumb.querySelector("video");
  if (!video) {
    thumb.setAttribute("aria-busy", "true");
    try {
      video = el("video", {muted: true, loop: true, playsInline: true, src: await blobUrl(`${jobPath(job.id)}/content`)});
    } catch (err) {
      li.querySelector(".hint").textContent = `Video unavailable: ${err.message}`;
      return;
    } finally {
      thumb.removeAttribute("aria-busy");
    }
    const img = thumb.querySelector("img");
    if (img) { video.poster = img.src; img.remove(); }
    const label = (verb) => () => {
      thumb.classList.toggle("playing", verb === "Pause");
      thumb.setAttribute("aria-label", `${verb} "${short(job.prompt, 60)}"`);
    };
    video.addEventListener("play", label("Pause"));
    video.addEventListener("pause", label("Play"));
    thumb.prepend(video);
  }
  if (video.paused) video.play().catch(() => {}); else video.pause();
}

function addCards(jobs, before) {
  const ul = $("gallery");
  const have = new Set([...ul.children].map((li) => li.dataset.videoId));
  for (const job of jobs) if (job.status === "completed" && !have.has(job.id)) ul.insertBefore(card(job), before);
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
}

async function loadMore() {
  const list = await json(`/v1/videos?limit=${PAGE}&after=${encodeURIComponent(ui.cursor)}`);
  addCards(list.data, null);
  [ui.cursor, ui.hasMore] = [list.last_id || ui.cursor, list.has_more];
  $("more").hidden = !ui.hasMore;
  $("gallery-empty").hidden = $("gallery").children.length > 0;
}

// --- the loop ----------------------------------------------------------------------------------------------

async function poll() {
  if (!state.needKey) {
    try {
      const [status, completed] = await Promise.all([json("/v1/status"), pollEntries(mine())]);
      ui.status = status;
      if (!ui.defaulted) { ui.defaulted = true; applyDefaults(); }
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

function start() {
  state.rerender = renderMine;
  setUpKey(() => { ui.cursor = undefined; $("gallery").replaceChildren(); fillCompared(mine()).then(renderMine); });
  presets();
  setSize(FALLBACK.size);
  $("video-form").addEventListener("submit", onSubmit);
  for (const type of ["input", "change"]) {  // a select may say only "change"
    $("video-form").addEventListener(type, (event) => {
      const field = fieldOf(event.target);
      ui.touched.add(field);
      if (LABEL[field]) recheck(field);
      renderCost();
    });
  }
  $("f-size-preset").addEventListener("change", () => {
    $("f-size").hidden = !custom();
    if (custom()) $("f-size").focus();
  });
  for (const [name, text] of EXAMPLES) {
    $("examples").append(button(name, () => {
      $("f-prompt").value = text;
      ui.touched.add("prompt");
      recheck("prompt");
      $("f-prompt").focus();
    }, `Use the example prompt "${text}"`, "example"));
  }
  $("random-seed").addEventListener("click", () => {
    $("f-seed").value = crypto.getRandomValues(new Uint32Array(1))[0];
    recheck("seed");
    announce(`Seed set to ${$("f-seed").value}.`);
  });
  foot.all = button("", () => { ui.showAll = !ui.showAll; renderMine(); }, null, "show-all");
  foot.clear = button("Clear finished", clearFinished, "Clear finished requests from this list", "clear");
  $("mine-foot").append(foot.all, foot.clear);
  $("mine-title").tabIndex = -1;
  $("more").addEventListener("click", () => loadMore().catch((err) => announce(`Could not load more: ${err.message}`)));
  const from = new URLSearchParams(location.search).get("from");
  if (from) prefillFrom(from).catch((err) => { $("form-error").textContent = `Could not read that video: ${err.message}`; });
  renderMine();
  fillCompared(mine()).then(renderMine);
  poll();
}

start();
