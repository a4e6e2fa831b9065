"""The pipeline holder: one resident Wan pipeline per replica, loaded once and reused for every request.

Imports no Celery, no Redis and no settings (a replica's choices come in as ModelOptions); torch and diffusers are
imported when the model loads, so that a Celery main process that imports this module never initialises CUDA (a
forked child could not use it afterwards).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..contract.errors import GroupLost, InvalidRequest, ModelLoadError, OutOfMemory, RequestPreempted
from ..contract.recipe import Recipe, parse_recipe
from ..contract.request import Accepts, GenerateRequest, Quality
from . import adapters, compatibility, determinism, parallel
from .checkpoint import Checkpoint, ResumedScheduler, capture
from .architectures import (ARCHITECTURES, architecture, architecture_of, build_components, build_pipeline,
                            build_tokenizer, expert_steps, request_flops, tokens_of)
from .devices import (describe_device, device_memory, free_memory, is_out_of_memory, peak_memory_gib,
                      reset_peak_memory, synchronize)
from .layout import check as check_layout, check_heads
from .loading import RANDOM_PREFIX, pipeline_class, resolve_model
from .memory import Offload, apply as apply_offload, check as check_memory, models_of, place, shortfall
from .options import ModelOptions
from .parallel import Followers
from .quantization import Quantize, quantize
from .sampling import scheduler_for


@dataclass(frozen=True)
class RunStats:
    """What one request cost: the denoising loop's time (the DiT's share), its FLOPs, and peak memory."""

    dit_s: float | None
    dit_flops: int | None
    peak_memory_gib: float | None  # CUDA: what the allocator held at most, on all the replica's GPUs; CPU: max RSS


def experts(pipe) -> list:
    """The pipeline's transformers: `transformer`, and `transformer_2` (the low-noise expert) for Wan2.2 A14B."""
    return [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]


class PipelineHolder:
    """Holds the loaded pipeline; `generate` runs one request on it."""

    def __init__(self, options: ModelOptions, *, rank: int = 0, store_path: str | None = None,
                 on_group_lost: Callable[[str], None] | None = None):
        self.options = options
        # REPLICADP_PARALLEL (parallel.py): this process is `rank` of the layout's ranks; rank 0 starts the others,
        # and makes the group's rendezvous file (`store_path`, parallel.new_store); `on_group_lost` is told when a
        # follower dies.
        self.rank = rank
        self.store_path = store_path
        self.on_group_lost = on_group_lost
        self.followers: Followers | None = None
        self.guidance: parallel.GuidanceSplit | None = None  # cfg:2's split of each step's two passes
        # Why this replica's group of ranks cannot serve another request (out of memory on a rank mid-request left
        # them apart): its pool child ends before the next request is counted (PoolChild.check_group), and the
        # next one rebuilds it.
        self.group_broken: str | None = None
        self.adapters: list[adapters.Adapter] = []  # loaded at start, each switched on only by the requests naming it
        self.fused: list[adapters.Adapter] = []  # fused into the weights at load: part of the model
        self.recipe: Recipe | None = None  # the model's sampling recipe (a few-step model's), else None
        self.schedulers: dict[str, object] = {}  # a switched adapter's name -> the scheduler of its recipe
        self.pipe = None
        self._i2v = None
        self.device = "cpu"
        self.devices: list[str] = ["cpu"]
        self.last_run: RunStats | None = None

    # --- what the loaded model is and accepts ---------------------------------------------------------------

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: VAE downsampling times the patch size."""
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    @property
    def accepts_image(self) -> bool:
        """TI2V models (Wan2.2-TI2V-5B) take a first frame, and image-to-video ones (Wan2.2-I2V-A14B) need one;
        Wan2.1/2.2 T2V have no image channels."""
        return bool(self.pipe.config.get("expand_timesteps")) or self.requires_image

    @property
    def requires_image(self) -> bool:
        """An image-to-video model (WanImageToVideoPipeline, as Wan2.2-I2V-A14B) cannot run without a first frame."""
        from diffusers import WanImageToVideoPipeline

        return isinstance(self.pipe, WanImageToVideoPipeline)

    @property
    def expert_count(self) -> int:
        """The model's transformers: 2 for Wan2.2 A14B, which take guidance_scale_2 and boundary_ratio, else 1."""
        return len(experts(self.pipe))

    @property
    def boundary_ratio(self) -> float | None:
        """Where a two-expert model switches from `transformer` to `transformer_2`, as a share of the scheduler's
        training timesteps (the pipeline's config); None for one expert."""
        return self.pipe.config.get("boundary_ratio")

    @property
    def request_defaults(self) -> dict:
        """The model's own defaults for what a request leaves out (Wan2.2 A14B's guidance for each expert), from the
        architecture the loaded model is; none for a model of another one."""
        name = architecture_of(self.pipe.transformer.config, self.boundary_ratio, self.requires_image)
        return {} if name is None else ARCHITECTURES[name].request_defaults

    @property
    def qualities(self) -> list[str]:
        """The paths a request may ask for: the exact one, and the fast one where the deployment has a step cache."""
        return self.options.cache.qualities

    @property
    def lora_scales(self) -> dict[str, float]:
        """The registered adapters a request may name, each with its default scale."""
        return {a.name: a.scale for a in self.adapters}

    @property
    def accepts(self) -> Accepts:
        """What a request to this replica may ask for (contract.request.validate_request checks it)."""
        pipe = self.pipe
        return Accepts(size_multiple=self.size_multiple, qualities=tuple(self.qualities), experts=self.expert_count,
                       takes_image=self.accepts_image, requires_image=self.requires_image,
                       defaults=self.request_defaults, loras=self.lora_scales, recipe=self.recipe,
                       lora_recipes={a.name: a.recipe for a in self.adapters if a.recipe is not None},
                       sequence_ranks=self.options.layout.sequence, parallel=str(self.options.layout),
                       tokens=tokens_of(pipe.transformer.config, vae_spatial=pipe.vae_scale_factor_spatial,
                                        vae_temporal=pipe.vae_scale_factor_temporal))

    def served(self, req: GenerateRequest) -> dict:
        """What about this deployment changes a request's output besides its inputs and the model: the step cache
        (fast requests), a layout over several ranks (ring's merge rounds otherwise), the quantization, the files
        of the adapters fused into the model and of those the request names (a name registered anew to other
        weights is another input), and the scheduler, shift and timesteps of the recipe it samples with. Part of
        the input's identity (contract.request.input_key) and its Result."""
        o = self.options
        served = {"cache": str(o.cache)} if req.quality == Quality.FAST else {}
        served |= {"parallel": str(o.layout)} if o.layout.size > 1 else {}
        served |= {"quantize": str(o.quantize)} if o.quantize != Quantize.NONE else {}
        served |= {"fused": {a.name: a.sha256 for a in self.fused}} if self.fused else {}
        recipe = self.accepts.recipe_for(req.loras)
        served |= {"recipe": recipe[0].sampling()} if recipe else {}
        files = {a.name: a.sha256 for a in self.adapters}
        return served | ({"loras": {name: files[name] for name, _ in req.loras}} if req.loras else {})

    # --- loading ---------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the pipeline onto this replica's device(s)."""
        o = self.options
        # 1. What this deployment cannot combine, refused before anything loads; its adapters' registry, read.
        compatibility.check(o)
        registrations = adapters.read_registry(o.loras_file)
        recipe = self._model_recipe(registrations)
        # 2. The device(s) and dtype; with a layout over several ranks, the group.
        dtype = self._claim_devices()
        if o.layout.size > 1:
            self._join_group()
        # 3. The model, its memory option checked against what each device has before any weight reaches a GPU.
        pipe = self._build_or_load(dtype)
        compatibility.check_experts(o, len(experts(pipe)))
        # 4. Its adapters: those marked so fused into its weights (another model, then), the others all off until
        #    a request names one; the schedulers of its recipes.
        loaded = adapters.load(pipe, registrations)
        self.fused, self.adapters = [a for a in loaded if a.fused], [a for a in loaded if not a.fused]
        self._set_recipes(pipe, recipe)
        # 5. Its weights on the device(s), resident or offloaded.
        if o.offload == Offload.NONE:
            place(pipe, self.devices)
        else:
            apply_offload(pipe, o.offload, self.devices[0])
        # 6. Fidelity for speed, for every request: an FP8 transformer (REPLICADP_QUANTIZE), before it is compiled.
        #    The step cache is the other such option, installed per fast request (generate).
        quantize(pipe, o.quantize, self.device, self.devices)
        # 7. Speed: the attention kernels, each expert's passes split over the ranks, and compilation (on the first
        #    request of a shape).
        self._speed_up(pipe)
        # 8. Memory for speed: the VAE decodes in tiles.
        if o.vae_tiling:
            pipe.vae.enable_tiling()
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe

    def _model_recipe(self, registrations: list[adapters.Registration]) -> Recipe | None:
        """The model's sampling recipe: REPLICADP_RECIPE's, or that of the adapter fused into it with one;
        ModelLoadError where both give one."""
        fused = [r for r in registrations if r.fuse and r.recipe is not None]
        if self.options.recipe is None:
            return fused[0].recipe if fused else None
        if fused:
            raise ModelLoadError(f"REPLICADP_RECIPE={self.options.recipe!r} cannot be combined with REPLICADP_LORAS's "
                                 f"adapter {fused[0].name!r}, fused with a recipe of its own: give the recipe once")
        return parse_recipe(self.options.recipe, f"REPLICADP_RECIPE={self.options.recipe!r}")

    def _set_recipes(self, pipe, recipe: Recipe | None) -> None:
        """The model samples with its recipe's scheduler from now on; each switched adapter's recipe gets its own,
        for the requests naming it. ModelLoadError for a recipe giving guidance_scale_2 to a model of one expert."""
        recipes = [("REPLICADP_RECIPE", recipe)] + [(f"REPLICADP_LORAS: adapter {a.name!r}", a.recipe)
                                                    for a in self.adapters]
        for where, r in recipes:
            if r is not None and r.guidance_scale_2 is not None and len(experts(pipe)) == 1:
                raise ModelLoadError(f"{where}: guidance_scale_2 is for two-expert models; this one has one expert")
        self.recipe = recipe
        pipe.scheduler = scheduler_for(pipe.scheduler, recipe)
        self.schedulers = {a.name: scheduler_for(pipe.scheduler, a.recipe) for a in self.adapters
                           if a.recipe is not None}

    def _claim_devices(self):
        """The libraries (reproducible where asked: before torch starts MKL and cuBLAS), this replica's device(s)
        and the dtype: bf16 on CUDA (the VAE stays fp32: bf16 decoding shows banding), on every GPU this replica sees
        (GPUS_PER_REPLICA); fp32 on the CPU, with a fixed thread count so that replicas share the cores."""
        if self.options.deterministic:
            determinism.set_environment()
        import diffusers
        import torch
        import transformers

        # Load-time progress bars would fill the replica's log with carriage returns.
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        if self.options.deterministic:
            determinism.set_torch()
        if torch.cuda.is_available():
            self.devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
            self.device = "cuda"
            return torch.bfloat16
        self.devices, self.device = ["cpu"], "cpu"
        torch.set_num_threads(self.options.threads)
        return torch.float32

    def _join_group(self) -> None:
        """REPLICADP_PARALLEL: refuse a layout these devices and this attention backend cannot run, start the
        followers (rank 0), join the group, and keep this rank's own GPU (one per rank)."""
        o = self.options
        check_layout(o.layout, devices=self.devices, device=self.device, attention=o.attention)
        if self.rank == 0:
            if not o.spec.startswith(RANDOM_PREFIX):
                # In place before any follower looks (and before any rank joins: a model that transformers saves
                # in a process group is written by its rank 0 alone, and `tiny` is saved on first use).
                try:
                    resolve_model(o.spec, o.model_cache)
                except (OSError, ValueError) as exc:
                    raise ModelLoadError(f"REPLICADP_MODEL={o.spec!r}: cannot load: {exc}") from exc
            self.store_path = parallel.new_store()
            self.followers = Followers(o, self.store_path, self.on_group_lost)
        self.devices = [self.devices[self.rank]] if self.device == "cuda" else self.devices
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(self.devices[0])
        parallel.join(self.rank, o.layout, self.store_path, self.devices[0], o.parallel_timeout_s, o.load_timeout_s)

    def _build_or_load(self, dtype):
        """The pipeline, in CPU memory or (random:ARCH, where it fits whole) on the GPU: the random architecture
        built (its memory checked on a meta build first), or the checkpoint loaded with from_pretrained (the same
        path for a hub model, a local folder and `tiny`, built into the model cache on first use)."""
        spec = self.options.spec
        try:
            if spec.startswith(RANDOM_PREFIX):
                return self._build_random(spec[len(RANDOM_PREFIX):], dtype)
            import torch
            from diffusers import AutoencoderKLWan

            source = resolve_model(spec, self.options.model_cache)
            # The folder's class: an I2V A14B model is a WanImageToVideoPipeline. Both load `transformer_2` and
            # `boundary_ratio` where model_index.json has them (Wan2.2 A14B).
            cls = pipeline_class(source)
            vae = AutoencoderKLWan.from_pretrained(source, subfolder="vae", dtype=torch.float32)
            pipe = cls.from_pretrained(source, vae=vae, dtype=dtype)
            self._check_memory(models_of(pipe))
            return pipe
        except (OSError, ValueError, EnvironmentError) as exc:
            raise ModelLoadError(f"REPLICADP_MODEL={spec!r}: cannot load: {exc}") from exc

    def _build_random(self, name: str, dtype):
        """random:ARCH with random weights: on the GPU, where it fits whole (minutes faster than on the CPU)."""
        import torch

        arch = architecture(name)  # an unknown one: ValueError naming the choices
        if self.device == "cpu" and not name.startswith("tiny-"):
            tiny = ", ".join(f"random:{n}" for n in ARCHITECTURES if n.startswith("tiny-"))
            raise ValueError(f"a full-size architecture is built on a GPU, and this replica has none "
                             f"(on a CPU, use one of {tiny})")
        with torch.device("meta"):
            fits_whole = self._check_memory(build_components(arch, build_tokenizer(), dtype))
        on_gpu = self.options.offload == Offload.NONE or fits_whole
        return build_pipeline(name, device=self.devices[0] if on_gpu else "cpu", dtype=dtype)

    def _check_memory(self, models: dict) -> bool:
        """ModelLoadError naming REPLICADP_OFFLOAD, the need and the device's memory where the option does not fit
        (memory.py). Returns whether every model would fit resident as well."""
        devices = device_memory(self.device, self.devices, self.options.memory_gib)
        check_memory(models, self.options.offload, devices)
        return shortfall(models, Offload.NONE, devices) is None

    def _speed_up(self, pipe) -> None:
        """The attention backend of each expert; its passes split over the layout's ranks; its compilation."""
        o = self.options
        for expert in experts(pipe):
            try:
                expert.set_attention_backend(o.attention)
            except (ValueError, RuntimeError, ImportError) as exc:
                raise ModelLoadError(f"REPLICADP_ATTENTION={o.attention!r}: {exc}") from exc
        if o.layout.size > 1:
            check_heads(o.layout, pipe.transformer.config.num_attention_heads)
            try:
                self.guidance = parallel.enable(experts(pipe), o.layout, self.devices[0])
            except ValueError as exc:  # an attention backend without context parallelism
                raise ModelLoadError(f"REPLICADP_PARALLEL={o.layout} with REPLICADP_ATTENTION={o.attention!r}: "
                                     f"{exc}") from exc
        for expert in experts(pipe):
            if o.compile == "blocks":
                expert.compile_repeated_blocks(fullgraph=True)
            elif o.compile == "full":
                expert.compile(fullgraph=True)

    # --- a request -------------------------------------------------------------------------------------------

    def generate(self, req: GenerateRequest, image=None, on_step: Callable[[int, int], None] | None = None,
                 resume: Checkpoint | None = None) -> np.ndarray | None:
        """Run one request (validated for this model: `accepts`); return uint8 frames shaped (num_frames, height,
        width, 3) (None on a follower rank). `image` is a PIL first frame; `on_step(step, total)` is called after
        each denoising step, and what it raises stops the request at that step boundary (a cancel); a
        RequestPreempted raised there comes out with the request's Checkpoint (`checkpoint`), which `resume`
        takes to go on from that step, with the frames of a run never stopped."""
        import torch

        # 1. The call: on the resident pipeline, or for a first frame on a TI2V model, on a view sharing its
        #    weights; its arguments, with a CPU generator seeded per request (the noise is the same on any device
        #    and any replica), or a checkpoint's latents; a step callback that times the loop and stops it at a
        #    boundary.
        pipe, kwargs = self._call_for(req, image)
        if resume is not None:
            kwargs["latents"] = resume.latents
        steps = StepWatch(self, req.num_inference_steps, on_step, first=resume.step if resume else 0)
        kwargs["callback_on_step_end"] = steps
        # 2. A layout over several ranks: rank 0 hands every follower the request, and all run the same call.
        if self.followers is not None:
            if self.followers.lost is not None:
                raise GroupLost(self.followers.lost)
            self.followers.send(req, image, resume)
        # 3. Run it, with this request's own state on the shared pipeline, undone after it (_request_state).
        reset_peak_memory(self.device, self.devices)
        oom = None
        try:
            with self._request_state(req, pipe, resume), torch.inference_mode():
                if self.guidance is not None:
                    self._split_guidance(pipe, req, kwargs)
                frames = pipe(**kwargs).frames[0]
        except Exception as exc:
            if exc in steps.stopped:
                if isinstance(exc, RequestPreempted):
                    exc.checkpoint = steps.checkpoint if self.resumable(req) else None
                raise
            oom = self._out_of_memory(exc)
            if oom is None:
                raise
        # 4. Out of memory fails this request only. Its memory is freed here, outside the except block: until then
        #    the traceback keeps every frame of the pipeline, and with them the request's tensors.
        if oom is not None:
            free_memory()
            raise OutOfMemory(f"height={req.height} width={req.width} num_frames={req.num_frames}: out of memory on "
                              f"{describe_device(self.device)} ({oom}); the replica serves on"
                              + (" once its ranks have formed their group again" if self.group_broken else ""))
        if self.rank > 0:
            return None
        # 5. Canonical uint8 frames; the shape must be what was asked (validation ruled out any rounding).
        frames = to_uint8(np.asarray(frames))
        expected = (req.num_frames, req.height, req.width, 3)
        if frames.shape != expected:
            raise RuntimeError(f"pipeline returned frames of shape {frames.shape}, expected {expected}")
        # 6. What it cost.
        self.last_run = RunStats(dit_s=steps.loop_s(), dit_flops=self.dit_flops(req, steps.first),
                                 peak_memory_gib=peak_memory_gib(self.device, self.devices))
        return frames

    def _call_for(self, req: GenerateRequest, image) -> tuple[object, dict]:
        """The pipeline that runs `req` and the arguments of its call (without the step callback)."""
        import torch

        kwargs = dict(
            prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
            num_frames=req.num_frames, num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale, max_sequence_length=req.max_sequence_length,
            # A follower's frames would be thrown away: it stops at the latents (the VAE decode has no collective).
            generator=torch.Generator("cpu").manual_seed(req.seed), output_type="np" if self.rank == 0 else "latent",
        )
        if req.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = req.guidance_scale_2
        if self.requires_image:
            if image is None:  # a caller that skipped validate_request (Accepts.requires_image)
                raise InvalidRequest.of("image", f"model {self.options.spec!r} is image-to-video and needs a first "
                                        "frame")
            return self.pipe, {**kwargs, "image": image}
        if image is None:
            return self.pipe, kwargs
        kwargs["image"] = image
        if self._i2v is None:
            from diffusers import WanImageToVideoPipeline

            self._i2v = WanImageToVideoPipeline.from_pipe(self.pipe)
            self._i2v.set_progress_bar_config(disable=True)  # from_pipe does not carry it over
        return self._i2v, kwargs

    @contextmanager
    def _request_state(self, req: GenerateRequest, pipe, resume: Checkpoint | None = None):
        """What this request alone changes on the shared pipeline: its LoRA adapters, the fast path's step cache
        hooks (on each expert, with state of its own: the i2v view shares them), a two-expert request's own
        boundary (diffusers reads boundary_ratio from the pipeline's config), and the scheduler of its adapter's
        recipe (a fresh one, resumed at its checkpoint's step, for a resumed request). All are undone at its end,
        also when it fails half-way: no such state outlives its request (adapters.py, step_cache.py)."""
        boundary, scheduler = self.boundary_ratio, pipe.scheduler
        if req.quality == Quality.FAST:
            for expert in experts(self.pipe):
                expert.enable_cache(self.options.cache.config(req.num_inference_steps, lambda: pipe.current_timestep))
        try:
            if self.adapters:  # exactly the request's adapters and scales (none: all off); the i2v view shares them
                adapters.activate(self.pipe, req.loras)
            if req.boundary_ratio is not None:
                pipe.register_to_config(boundary_ratio=req.boundary_ratio)
            pipe.scheduler = self.scheduler_of(req)
            if resume is not None:
                own = pipe.scheduler
                pipe.scheduler = ResumedScheduler(type(own).from_config(own.config), resume, self.devices[0])
            yield
        finally:
            pipe.scheduler = scheduler
            if self.adapters:
                adapters.deactivate(self.pipe)
            if self.guidance is not None:
                self.guidance.reset()
            if req.boundary_ratio is not None:
                pipe.register_to_config(boundary_ratio=boundary)
            if req.quality == Quality.FAST:
                for expert in experts(self.pipe):
                    expert.disable_cache()

    def _out_of_memory(self, exc: Exception) -> str | None:
        """What the allocator said, where the call that raised `exc` ran out of memory (on this rank or, for a
        layout over several, on a follower), else None. A layout's ranks may now be anywhere in the call: any other
        error breaks the group (GroupLost: the request is requeued); an out of memory fails the request all the
        same (it would fail again), and the group is rebuilt before the next one."""
        oom = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if is_out_of_memory(exc) else None
        if self.options.layout.size == 1:
            return oom
        oom = f"rank {self.rank}: {oom}" if oom else self.followers and self.followers.out_of_memory()
        if not oom:
            raise GroupLost(f"rank {self.rank}: {type(exc).__name__}: {str(exc)[:300]}") from exc
        self.group_broken = oom
        if self.followers is not None:
            self.followers.close(kill=True)
        return oom

    def _split_guidance(self, pipe, req: GenerateRequest, kwargs: dict) -> None:
        """cfg:2 (parallel.GuidanceSplit): the prompts encoded here as the pipeline would encode them, so that the
        cfg rank 1 holds the negative prompt's embeddings at a step's first call."""
        guided = req.guidance_scale > 1.0  # the pipelines' own rule (do_classifier_free_guidance)
        kwargs["prompt_embeds"], kwargs["negative_prompt_embeds"] = pipe.encode_prompt(
            prompt=kwargs.pop("prompt"), negative_prompt=kwargs.pop("negative_prompt"),
            do_classifier_free_guidance=guided, max_sequence_length=req.max_sequence_length,
            device=pipe._execution_device)
        self.guidance.negative = kwargs["negative_prompt_embeds"] if guided else None

    def resumable(self, req: GenerateRequest) -> bool:
        """Whether `req`, preempted, can go on from its checkpoint with the frames of a run never stopped: not on
        the fast path (its step cache's state lives in hooks, and is not saved: it starts again)."""
        return req.quality != Quality.FAST

    def scheduler_of(self, req: GenerateRequest):
        """The scheduler `req` samples with: its adapter's recipe's, else the model's."""
        return next((self.schedulers[name] for name, _ in req.loras if name in self.schedulers), self.pipe.scheduler)

    def dit_flops(self, req: GenerateRequest, first: int = 0) -> int:
        """The transformers' FLOPs for `req`, both experts together (see expert_flops)."""
        return sum(self.expert_flops(req, first).values())

    def expert_flops(self, req: GenerateRequest, first: int = 0) -> dict[str, int]:
        """Each expert's FLOPs for `req` (architectures.request_flops), over the steps it runs after its `first`
        (a resumed request's): for two experts, the steps the scheduler puts at or above the boundary go to
        `transformer` (they come first), the others to `transformer_2`."""
        pipe = self.pipe
        boundary = self.boundary_ratio if req.boundary_ratio is None else req.boundary_ratio
        high, low = expert_steps(self.scheduler_of(req), req.num_inference_steps, boundary)
        split = (max(0, high - first), low - max(0, first - high))
        return {name: request_flops(
                    expert.config, height=req.height, width=req.width, num_frames=req.num_frames, steps=steps,
                    guidance=req.guidance_scale > 1.0, vae_spatial=pipe.vae_scale_factor_spatial,
                    vae_temporal=pipe.vae_scale_factor_temporal,
                    per_token_timesteps=bool(pipe.config.get("expand_timesteps")), text_len=req.max_sequence_length)
                for name, expert, steps in zip(("transformer", "transformer_2"), experts(pipe), split)}


class StepWatch:
    """The pipeline's step callback for one request: it times the denoising loop (the ends of its first and last
    steps, the GPU's work included: a wait for the GPU at every step would drain its queue), calls `on_step` after
    each step, and stops the call at the step boundary where `on_step` raises (a cancel, or a preemption: then it
    keeps the request's checkpoint): on every rank of a layout at once (parallel.agree). A resumed request's loop
    starts after its `first` steps: the pipeline counts from 0 again, the callback from `first`."""

    def __init__(self, holder: PipelineHolder, total: int, on_step: Callable[[int, int], None] | None,
                 first: int = 0):
        self.holder, self.total, self.on_step, self.first = holder, total, on_step, first
        self.marks: list[float] = []
        self.stopped: list[BaseException] = []  # what stopped the request at a step boundary (rank 0's on_step)
        self.checkpoint: Checkpoint | None = None  # where a preempted request stopped

    def __call__(self, pipe, index: int, timestep, callback_kwargs: dict) -> dict:
        holder, step = self.holder, self.first + index
        if step in (self.first, self.total - 1):
            synchronize(holder.device, holder.devices)
            self.marks.append(time.perf_counter())
        if self.on_step is not None:
            try:
                self.on_step(step + 1, self.total)
            except RequestPreempted as exc:
                self.checkpoint = capture(pipe.scheduler, step + 1, self.total, callback_kwargs["latents"])
                self.stopped.append(exc)
            except Exception as exc:  # a cancel: every rank must leave the call at this step
                self.stopped.append(exc)
        if holder.options.layout.size > 1 and parallel.agree(bool(self.stopped), holder.devices[0]) \
                and not self.stopped:
            self.stopped.append(parallel.Stopped(f"rank 0 stopped the request at step {step + 1}"))
        if self.stopped:
            raise self.stopped[0]
        return callback_kwargs

    def loop_s(self) -> float | None:
        """The denoising loop's time (a resumed request's: of the steps it ran). The first step's start is not
        observed: extrapolated from the others."""
        n = self.total - self.first
        return (self.marks[-1] - self.marks[0]) * n / (n - 1) if len(self.marks) == 2 else None


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] (what the pipeline returns with output_type="np") to uint8."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)
