// A video's own page, /ui/videos/<id> (docs/ui.md): the video, its first frame, its inputs, who ran it; re-run it
// with the same inputs and priority, download it under a readable name, copy its request as curl or Python.
// Needs common.js.
"use strict";

const VIDEO_ID = decodeURIComponent(location.pathname.replace(/\/+$/, "").split("/").pop());
const vp = {job: null, shown: false};

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
    ["guidance_scale", p.guidance_scale], ["seed", p.seed]];
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

const usesKey = () => !!sessionStorage.getItem(KEY);
const endpoint = () => `${location.origin}/v1/videos`;

function curlOf(job) {
  const q = (s) => `'${s.replace(/'/g, "'\\''")}'`;
  return [`curl -sS ${q(endpoint())}`, ...(usesKey() ? ['-H "Authorization: Bearer $REPLICADP_API_KEY"'] : []),
    ...fields(job).map(([k, v]) => `--form-string ${q(`${k}=${v}`)}`)].join(" \\\n  ");
}

function pythonOf(job) {
  // JSON's string literals are Python's too.
  const s = JSON.stringify;
  return [...(usesKey() ? ["import os", ""] : []), "import requests", "", "form = {",
    ...fields(job).map(([k, v]) => `    ${s(k)}: ${s(v)},`), "}",
    usesKey() ? "headers = {\"Authorization\": f\"Bearer {os.environ['REPLICADP_API_KEY']}\"}" : "headers = {}",
    `job = requests.post(${s(endpoint())}, files={k: (None, v) for k, v in form.items()}, headers=headers).json()`,
    "print(job[\"id\"], job[\"status\"])"].join("\n");
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
  player.setAttribute("aria-label", `Video: ${short(job.prompt, 80)}`);
  player.hidden = $("actions").hidden = $("details").hidden = false;
  blobUrl(`${jobPath(job.id)}/poster`).then((url) => { player.poster = url; $("first-frame").src = url; },
    () => { $("first-frame").hidden = true; });
  const download = $("download");
  download.download = `${slug(job.prompt)}-seed${p.seed != null ? p.seed : job.seed}.mp4`;
  blobUrl(`${jobPath(job.id)}/content`).then((url) => {
    player.src = url;
    download.href = url;
    download.removeAttribute("aria-disabled");
  }, (err) => { $("note").textContent = `The video could not be loaded: ${err.message}`; });
  metaInto($("inputs"), [["Prompt", job.prompt], ["Negative prompt", p.negative_prompt || "(none)"],
    ["Size", job.size], ["Length", `${job.num_frames} frames at ${job.fps} fps (${(job.num_frames / job.fps).toFixed(1)} s)`],
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
  rerun.setAttribute("aria-label", `Re-run with the same inputs${job.priority ? ` and priority (${job.priority})` : ""}`);
  rerun.disabled = !job.params || p.image_sha256 != null;
  if (p.image_sha256 != null) {
    $("note").textContent = "This video started from an uploaded first frame, which the gateway does not keep: " +
      "edit it in the form and choose the image again.";
  }
  $("edit").href = `/ui?from=${encodeURIComponent(job.id)}`;
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
  const phase = phaseOf(entry, job);
  if (["decoding", "encoding", "storing", "cancelling"].includes(phase)) $("progress").removeAttribute("value");
  else $("progress").value = job.progress;
  $("status").textContent = statusText(entry, job);
}

const reruns = () => mine().filter((e) => e.compareTo && e.compareTo.id === VIDEO_ID);

function renderReruns() {
  const list = reruns();
  $("reruns-box").hidden = !list.length;
  renderList($("requests"), list);
}

async function rerun() {
  const job = vp.job;
  $("rerun").disabled = true;
  try {
    const sent = await submit(formOf(job), {id: job.id, frames_sha256: job.frames_sha256});
    $("note").textContent = `Re-run queued (${sent.id}): it shows under Re-runs until it ends.`;
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
    $("note").textContent = `This browser did not let the page copy: the request as ${what} is below, to select and copy.`;
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
  $("copy-curl").addEventListener("click", () => copy("curl"));
  $("copy-python").addEventListener("click", () => copy("python"));
  renderReruns();
  fillCompared(reruns()).then(renderReruns);
  poll();
}

start();
