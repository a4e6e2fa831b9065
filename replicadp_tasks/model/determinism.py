"""Reproducible numerics: the same input gives the same frames in every replica process of one kind of
machine and software (REPLICADP_DETERMINISTIC, on by default).

CPU: Intel MKL, torch's BLAS on x86, chooses kernels by its operands' memory alignment and by the code path it
dispatches to at run time, so two processes can differ in the last bits of a matrix product, and 30 denoising
steps carry that into the frames, unless MKL's conditional numerical reproducibility is on (`MKL_CBWR=AUTO,STRICT`;
docs/isolation.md has the measurements). oneDNN (the
VAE's convolutions) and torch's own vectorised kernels depend on the instruction set and the thread count, both
fixed for a replica (REPLICADP_THREADS); `torch.use_deterministic_algorithms` covers the few ops whose default
kernel is not deterministic.

CUDA: cuBLAS gives reproducible results only with a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, read when
cuBLAS starts), and cuDNN's autotuner may pick another algorithm in each process (`benchmark`), so both are
pinned. An op that has no deterministic CUDA kernel warns (in the replica's log) instead of failing requests.
`REPLICADP_DETERMINISTIC=0` leaves all of this to the libraries' defaults, for speed; scripts/gpu_check.sh
measures what it costs.
"""

from __future__ import annotations

import os

# Read by the native libraries when they start: set before torch is imported. A value already set wins; an empty
# one counts as unset.
ENVIRONMENT = {"MKL_CBWR": "AUTO,STRICT", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def set_environment() -> None:
    """Before the first `import torch` of the process: the libraries' reproducibility switches."""
    for name, value in ENVIRONMENT.items():
        if not os.environ.get(name):
            os.environ[name] = value


def set_torch() -> None:
    """After the import: deterministic kernels, and no cuDNN autotuning."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
