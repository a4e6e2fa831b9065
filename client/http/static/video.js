// A video's own page, /ui/videos/<id> (docs/ui.md): the video, its first frame, its inputs, who ran it; re-run it
// with the same inputs and priority, make the final of a preview, download it under a readable name, copy its
// request as curl or Python (each waits for the video and saves it). Needs common.js.
"use strict";

const VIDEO_ID = decodeURIComponent(location.pathname.replace(/\/+$/, "").split("/").pop());
const vp = {job: null, shown: false, rerun: null};

// "A fox, in snow!" -> "a-fox-in-snow"
function slug(text) {
  const s = text.normalize("NFKD").replace(/[\u0300-\u036f]/g, "").toLowerCase().replace(/[^a-z0-9]+/g, "-");
  return s.replace(/^-+/, "").slice(0, 60).replace(/-+$/, "") || "video";
}

// The request that makes this video again, as the form's fields (what POST /v1/videos takes), as text.
function fields(job) {
  const p = job.params;
  const f = [["prompt", p.prompt], ["negative_prompt", p.negative_prompt || ""], ["size", `${p.width}x${p.height}`],
    ["num_frames", p.num_frames], ["fps", p.fps], ["num_inference_steps", p.num_inference_steps],
    ["guidance_scale", p.guidance_scale], ["seed", p.seed], ["model", job.model]];
  for (const name of ["guidance_scale_2", "boundary_ratio", "quality"]) if (p[name] != null) f.push([name, p[name]]);
  if (p.loras != null) f.push(["loras", JSON.stringify(p.loras)]);
  if (job.priority) f.push(["priority", job.priority]);
  return f.map(([k, v]) => [k, String(v)]);
}

function formOf(job) {
  const data = new FormData();
  for (const [k, v] of fields(job)) data.append(k, v);
  return data;
}

const endpoint = () => `${location.origin}/v1/videos`;
const fileName = (job) => `${slug(job.prompt)}-seed${(job.params || {}).seed != null ? job.params.seed : job.seed}.mp4`;

// curl: the sync route, which answers once the video is made, saved under the download's name.
function curlOf(job) {
  const q = (s) => `'${s.replace(/'/g, "'\\''")}'`;
  return [`curl -sS --fail-with-body -o ${q(fileName(job))} ${q(`${endpoint()}/sync`)}`,
    ...(usesKey() ? ['-H "Authorization: Bearer $REPLICADP_API_KEY"'] : []),
    ...fields(job).map(([k, v]) => `--form-string ${q(`${k}=${v}`)}`)].join(" \\\n  ");
}

// Python: a job, polled until it ends, then its MP4 saved under the download's name.
function pythonOf(job) {
  // JSON's string literals are Python's too.
  const s = JSON.stringify;
  return [...(usesKey() ? ["import os"] : []), "import time", "", "import requests", "", `url = ${s(endpoint())}`,
    usesKey() ? "headers = {\"Authorization\": f\"Bearer {os.environ['REPLICADP_API_KEY']}\"}" : "headers = {}",
    "form = {", ...fields(job).map(([k, v]) => `    ${s(k)}: ${s(v)},`), "}",
    "r = requests.post(url, files={k: (None, v) for k, v in form.items()}, headers=headers)",
    "job = r.json()", "if r.status_code != 200:", "    raise SystemExit(job[\"error\"][\"message\"])",
    "while job[\"status\"] in (\"queued\", \"in_progress\"):", "    time.sleep(1)",
    "    job = requests.get(f\"{url}/{job['id']}\", headers=headers).json()",
    "if job[\"status\"] != \"completed\":", "    raise SystemExit(f\"{job['id']}: {job['error']['message']}\")",
    `with open(${s(fileName(job))}, "wb") as out:`,
    "    out.write(requests.get(f\"{url}/{job['id']}/content\", headers=headers).content)",
    `print(job["id"], ${s(fileName(job))})`].join("\n");
}

function metaInto(dl, pairs) {
  dl.replaceChildren(...pairs.filter(([, v]) => v != null && v !== "").flatMap(([name, value]) =>
    [el("dt", {textContent: name}), el("dd", {textContent: String(value)})]));
}

function show(job) {
  // A completed job: everything at once, the actions right under the video.
  vp.shown = true;
  const p = job.params || {};
  const t = job.stage_durations || {};
  const [w, h] = job.size.split("x").map(Number);
  $("progress-box").hidden = true;
  const player = $("player");
  player.style.aspectRatio = `${w} / ${h}`;
  player.style.setProperty("--ratio", w / h);
  player.setAttribute("aria-label", `Video: ${short(job.prompt, 80)}`);
  player.hidden = $("actions").hidden = $("details").hidden = false;
  posterUrl(job).then((url) => { player.poster = url; $("first-frame").src = url; },
    () => { $("first-frame").hidden = true; });
  load(player, job);
  metaInto($("inputs"), [["Prompt", job.prompt], ["Negative prompt", p.negative_prompt || "(none)"],
    ["Size", job.size],
    ["Length", `${job.num_frames} frames at ${job.fps} fps (${(job.num_frames / job.fps).toFixed(1)} s)`],
    ["Steps", p.num_inference_steps], ["Guidance", p.guidance_scale != null ? p.guidance_scale.toFixed(1) : null],
    ["Guidance (low noise)", p.guidance_scale_2],
    ["Boundary ratio", p.boundary_ratio], ["Seed", p.seed], ["Priority", job.priority], ["Fidelity", p.quality],
    ["LoRA adapters", p.loras ? p.loras.map((l) => `${l.name}:${l.scale}`).join(", ") : null],
    ["First frame sha256", p.image_sha256]]);
  metaInto($("run"), [["Replica", job.replica], ["Model", job.model],
    ["Created", new Date(job.created_at * 1000).toLocaleString()],
    ["Queued", t.queued != null ? `${t.queued.toFixed(2)} s` : null],
    ["Inference", job.inference_time_s != null ? `${job.inference_time_s.toFixed(2)} s` : null],
    ["On the replica", t.total != null ? `${t.total.toFixed(2)} s` : null],
    ["In all", job.elapsed_s != null ? `${job.elapsed_s.toFixed(1)} s` : null],
    ["Peak memory", job.peak_memory_mb != null ? `${job.peak_memory_mb} MB` : null],
    ["Frames sha256", job.frames_sha256], ["Video sha256", job.video_sha256], ["Job id", job.id]]);
  const rerun = $("rerun");
  rerun.textContent = `Re-run${job.priority ? ` (${job.priority})` : ""}`;
  rerun.setAttribute("aria-label",
    `Re-run with the same inputs${job.priority ? ` and priority (${job.priority})` : ""}`);
  rerun.disabled = !job.params || p.image_sha256 != null;
  if (p.image_sha256 != null) {
    $("note").textContent = "This video started from an uploaded first frame, which the gateway does not keep: " +
      "edit it in the form and choose the image again.";
  }
  $("edit").href = `/ui?from=${encodeURIComponent(job.id)}`;
  renderRelated();
}

// The MP4 into the player, saying how far it has come: the browser streams it (range requests; behind a key through
// a signed link) and plays before it has all of it.
function load(player, job) {
  const loading = $("loading");
  const download = $("download");
  download.download = fileName(job);
  const say = (text) => { loading.textContent = text; loading.hidden = !text; };
  say("Loading the video…");
  player.addEventListener("progress", () => {
    const have = player.buffered.length ? player.buffered.end(player.buffered.length - 1) : 0;
    if (!player.duration) return;
    say(have < player.duration ? `Loading the video: ${Math.round(100 * have / player.duration)}%` : "");
  });
  player.addEventListener("canplay", () => { if (loading.textContent === "Loading the video…") say(""); });
  videoUrl(job).then((url) => {
    player.src = url;
    download.href = url;
    download.removeAttribute("aria-disabled");
  }, (err) => { say(""); $("note").textContent = `The video could not be loaded: ${err.message}`; });
}

// A preview and its final link to each other (this browser's list says which is which); a finished preview of a
// few-step model offers "Make the final" on the exact model beside it (/v1/status's `final`).
function renderRelated() {
  const job = vp.job;
  if (!job || !vp.shown) return;
  const list = mine();
  const own = list.find((e) => e.id === job.id) || {};
  const final = list.find((e) => e.finalOf === job.id);
  const link = (id, text) => el("a", {href: `/ui/videos/${encodeURIComponent(id)}`, textContent: text});
  const parts = [];
  if (own.finalOf) parts.push("The final of ", link(own.finalOf, "this preview"), ". ");
  if (final) parts.push("Its final: ", link(final.id, `on ${final.model || "the exact model"}`), ` (${final.state}).`);
  $("related").replaceChildren(...parts);
  $("related").hidden = !parts.length;
  const model = (state.models.get(job.model) || {}).final;
  $("final").hidden = !model || !!final;
  $("final").textContent = model ? `Make the final (${model})` : "Make the final";
  $("final").setAttribute("aria-label", model ? `Make the final on ${model}: the same prompt, seed and size` : "");
}

async function final() {
  const model = (state.models.get(vp.job.model) || {}).final;
  $("final").disabled = true;
  try {
    const sent = await submit(finalForm(vp.job, model), {finalOf: vp.job.id, steps: null});
    $("note").textContent = `The final is queued on ${model} (${sent.id}): it shows below until it ends.`;
    vp.rerun = sent.id;
  } catch (err) {
    if (err.status !== 401) $("note").textContent = `The gateway refused the final: ${err.message}`;
  } finally {
    $("final").disabled = false;
  }
  renderRelated();
}

function render() {
  const job = vp.job;
  $("title").textContent = job.prompt;
  document.title = `${short(job.prompt, 60)} — replicadp`;
  if (job.status === "completed") {
    if (!vp.shown) show(job);
    return;
  }
  const entry = mine().find((e) => e.id === job.id) || {id: job.id, prompt: job.prompt, state: "queued"};
  $("progress-box").hidden = false;
  const p = progressOf(entry, job);
  if (phaseOf(entry, job) === "cancelling") $("progress").removeAttribute("value");
  else $("progress").value = p.value;
  $("status").textContent = statusText(entry, job, p);
}

// Re-runs of this video and its final, started from this browser.
const reruns = () => mine().filter((e) => (e.compareTo && e.compareTo.id === VIDEO_ID) || e.finalOf === VIDEO_ID);

function renderReruns() {
  const list = reruns();
  $("reruns-box").hidden = !list.length;
  renderList($("requests"), list);
  const sent = list.find((e) => e.id === vp.rerun);
  if (sent && ENDED.has(sent.state)) {  // its line under the video says how it went: the note has done its work
    vp.rerun = null;
    $("note").textContent = "";
  }
  renderRelated();
}

async function rerun() {
  const job = vp.job;
  $("rerun").disabled = true;
  try {
    const sent = await submit(formOf(job), {compareTo: {id: job.id, frames_sha256: job.frames_sha256}});
    $("note").textContent = `Re-run queued (${sent.id}): it shows below until it ends.`;
    vp.rerun = sent.id;
  } catch (err) {
    if (err.status !== 401) $("note").textContent = `The gateway refused the re-run: ${err.message}`;
  } finally {
    $("rerun").disabled = false;
  }
}

async function copy(kind) {
  const text = kind === "curl" ? curlOf(vp.job) : pythonOf(vp.job);
  const pre = $("snippet");
  pre.textContent = text;
  pre.hidden = false;
  pre.dataset.kind = kind;
  pre.setAttribute("aria-label", `This request as ${kind}`);
  const what = kind === "curl" ? "a curl command" : "Python (requests)";
  try {
    await navigator.clipboard.writeText(text);
    $("note").textContent = `Copied as ${what}; it is shown below too.`;
  } catch (_) {
    $("note").textContent =
      `This browser did not let the page copy: the request as ${what} is below, to select and copy.`;
  }
}

async function poll() {
  if (!state.needKey) {
    try {
      if (!vp.job || !ENDED.has(phaseOf({}, vp.job))) {
        vp.job = await json(jobPath(VIDEO_ID));
        state.jobs.set(VIDEO_ID, vp.job);
        render();
      }
      await pollEntries(reruns());
      markFresh(true, [$("watch")], null);
      if (!state.needKey) showAlert("");
    } catch (err) {
      if (err.status === 404) {
        vp.job = {status: "failed", phase: "gone"};
        $("title").textContent = "No such video";
        $("progress-box").hidden = true;
        $("note").textContent = `No video ${VIDEO_ID} here: it was deleted, or made with another API key.`;
      } else if (err.status !== 401) {
        showAlert(`Cannot reach the gateway: ${err.message}. Retrying…`);
        markFresh(false, [$("watch")], null);
      }
    }
    renderReruns();
  }
  setTimeout(poll, POLL_MS);
}

function start() {
  state.rerender = renderReruns;
  setUpKey(() => { vp.job = null; vp.shown = false; });
  $("rerun").addEventListener("click", rerun);
  $("final").addEventListener("click", final);
  // Which model makes the final of a preview: the models' status, once.
  json("/v1/status").then((st) => { state.models = new Map((st.models || []).map((m) => [m.id, m])); renderRelated(); },
    () => {});
  $("copy-curl").addEventListener("click", () => copy("curl"));
  $("copy-python").addEventListener("click", () => copy("python"));
  renderReruns();
  fillCompared(reruns()).then(renderReruns);
  poll();
}

start();
