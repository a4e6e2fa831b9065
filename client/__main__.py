"""`python -m client`: the replicadp command without an installed entry point (the GPU check runs it so)."""

from .cli import main

main()
