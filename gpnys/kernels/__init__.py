"""Kernels: GPyTorch kernel construction by name; the kernel operator and its backends are in the submodules.

Length-scales follow GPyTorch's convention: RBF ``exp(-r^2 / (2 l^2))``; Matérn ``nu`` with ``r / l``.
The AFN paper's Gaussian ``exp(-r^2 / l_paper^2)`` corresponds to ``l = l_paper / sqrt(2)``; convert at the
benchmark's edge only.
"""

from __future__ import annotations

import gpytorch

from gpnys.checks import validate_choice

__all__ = ["KERNEL_NAMES", "make_kernel", "base_kernel"]

#: CLI name -> Matérn smoothness (None = RBF)
KERNEL_NAMES: dict[str, float | None] = {"rbf": None, "matern12": 0.5, "matern32": 1.5, "matern52": 2.5}


def base_kernel(name: str, ard_num_dims: int | None = None) -> gpytorch.kernels.Kernel:
    """Unit-variance stationary kernel by name (``rbf``, ``matern12``, ``matern32``, ``matern52``).

    ``ard_num_dims=d`` gives one length-scale per input dimension; ``None`` an isotropic length-scale.
    """
    validate_choice(name, "kernel", KERNEL_NAMES)
    nu = KERNEL_NAMES[name]
    if nu is None:
        return gpytorch.kernels.RBFKernel(ard_num_dims=ard_num_dims)
    return gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=ard_num_dims)


def make_kernel(name: str, ard_num_dims: int | None = None) -> gpytorch.kernels.ScaleKernel:
    """``ScaleKernel(base_kernel(name, ard_num_dims))``: outputscale times a unit-variance kernel."""
    return gpytorch.kernels.ScaleKernel(base_kernel(name, ard_num_dims))
