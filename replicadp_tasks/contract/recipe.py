"""A sampling recipe: how a distilled (few-step) model samples, as its authors publish it, and part of how it is
served. A replica's model may have one (REPLICADP_RECIPE, or the recipe of an adapter fused into it at load), and so
may a registered adapter that a request switches on (model/adapters.py). A request to it gets the recipe's steps
and guidance by default, and is refused, naming the field, where it asks for others (unless the recipe is not
`strict`); its scheduler, shift and timesteps are part of the request's identity (`sampling`).

Written as a TOML inline table, the same in REPLICADP_RECIPE and in an adapter's `recipe` key, e.g. Wan2.2
Lightning's and LightX2V's 4-step distillations:

    {num_inference_steps = 4, guidance_scale = 1.0, scheduler = "flow-match-euler", shift = 5.0,
     timesteps = [1000, 750, 500, 250]}
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass
from enum import StrEnum

from .errors import InvalidRequest, ModelLoadError
from .limits import MAX_GUIDANCE, MAX_STEPS


class Scheduler(StrEnum):
    """The schedulers a recipe may name (model/sampling.py builds them)."""

    MODEL = "model"  # the checkpoint's own (Wan's: UniPC with its flow shift)
    FLOW_MATCH_EULER = "flow-match-euler"  # first-order flow matching, what step-distilled Wan models are trained for
    UNIPC = "unipc"  # Wan's own solver, with the recipe's shift


# The request fields a recipe sets (its defaults), and so may refuse where a request asks for others.
RECIPE_FIELDS = ("num_inference_steps", "guidance_scale", "guidance_scale_2")
KEYS = (*RECIPE_FIELDS, "scheduler", "shift", "timesteps", "strict")
NUM_TRAIN_TIMESTEPS = 1000  # Wan's schedulers': a recipe's timesteps are on this scale


@dataclass(frozen=True)
class Recipe:
    """A few-step model's sampling: its steps and guidance (1.0: no CFG, one transformer pass a step), its
    scheduler with its shift, and its explicit timesteps where its authors fix them (then the steps are as many)."""

    num_inference_steps: int
    guidance_scale: float = 1.0
    guidance_scale_2: float | None = None  # two-expert models: the low-noise expert's (None: guidance_scale)
    scheduler: Scheduler = Scheduler.MODEL
    shift: float | None = None  # the flow shift (None: the scheduler's own)
    timesteps: tuple[int, ...] | None = None  # on NUM_TRAIN_TIMESTEPS' scale, before the shift
    strict: bool = True  # a request may not ask other steps or guidance than these

    def defaults(self, experts: int | None = 1) -> dict:
        """What a request to it leaves out, filled in; for a model of two `experts`, the low-noise expert's guidance
        too (its own, else guidance_scale: a distilled model's experts are both unguided)."""
        out = {"num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale}
        if experts == 2:
            out["guidance_scale_2"] = self.guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        return out

    def check(self, given: dict, whose: str) -> None:
        """InvalidRequest naming the first of a request's fields (`given`: as the caller gave them) that asks what
        this recipe cannot do: steps other than its timesteps', or, strict, other steps or guidance than its own.
        `whose`: what the recipe belongs to, for the message ("this model", "adapter 'lightning'")."""
        steps = given.get("num_inference_steps")
        if self.timesteps is not None and steps is not None and steps != len(self.timesteps):
            raise InvalidRequest.of("num_inference_steps", f"{whose} samples at its recipe's {len(self.timesteps)} "
                                    f"fixed timesteps ({self.describe()}); leave the field out or give "
                                    f"{len(self.timesteps)}", value=steps)
        if not self.strict:
            return
        for name, own in self.defaults(experts=2).items():
            if given.get(name) is not None and given[name] != own:
                raise InvalidRequest.of(name, f"{whose} is distilled to sample with {name}={own:g} ({self.describe()});"
                                        f" leave the field out or give {own:g}", value=given[name])

    def sampling(self) -> dict:
        """What about its sampling a request's params do not say: part of the request's identity."""
        out = {"scheduler": str(self.scheduler), "shift": self.shift}
        return out | ({"timesteps": list(self.timesteps)} if self.timesteps is not None else {})

    def describe(self) -> str:
        """One line, e.g. `4 steps, guidance 1, flow-match-euler shift 5, timesteps 1000/750/500/250`."""
        text = f"{self.num_inference_steps} steps, guidance {self.guidance_scale:g}, {self.scheduler}"
        text += f" shift {self.shift:g}" if self.shift is not None else ""
        return text + (f", timesteps {'/'.join(map(str, self.timesteps))}" if self.timesteps else "")

    def to_wire(self) -> dict:
        """As JSON carries it (ReplicaInfo)."""
        out = asdict(self)
        return out | {"scheduler": str(self.scheduler),
                      "timesteps": None if self.timesteps is None else list(self.timesteps)}

    @classmethod
    def from_wire(cls, fields: dict) -> "Recipe":
        return cls(**{**fields, "scheduler": Scheduler(fields["scheduler"]),
                      "timesteps": None if fields.get("timesteps") is None else tuple(fields["timesteps"])})


def parse_recipe(text: str, where: str) -> Recipe:
    """A recipe written as a TOML inline table (REPLICADP_RECIPE); ModelLoadError naming `where` otherwise."""
    try:
        table = tomllib.loads(f"recipe = {text}")["recipe"]
    except tomllib.TOMLDecodeError as exc:
        raise ModelLoadError(f"{where}: not a TOML inline table {{num_inference_steps = 4, ...}}: {exc}") from exc
    return read_recipe(table, where)


def read_recipe(table, where: str) -> Recipe:
    """A recipe from its table (an adapter's `recipe`, or REPLICADP_RECIPE's), checked: ModelLoadError naming
    `where` and the key that is wrong."""
    def number(key: str, lo: float, hi: float) -> float | None:
        value = table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not lo <= value <= hi:
            raise ModelLoadError(f"{where}: {key}={value!r} must be a number from {lo:g} to {hi:g}")
        return float(value)

    if not isinstance(table, dict) or set(table) - set(KEYS):
        got = sorted(table) if isinstance(table, dict) else table
        raise ModelLoadError(f"{where}: a recipe is a table of {', '.join(KEYS)}; got {got!r}")
    timesteps = table.get("timesteps")
    if timesteps is not None and (not isinstance(timesteps, list) or not timesteps or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 < t <= NUM_TRAIN_TIMESTEPS for t in timesteps)
            or sorted(set(timesteps), reverse=True) != timesteps):
        raise ModelLoadError(f"{where}: timesteps={timesteps!r} must be decreasing integers from "
                             f"{NUM_TRAIN_TIMESTEPS} down to above 0")
    steps = table.get("num_inference_steps", len(timesteps) if timesteps else None)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ModelLoadError(f"{where}: num_inference_steps={steps!r} must be an integer from 1 to {MAX_STEPS}")
    if timesteps is not None and steps != len(timesteps):
        raise ModelLoadError(f"{where}: num_inference_steps={steps} but {len(timesteps)} timesteps")
    scheduler = table.get("scheduler", Scheduler.MODEL)
    if scheduler not in list(Scheduler):
        raise ModelLoadError(f"{where}: scheduler={scheduler!r} must be one of {', '.join(Scheduler)}")
    if timesteps is not None and scheduler != Scheduler.FLOW_MATCH_EULER:
        raise ModelLoadError(f"{where}: timesteps are taken by scheduler = \"{Scheduler.FLOW_MATCH_EULER}\" only")
    if table.get("shift") is not None and scheduler == Scheduler.MODEL:
        raise ModelLoadError(f"{where}: shift needs a scheduler other than \"{Scheduler.MODEL}\" (whose shift is "
                             "the checkpoint's)")
    if not isinstance(table.get("strict", True), bool):
        raise ModelLoadError(f"{where}: strict={table['strict']!r} must be true or false")
    guidance = number("guidance_scale", 0.0, MAX_GUIDANCE)
    return Recipe(num_inference_steps=steps, guidance_scale=1.0 if guidance is None else guidance,
                  guidance_scale_2=number("guidance_scale_2", 0.0, MAX_GUIDANCE), scheduler=Scheduler(scheduler),
                  shift=number("shift", 0.01, 100.0), timesteps=None if timesteps is None else tuple(timesteps),
                  strict=table.get("strict", True))
