"""The bounds of a request's numbers and texts, as request.py checks a request and recipe.py a recipe."""

MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 200
MAX_GUIDANCE = 20.0
MAX_FPS = 120
MAX_SEQUENCE_LENGTH = 512
MAX_SEED = 2**63 - 1
