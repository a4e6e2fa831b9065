"""The scheduler a sampling recipe names (contract/recipe.py), built from the checkpoint's own: what a few-step
model, or a request with a few-step adapter, samples with."""

from __future__ import annotations

from functools import cache

from ..contract.recipe import NUM_TRAIN_TIMESTEPS, Recipe, Scheduler


def scheduler_for(own, recipe: Recipe | None):
    """The scheduler that samples `recipe` (`own`, the pipeline's, where it names none of its own)."""
    if recipe is None or recipe.scheduler == Scheduler.MODEL:
        return own
    if recipe.scheduler == Scheduler.UNIPC:
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler.from_config(own.config, flow_shift=recipe.shift or own.config.get("flow_shift"))
    scheduler = _euler_class()(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=recipe.shift or 1.0)
    if recipe.timesteps is not None:
        # A hidden config key: a copy made from the config (architectures.expert_steps) keeps the timesteps.
        scheduler.register_to_config(_recipe_timesteps=list(recipe.timesteps))
    return scheduler


@cache  # one class: diffusers is imported when a model loads, not with this module
def _euler_class():
    """FlowMatchEulerDiscreteScheduler that samples at the recipe's fixed timesteps, where it has them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class RecipeEulerScheduler(FlowMatchEulerDiscreteScheduler):
        """As LightX2V's step-distill scheduler samples: each fixed timestep t is the noise level t / 1000, shifted
        by the recipe's shift (the timestep the transformer sees is the shifted level x 1000). The pipelines ask
        for a step count only; the recipe has refused any other than its timesteps' count."""

        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            fixed = self.config.get("_recipe_timesteps")
            if fixed is None:
                return super().set_timesteps(num_inference_steps, device=device, **kwargs)
            return super().set_timesteps(device=device, sigmas=[t / NUM_TRAIN_TIMESTEPS for t in fixed])

    return RecipeEulerScheduler
