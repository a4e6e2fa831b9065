"""The pipeline holder: one resident Wan pipeline per replica, loaded once and reused for every request.

Imports no Celery; torch and diffusers are imported when the model loads, so that a Celery main process
that imports this module never initialises CUDA (a forked child could not use it afterwards).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import adapters, determinism, hub
from . import parallel
from .architectures import (ARCHITECTURES, architecture, architecture_of, build_components, build_pipeline,
                            build_tokenizer, expert_steps, request_flops, video_tokens)
from ..contract.errors import GroupLost, InvalidRequest, ModelLoadError, OutOfMemory
from .memory import Offload, models_of, shortfall
from .memory import apply as apply_offload
from .memory import check as check_memory
from .parallel import Followers, Layout
from .quantization import Quantize, quantize
from .step_cache import CacheMethod, Quality, StepCache
from ..contract.request import REFERENCE_WORK, GenerateRequest
from ..outputs.video import to_uint8

TINY_SPECS = {"tiny": "wan2.2-ti2v", "tiny-wan2.1": "wan2.1-t2v", "tiny-a14b": "wan2.2-t2v-a14b",
              "tiny-i2v-a14b": "wan2.2-i2v-a14b"}
# The pipeline classes a model folder's model_index.json may name (`_class_name`).
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
# `random:ARCH` builds architecture ARCH (architectures.py) with random weights on the replica's GPU: the full
# compute of a model whose weights cannot be downloaded here.
RANDOM_PREFIX = "random:"
COMPILE_MODES = ("none", "blocks", "full")
# `synthetic:SECONDS` is a benchmark-only backend: SECONDS per request of the reference size, scaled by work;
# `synthetic:SECONDS:DECODE` then spends DECODE seconds after its last step, as a real pipeline decodes its latents.
SYNTHETIC_PREFIX = "synthetic:"


def synthetic_seconds(spec: str) -> tuple[float, float] | None:
    """(SECONDS, DECODE) of a `synthetic:SECONDS[:DECODE]` spec (DECODE 0 when left out), or None for a real
    model."""
    if not spec.startswith(SYNTHETIC_PREFIX):
        return None
    parts = spec[len(SYNTHETIC_PREFIX):].split(":")
    try:
        seconds = [float(p) for p in parts] + [0.0] * (2 - len(parts))
    except ValueError:
        seconds = [-1.0]
    if len(seconds) != 2 or not all(0 <= s < 86400 for s in seconds):
        raise ModelLoadError(f"REPLICADP_MODEL={spec!r}: expected synthetic:SECONDS or synthetic:SECONDS:DECODE "
                             "with 0 <= each < 86400")
    return seconds[0], seconds[1]


def resolve_model(spec: str, model_cache: Path) -> str:
    """A model spec to the local folder from_pretrained loads: a hub model is downloaded first (hub.py)."""
    if spec in TINY_SPECS:
        from .tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(model_cache / spec, TINY_SPECS[spec]))
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser().resolve())
    if spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"REPLICADP_MODEL={spec!r}: no such folder")
    return hub.download(spec)


def pipeline_class(folder: str):
    """The diffusers pipeline class that `folder`'s model_index.json names; ValueError for another one."""
    import diffusers

    name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
    if name not in PIPELINE_CLASSES:
        raise ValueError(f"model_index.json names {name!r}; replicadp serves {', '.join(PIPELINE_CLASSES)}")
    return getattr(diffusers, name)


@dataclass(frozen=True)
class RunStats:
    """What one request cost: the denoising loop's time (the DiT's share), its FLOPs, and peak memory."""

    dit_s: float | None
    dit_flops: int | None
    peak_memory_gib: float | None  # CUDA: what the allocator held at most, on all the replica's GPUs; CPU: max RSS


def describe_device(device: str) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{device} (CUDA_VISIBLE_DEVICES={visible})" if device.startswith("cuda") and visible else device


class PipelineHolder:
    """Holds the loaded pipeline; `generate` runs one request on it."""

    def __init__(self, spec: str, *, model_cache: Path, threads: int = 1, vae_tiling: bool = False,
                 attention: str = "native", compile: str = "none", deterministic: bool = True,
                 cache: StepCache = StepCache(CacheMethod.NONE), quantize: Quantize = Quantize.NONE,
                 offload: Offload = Offload.NONE, memory_gib: float | None = None, layout: Layout = Layout(),
                 rank: int = 0, store_path: str | None = None, parallel_timeout_s: float = 60.0,
                 load_timeout_s: float = 900.0, on_group_lost: Callable[[str], None] | None = None,
                 loras_file: str | None = None):
        self.spec = spec
        self.model_cache = model_cache
        self.threads = threads
        self.vae_tiling = vae_tiling
        self.attention = attention
        self.compile = compile
        self.deterministic = deterministic
        self.cache = cache
        self.quantize = quantize
        self.offload = offload
        self.memory_gib = memory_gib
        # REPLICADP_PARALLEL (parallel.py): this process is `rank` of the layout's ranks; rank 0 starts the others.
        self.layout = layout
        self.rank = rank
        self.store_path = store_path  # the group's rendezvous file (parallel.new_store), made by rank 0
        self.parallel_timeout_s = parallel_timeout_s
        self.load_timeout_s = load_timeout_s  # also how long the ranks wait for each other to start
        self.on_group_lost = on_group_lost
        self.followers: Followers | None = None
        self.guidance: parallel.GuidanceSplit | None = None  # cfg:2's split of each step's two passes
        # Why this replica's group of ranks cannot serve another request (out of memory on a rank mid-request left
        # them apart): its pool child ends before the next request is counted (tasks.py), and the next one rebuilds.
        self.group_broken: str | None = None
        self.loras_file = loras_file  # REPLICADP_LORAS (adapters.py)
        self.adapters: list[adapters.Adapter] = []  # loaded at start, each switched on only by the requests naming it
        self.pipe = None
        self._i2v = None
        self.device = "cpu"
        self.devices: list[str] = ["cpu"]
        synthetic = synthetic_seconds(spec)
        self.synthetic_s, self.synthetic_decode_s = synthetic or (None, 0.0)
        self.last_run: RunStats | None = None

    @classmethod
    def from_settings(cls, settings, **kwargs) -> "PipelineHolder":
        """The holder a replica's settings (settings.Settings) describe; `kwargs`: this process's place in them."""
        return cls(settings.model, model_cache=settings.model_cache, threads=settings.threads,
                   vae_tiling=settings.vae_tiling, attention=settings.attention, compile=settings.compile,
                   deterministic=settings.deterministic, cache=StepCache.from_settings(settings),
                   quantize=settings.quantize, offload=settings.offload, memory_gib=settings.device_memory_gib,
                   layout=settings.parallel, parallel_timeout_s=settings.parallel_timeout_s,
                   load_timeout_s=settings.load_timeout_s, loras_file=settings.loras_file, **kwargs)

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: VAE downsampling times the patch size."""
        if self.synthetic_s is not None:
            return 16
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    @property
    def accepts_image(self) -> bool:
        """TI2V models (Wan2.2-TI2V-5B) take a first frame, and image-to-video ones (Wan2.2-I2V-A14B) need one;
        Wan2.1/2.2 T2V have no image channels."""
        return self.synthetic_s is not None or bool(self.pipe.config.get("expand_timesteps")) or self.requires_image

    @property
    def requires_image(self) -> bool:
        """An image-to-video model (WanImageToVideoPipeline, as Wan2.2-I2V-A14B) cannot run without a first frame."""
        if self.synthetic_s is not None:
            return False
        from diffusers import WanImageToVideoPipeline

        return isinstance(self.pipe, WanImageToVideoPipeline)

    @property
    def expert_count(self) -> int:
        """The model's transformers: 2 for Wan2.2 A14B, which take guidance_scale_2 and boundary_ratio, else 1."""
        return 1 if self.synthetic_s is not None else len(experts(self.pipe))

    @property
    def boundary_ratio(self) -> float | None:
        """Where a two-expert model switches from `transformer` to `transformer_2`, as a share of the scheduler's
        training timesteps (the pipeline's config); None for one expert."""
        return None if self.synthetic_s is not None else self.pipe.config.get("boundary_ratio")

    @property
    def request_defaults(self) -> dict:
        """The model's own defaults for what a request leaves out (Wan2.2 A14B's guidance for each expert), from the
        architecture the loaded model is; none for a model of another one, or the synthetic backend."""
        if self.synthetic_s is not None:
            return {}
        name = architecture_of(self.pipe.transformer.config, self.boundary_ratio, self.requires_image)
        return {} if name is None else ARCHITECTURES[name].request_defaults

    @property
    def qualities(self) -> list[str]:
        """The paths a request may ask for: the exact one, and the fast one where the deployment has a step cache."""
        return [Quality.STANDARD] if self.synthetic_s is not None else self.cache.qualities

    @property
    def lora_scales(self) -> dict[str, float]:
        """The registered adapters a request may name, each with its default scale (validate.check_loras)."""
        return {a.name: a.scale for a in self.adapters}

    def served(self, req: GenerateRequest) -> dict:
        """What about this deployment changes a request's output besides its inputs and the model: the step cache
        (fast requests), a layout over several ranks (ring's merge rounds otherwise), the quantization, and the
        files of the adapters the request names (a name registered anew to other weights is another input). Part
        of the input's identity (validate.input_key) and its Result."""
        served = {"cache": str(self.cache)} if req.quality == Quality.FAST else {}
        served |= {"parallel": str(self.layout)} if self.layout.size > 1 else {}
        served |= {"quantize": str(self.quantize)} if self.quantize != Quantize.NONE else {}
        files = {a.name: a.sha256 for a in self.adapters}
        return served | ({"loras": {name: files[name] for name, _ in req.loras}} if req.loras else {})

    def load(self) -> None:
        """Load the pipeline onto this replica's device(s)."""
        if self.synthetic_s is not None:
            self.device = "cpu (synthetic benchmark backend)"
            return
        if self.compile not in COMPILE_MODES:
            raise ModelLoadError(f"REPLICADP_COMPILE={self.compile!r}: expected one of {', '.join(COMPILE_MODES)}")
        if self.compile != "none" and self.cache.method != CacheMethod.NONE:
            # diffusers' cache hooks are torch.compiler.disable'd functions inside the blocks that compile traces
            # whole (fullgraph): every fast request would fail (tried on the tiny model, each method).
            raise ModelLoadError(f"REPLICADP_CACHE={self.cache.method} cannot be combined with REPLICADP_COMPILE="
                                 f"{self.compile}: the cache's hooks cannot be compiled; choose one of them")
        registrations = adapters.read_registry(self.loras_file)
        for setting, value, default in (("REPLICADP_COMPILE", self.compile, "none"),
                                        ("REPLICADP_QUANTIZE", self.quantize, Quantize.NONE),
                                        ("REPLICADP_OFFLOAD", self.offload, Offload.NONE),
                                        ("REPLICADP_PARALLEL", str(self.layout), "none")):
            if registrations and value != default:
                # Not run yet with adapters switched per request (compile would trace them in or out, FP8 and
                # offloading move the layers peft wraps, followers would need the same switching): refused.
                raise ModelLoadError(f"REPLICADP_LORAS cannot be combined with {setting}={value}: not supported yet; "
                                     "choose one of them")
        if self.deterministic:
            determinism.set_environment()  # before torch starts MKL and cuBLAS
        import diffusers
        import torch
        import transformers
        from diffusers import AutoencoderKLWan

        # Load-time progress bars would fill the replica's log with carriage returns.
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        if self.deterministic:
            determinism.set_torch()
        # 1. The device(s) and dtypes: bf16 on CUDA with the VAE in fp32 (bf16 VAE decoding shows banding), on
        #    every GPU this replica sees (GPUS_PER_REPLICA); fp32 on CPU, with a fixed thread count so that
        #    replicas share the cores.
        if torch.cuda.is_available():
            self.devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            self.device, dtype = "cuda", torch.bfloat16
        else:
            self.devices, self.device, dtype = ["cpu"], "cpu", torch.float32
            torch.set_num_threads(self.threads)
        if self.layout.size > 1:
            self._join_group()
        # 2. The memory option checked against what each device has, before any weight reaches a GPU: from the
        #    random architecture's meta build, or the checkpoint loaded into CPU memory (from_pretrained: the same
        #    path for a hub model, a local folder and `tiny`, built into the model cache on first use).
        try:
            if self.spec.startswith(RANDOM_PREFIX):
                name = self.spec[len(RANDOM_PREFIX):]
                arch = architecture(name)  # an unknown one: ValueError naming the choices
                if self.device == "cpu" and not name.startswith("tiny-"):
                    tiny = ", ".join(f"random:{n}" for n in ARCHITECTURES if n.startswith("tiny-"))
                    raise ValueError(f"a full-size architecture is built on a GPU, and this replica has none "
                                     f"(on a CPU, use one of {tiny})")
                with torch.device("meta"):
                    fits_whole = self._check_memory(build_components(arch, build_tokenizer(), dtype))
                # Built directly on the GPU (minutes faster than on the CPU) where it fits whole.
                on_gpu = self.offload == Offload.NONE or fits_whole
                pipe = build_pipeline(name, device=self.devices[0] if on_gpu else "cpu", dtype=dtype)
            else:
                source = resolve_model(self.spec, self.model_cache)
                # The folder's class: an I2V A14B model is a WanImageToVideoPipeline. Both load `transformer_2`
                # and `boundary_ratio` where model_index.json has them (Wan2.2 A14B).
                cls = pipeline_class(source)
                vae = AutoencoderKLWan.from_pretrained(source, subfolder="vae", dtype=torch.float32)
                pipe = cls.from_pretrained(source, vae=vae, dtype=dtype)
                self._check_memory(models_of(pipe))
        except (OSError, ValueError, EnvironmentError) as exc:
            raise ModelLoadError(f"REPLICADP_MODEL={self.spec!r}: cannot load: {exc}") from exc
        if self.cache.method == CacheMethod.MAG and len(experts(pipe)) > 1:
            # calibrate-mag measures one transformer's residuals at every step; an expert runs only some of them.
            raise ModelLoadError(f"REPLICADP_CACHE={self.cache.method}: MagCache's ratios are calibrated on one "
                                 f"transformer, and {self.spec!r} has two experts; choose one of "
                                 f"{', '.join(m for m in CacheMethod if m not in (CacheMethod.NONE, CacheMethod.MAG))}")
        if self.offload == Offload.NONE:
            place(pipe, self.devices)
        else:
            apply_offload(pipe, self.offload, self.devices[0])
        # The registered LoRA adapters, into the experts on their devices; all off until a request names them.
        self.adapters = adapters.load(pipe, registrations)
        # 3. Fidelity for speed, for every request: an FP8 transformer (REPLICADP_QUANTIZE), before it is compiled.
        #    The step cache is the other such option, installed per fast request (generate).
        quantize(pipe, self.quantize, self.device, self.devices)
        # 4. Speed: the attention kernels, each expert's passes split over the ranks (REPLICADP_PARALLEL), and
        #    compilation of each expert (on the first request of a shape).
        for expert in experts(pipe):
            try:
                expert.set_attention_backend(self.attention)
            except (ValueError, RuntimeError, ImportError) as exc:
                raise ModelLoadError(f"REPLICADP_ATTENTION={self.attention!r}: {exc}") from exc
        if self.layout.size > 1:
            parallel.check_heads(self.layout, pipe.transformer.config.num_attention_heads)
            try:
                self.guidance = parallel.enable(experts(pipe), self.layout, self.devices[0])
            except ValueError as exc:  # an attention backend without context parallelism
                raise ModelLoadError(f"REPLICADP_PARALLEL={self.layout} with REPLICADP_ATTENTION={self.attention!r}: "
                                     f"{exc}") from exc
        for expert in experts(pipe):
            if self.compile == "blocks":
                expert.compile_repeated_blocks(fullgraph=True)
            elif self.compile == "full":
                expert.compile(fullgraph=True)
        # 5. Options that trade speed for memory (the weights' place is step 2's).
        if self.vae_tiling:
            pipe.vae.enable_tiling()
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe

    def _join_group(self) -> None:
        """REPLICADP_PARALLEL: refuse what this deployment cannot split (by name), start the followers (rank 0),
        join the group, and keep this rank's own GPU (one per rank)."""
        options = {s: str(v) for s, v, default in (
            ("REPLICADP_OFFLOAD", self.offload, Offload.NONE), ("REPLICADP_COMPILE", self.compile, "none"),
            ("REPLICADP_QUANTIZE", self.quantize, Quantize.NONE)) if v != default}
        if self.cache.method in (CacheMethod.FIRST_BLOCK, CacheMethod.MAG) or (
                self.layout.cfg > 1 and self.cache.method != CacheMethod.NONE):
            # FirstBlock and Mag decide from the transformer's output, of which each sequence rank holds its own
            # slice: ranks may disagree. Every cache keeps its state per pass ("cond", "uncond"), and a cfg rank 1
            # runs the unconditional pass in the conditional one's context.
            options["REPLICADP_CACHE"] = str(self.cache.method)
        parallel.check(self.layout, devices=self.devices, device=self.device, attention=self.attention,
                       options=options)
        if self.rank == 0:
            if not self.spec.startswith(RANDOM_PREFIX):
                # In place before any follower looks (and before any rank joins: a model that transformers saves
                # in a process group is written by its rank 0 alone, and `tiny` is saved on first use).
                try:
                    resolve_model(self.spec, self.model_cache)
                except (OSError, ValueError) as exc:
                    raise ModelLoadError(f"REPLICADP_MODEL={self.spec!r}: cannot load: {exc}") from exc
            self.store_path = parallel.new_store()
            self.followers = Followers(self.layout, self.store_path, self.on_group_lost)
        self.devices = [self.devices[self.rank]] if self.device == "cuda" else self.devices
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(self.devices[0])
        parallel.join(self.rank, self.layout, self.store_path, self.devices[0], self.parallel_timeout_s,
                      self.load_timeout_s)

    def _device_memory(self) -> tuple[list[int | None], str]:
        """Each device's memory for the weights, and where the figure comes from: a GPU's free memory at load, or
        REPLICADP_DEVICE_MEMORY_GIB where that is lower (the allocator is then held to it); a CPU's: the setting
        alone (None: not checked)."""
        import torch

        cap = None if self.memory_gib is None else int(self.memory_gib * 2**30)
        if self.device != "cuda":
            return [cap], f"REPLICADP_DEVICE_MEMORY_GIB={self.memory_gib:g}" if cap is not None else "not checked"
        free = [torch.cuda.mem_get_info(d)[0] for d in self.devices]
        if cap is None or cap >= min(free):
            return free, "free at load"
        for d in self.devices:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.mem_get_info(d)[1]), d)
        return [cap] * len(self.devices), f"REPLICADP_DEVICE_MEMORY_GIB={self.memory_gib:g}"

    def _check_memory(self, models: dict) -> bool:
        """ModelLoadError naming REPLICADP_OFFLOAD, the need and the device's memory where the option does not fit
        (memory.py), or where it cannot be combined with this deployment's other choices. Returns whether every
        model would fit resident as well."""
        for setting, value, default in (("REPLICADP_QUANTIZE", self.quantize, Quantize.NONE),
                                        ("REPLICADP_COMPILE", self.compile, "none")):
            if self.offload != Offload.NONE and value != default:
                # Neither has run on offloaded weights (torchao quantizes and compile traces modules in place).
                raise ModelLoadError(f"REPLICADP_OFFLOAD={self.offload} cannot be combined with {setting}={value}: "
                                     "not supported yet; choose one of them")
        have, limit = self._device_memory()
        where = placement(list(models), len(self.devices))
        check_memory(models, self.offload, self.devices, have, where, streamed=self.device == "cuda", limit=limit)
        return shortfall(models, Offload.NONE, self.devices, have, where, streamed=False) is None

    def generate(self, req: GenerateRequest, image=None,
                 on_step: Callable[[int, int], None] | None = None) -> np.ndarray | None:
        """Run one request; return uint8 frames shaped (num_frames, height, width, 3) (None on a follower rank).

        `image` is a PIL first frame: optional for TI2V, required for I2V (InvalidRequest naming `image` without
        one); `on_step(step, total)` is called after each denoising step.
        """
        if self.synthetic_s is not None:
            return self._synthetic(req, image, on_step)
        import torch

        # 1. A CPU generator seeded per request: the noise is the same on any device and any replica.
        generator = torch.Generator("cpu").manual_seed(req.seed)
        marks: list[float] = []  # the ends of the first and the last denoising step, the GPU's work included
        last = req.num_inference_steps - 1

        stopped: list[BaseException] = []  # what stopped the request at a step boundary (rank 0's on_step)

        def callback(pipe, step, timestep, callback_kwargs):
            if step in (0, last):  # only these two: a wait for the GPU at every step would drain its queue
                self._synchronize()
                marks.append(time.perf_counter())
            if on_step is not None:
                try:
                    on_step(step + 1, req.num_inference_steps)
                except Exception as exc:  # a cancel: every rank must leave the call at this step
                    stopped.append(exc)
            if self.layout.size > 1 and parallel.agree(bool(stopped), self.devices[0]) and not stopped:
                stopped.append(parallel.Stopped(f"rank 0 stopped the request at step {step + 1}"))
            if stopped:
                raise stopped[0]
            return callback_kwargs

        kwargs = dict(
            prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
            num_frames=req.num_frames, num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale, max_sequence_length=req.max_sequence_length,
            # A follower's frames would be thrown away: it stops at the latents (the VAE decode has no collective).
            generator=generator, output_type="np" if self.rank == 0 else "latent", callback_on_step_end=callback,
        )
        if req.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = req.guidance_scale_2
        self._reset_peak_memory()
        # 2. Text-to-video on the resident pipeline, or image-to-video: on the pipeline itself for an I2V model,
        #    on a view sharing its weights for TI2V.
        pipe = self.pipe
        if self.requires_image:
            if image is None:
                raise InvalidRequest.of("image", f"model {self.spec!r} is image-to-video and needs a first frame")
            kwargs["image"] = image
        elif image is not None:
            if self._i2v is None:
                from diffusers import WanImageToVideoPipeline

                self._i2v = WanImageToVideoPipeline.from_pipe(self.pipe)
                self._i2v.set_progress_bar_config(disable=True)  # from_pipe does not carry it over
            pipe, kwargs["image"] = self._i2v, image
        # 3. A layout over several ranks (REPLICADP_PARALLEL) splits the video tokens evenly over its sequence
        #    ranks; rank 0 hands every follower the request, and all run the same call.
        if self.layout.sequence > 1:
            tokens = video_tokens(self.pipe.transformer.config, height=req.height, width=req.width,
                                  num_frames=req.num_frames, vae_spatial=self.pipe.vae_scale_factor_spatial,
                                  vae_temporal=self.pipe.vae_scale_factor_temporal)
            if tokens % self.layout.sequence:
                raise InvalidRequest.of("height x width x num_frames", f"its {tokens} video tokens do not split "
                                        f"over the replica's {self.layout.sequence} sequence ranks (REPLICADP_PARALLEL="
                                        f"{self.layout}); choose a size or frame count whose token count they divide",
                                        value=f"{req.height}x{req.width}x{req.num_frames}")
        if self.followers is not None:
            if self.followers.lost is not None:
                raise GroupLost(self.followers.lost)
            self.followers.send(req, image)
        # 4. What this request alone changes on the shared pipeline: its LoRA adapters, the fast path's step cache
        #    hooks, and a two-expert request's own boundary (diffusers reads boundary_ratio from the pipeline's
        #    config). All are undone at its end, also when it fails half-way: no such state outlives its request
        #    (adapters.py, step_cache.py).
        boundary = self.boundary_ratio
        if req.quality == Quality.FAST:  # on each expert, with state of its own (the i2v view shares them)
            for expert in experts(self.pipe):
                expert.enable_cache(self.cache.config(req.num_inference_steps, lambda: pipe.current_timestep))
        oom = None
        try:
            if self.adapters:  # exactly the request's adapters and scales (none: all off); the i2v view shares them
                adapters.activate(self.pipe, req.loras)
            if req.boundary_ratio is not None:
                pipe.register_to_config(boundary_ratio=req.boundary_ratio)
            with torch.inference_mode():
                if self.guidance is not None:
                    self._split_guidance(pipe, req, kwargs)
                frames = pipe(**kwargs).frames[0]
        except Exception as exc:
            if stopped and exc is stopped[0]:
                raise
            if is_out_of_memory(exc):
                oom = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if self.layout.size > 1:
                # The ranks may now be anywhere in the call: the group cannot go on. Out of memory on any rank fails
                # the request all the same (it would fail again), and the group is rebuilt before the next one.
                oom = f"rank {self.rank}: {oom}" if oom else self.followers and self.followers.out_of_memory()
                if not oom:
                    raise GroupLost(f"rank {self.rank}: {type(exc).__name__}: {str(exc)[:300]}") from exc
                self.group_broken = oom
                if self.followers is not None:
                    self.followers.close(kill=True)
            elif oom is None:
                raise
        finally:
            if self.adapters:
                adapters.deactivate(self.pipe)
            if self.guidance is not None:
                self.guidance.reset()
            if req.boundary_ratio is not None:
                pipe.register_to_config(boundary_ratio=boundary)
            if req.quality == Quality.FAST:
                for expert in experts(self.pipe):
                    expert.disable_cache()
        if oom is not None:
            # 5. Out of memory fails this request only. Free its memory here, outside the except block: until
            # then the traceback keeps every frame of the pipeline, and with them the request's tensors.
            self.free_memory()
            raise OutOfMemory(f"height={req.height} width={req.width} num_frames={req.num_frames}: out of memory on "
                              f"{describe_device(self.device)} ({oom}); the replica serves on"
                              + (" once its ranks have formed their group again" if self.group_broken else ""))
        if self.rank > 0:
            return None
        # 6. Canonical uint8 frames; the shape must be what was asked (validation ruled out any rounding).
        frames = to_uint8(np.asarray(frames))
        expected = (req.num_frames, req.height, req.width, 3)
        if frames.shape != expected:
            raise RuntimeError(f"pipeline returned frames of shape {frames.shape}, expected {expected}")
        # 7. What it cost. The first step's start is not observed: the loop time is extrapolated from the others.
        n = req.num_inference_steps
        dit_s = (marks[-1] - marks[0]) * n / (n - 1) if len(marks) == 2 else None
        self.last_run = RunStats(dit_s=dit_s, dit_flops=self.dit_flops(req), peak_memory_gib=self._peak_memory_gib())
        return frames

    def _split_guidance(self, pipe, req: GenerateRequest, kwargs: dict) -> None:
        """cfg:2 (parallel.GuidanceSplit): the prompts encoded here as the pipeline would encode them, so that the
        cfg rank 1 holds the negative prompt's embeddings at a step's first call."""
        guided = req.guidance_scale > 1.0  # the pipelines' own rule (do_classifier_free_guidance)
        kwargs["prompt_embeds"], kwargs["negative_prompt_embeds"] = pipe.encode_prompt(
            prompt=kwargs.pop("prompt"), negative_prompt=kwargs.pop("negative_prompt"),
            do_classifier_free_guidance=guided, max_sequence_length=req.max_sequence_length,
            device=pipe._execution_device)
        self.guidance.negative = kwargs["negative_prompt_embeds"] if guided else None

    def dit_flops(self, req: GenerateRequest) -> int:
        """The transformers' FLOPs for `req`, both experts together (see expert_flops)."""
        return sum(self.expert_flops(req).values())

    def expert_flops(self, req: GenerateRequest) -> dict[str, int]:
        """Each expert's FLOPs for `req` (architectures.request_flops), over the steps it runs: for two experts,
        the steps the scheduler puts at or above the boundary go to `transformer`, the others to `transformer_2`."""
        pipe = self.pipe
        boundary = self.boundary_ratio if req.boundary_ratio is None else req.boundary_ratio
        split = expert_steps(pipe.scheduler, req.num_inference_steps, boundary)
        return {name: request_flops(
                    expert.config, height=req.height, width=req.width, num_frames=req.num_frames, steps=steps,
                    guidance=req.guidance_scale > 1.0, vae_spatial=pipe.vae_scale_factor_spatial,
                    vae_temporal=pipe.vae_scale_factor_temporal,
                    per_token_timesteps=bool(pipe.config.get("expand_timesteps")), text_len=req.max_sequence_length)
                for name, expert, steps in zip(("transformer", "transformer_2"), experts(pipe), split)}

    def _synchronize(self) -> None:
        import torch

        if self.device == "cuda":
            for device in self.devices:
                torch.cuda.synchronize(device)

    def _reset_peak_memory(self) -> None:
        import torch

        if self.device == "cuda":
            for device in self.devices:
                torch.cuda.reset_peak_memory_stats(device)

    def _peak_memory_gib(self) -> float:
        import torch

        if self.device == "cuda":
            held = sum(torch.cuda.max_memory_reserved(device) for device in self.devices)
        else:
            held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return round(held / 2**30, 3)

    def free_memory(self) -> None:
        """Give back what the last request left: Python garbage, then the CUDA caching allocator's blocks, or
        on the CPU the heap that glibc keeps after large frees."""
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc
                pass

    def _synthetic(self, req: GenerateRequest, image, on_step) -> np.ndarray:
        """Benchmark-only: sleep the request's share of SECONDS step by step (so 8 replicas fit on 2 cores), and
        DECODE after the last step, then return frames that are a function of the inputs alone: one flat colour
        per frame."""
        work = req.height * req.width * req.num_frames * req.num_inference_steps
        duration = self.synthetic_s * work / REFERENCE_WORK
        start = time.monotonic()
        for step in range(1, req.num_inference_steps + 1):
            # Absolute deadlines: progress reporting does not stretch the request. A step with no time left does
            # not sleep: time.sleep(0) would hand the GIL to the finisher's thread and wait to get it back.
            left = start + duration * step / req.num_inference_steps - time.monotonic()
            if left > 0:
                time.sleep(left)
            if on_step is not None:
                on_step(step, req.num_inference_steps)
        time.sleep(self.synthetic_decode_s)
        seed = hashlib.sha256(json.dumps(req.params(), sort_keys=True).encode())  # not request_id
        if image is not None:
            seed.update(image.tobytes())
        stream = b"".join(hashlib.sha256(seed.digest() + i.to_bytes(4, "big")).digest()
                          for i in range(req.num_frames * 3 // 32 + 1))
        # Each frame's colour repeated as bytes, written into one buffer: 0.1 ms for 128x128x33 here, where joining
        # the frames' bytes took 1.6 and numpy's broadcast copy 2.4.
        size = req.height * req.width * 3
        frames = bytearray(req.num_frames * size)
        for i in range(req.num_frames):
            frames[i * size:(i + 1) * size] = stream[3 * i:3 * i + 3] * (req.height * req.width)
        self.last_run = RunStats(dit_s=None, dit_flops=None, peak_memory_gib=None)
        return np.frombuffer(frames, np.uint8).reshape(req.num_frames, req.height, req.width, 3)


def experts(pipe) -> list:
    """The pipeline's transformers: `transformer`, and `transformer_2` (the low-noise expert) for Wan2.2 A14B."""
    return [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]


def placement(components, gpus: int) -> dict[str, int]:
    """Which of `gpus` devices (by index) holds each of `components` (names): on one, all on it; across several,
    the transformer and `transformer_2` (both experts) on the second, the text encoder on the first, the VAE on
    the third if there is one, else on the first. place() and describe-model's memory check use it."""
    if gpus == 1:
        return {name: 0 for name in components}
    where = {"text_encoder": 0, "transformer": 1, "transformer_2": 1, "vae": 2 if gpus > 2 else 0}
    return {name: where[name] for name in components}


def place(pipe, devices: list[str]) -> None:
    """Put the pipeline's models on `devices` (see placement); across several GPUs (GPUS_PER_REPLICA),
    accelerate's hooks move each model's inputs to its device and its outputs back, so the pipeline's own code
    runs unchanged (its tensors live on the first hooked model's device)."""
    if len(devices) == 1:
        pipe.to(devices[0])
        return
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    models = [name for name in ("text_encoder", "transformer", "transformer_2", "vae")
              if getattr(pipe, name, None) is not None]
    for name, index in placement(models, len(devices)).items():
        module = getattr(pipe, name).to(devices[index])
        add_hook_to_module(module, AlignDevicesHook(execution_device=devices[index], io_same_device=True))


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError), or Python's MemoryError."""
    import torch

    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text)
