"""Exact GP regression with GPyTorch: the model, a training loop (Adam or L-BFGS), prediction and metrics.

This is the baseline every gpnys preconditioner is compared against: with ``exact=True`` the training loop
forces GPyTorch's Cholesky path (``max_cholesky_size`` above n), so loss and gradients are exact.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gpytorch
import torch
from tqdm.auto import tqdm

from gpnys.kernels import make_kernel

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll", "hyperparameters", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "lbfgs")


class ExactGPModel(gpytorch.models.ExactGP):
    """``y = f(X) + eps``, ``f ~ GP(m, s^2 k_l)``, ``eps ~ N(0, sigma^2)``.

    Args:
        train_x: ``(n, d)``; train_y: ``(n,)``.
        likelihood: a ``GaussianLikelihood``.
        kernel: a name from :data:`gpnys.kernels.KERNEL_NAMES` (wrapped in a ``ScaleKernel``) or a kernel.
        ard: one length-scale per input dimension (only with a kernel name).
        mean: ``"constant"`` or ``"zero"``.
    """

    def __init__(
        self,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        kernel: str | gpytorch.kernels.Kernel = "rbf",
        ard: bool = False,
        mean: str = "constant",
    ) -> None:
        super().__init__(train_x, train_y, likelihood)
        if mean == "constant":
            self.mean_module = gpytorch.means.ConstantMean()
        elif mean == "zero":
            self.mean_module = gpytorch.means.ZeroMean()
        else:
            raise ValueError(f"mean must be 'constant' or 'zero', got {mean!r}")
        if isinstance(kernel, str):
            kernel = make_kernel(kernel, ard_num_dims=train_x.shape[-1] if ard else None)
        self.covar_module = kernel

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def hyperparameters(model: gpytorch.models.ExactGP) -> dict[str, float | list[float]]:
    """Constrained hyperparameters as plain numbers: lengthscale (list if ARD), outputscale, noise, mean."""
    out: dict[str, float | list[float]] = {}
    kern = model.covar_module
    base = getattr(kern, "base_kernel", kern)
    ls = base.lengthscale.detach().reshape(-1)
    out["lengthscale"] = ls.tolist() if ls.numel() > 1 else float(ls)
    if hasattr(kern, "outputscale"):
        out["outputscale"] = float(kern.outputscale.detach())
    out["noise"] = float(model.likelihood.noise.detach().reshape(-1)[0])
    if hasattr(model.mean_module, "constant"):
        out["mean"] = float(model.mean_module.constant.detach().reshape(-1)[0])
    return out


@dataclass
class FitResult:
    """What a training run produced: ``loss_trace[t]`` = negative MLL per point at iteration t."""

    loss_trace: list[float] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    train_time_s: float = 0.0
    iterations: int = 0


@contextlib.contextmanager
def _exact_settings(n: int) -> Iterator[None]:
    with gpytorch.settings.max_cholesky_size(n + 1), gpytorch.settings.fast_computations(False, False, False):
        yield


def fit(
    model: gpytorch.models.ExactGP,
    iters: int = 100,
    lr: float = 0.1,
    optimizer: str = "adam",
    progress: bool = True,
    seed: int = 0,
    settings: Callable[[int], contextlib.AbstractContextManager] | None = None,
    on_step: Callable[[int, float], dict[str, Any] | None] | None = None,
) -> FitResult:
    """Maximise the exact marginal likelihood of ``model`` (its likelihood attached) by Adam or L-BFGS.

    Args:
        model: an ``ExactGP`` with a ``GaussianLikelihood`` as ``model.likelihood``.
        iters: optimiser iterations (L-BFGS: one iteration with strong-Wolfe line search per step).
        lr: learning rate (Adam) or initial step (L-BFGS).
        optimizer: ``"adam"`` or ``"lbfgs"``.
        progress: show a tqdm progress bar with the current loss.
        seed: seeds torch's global generator so stochastic estimators are reproducible.
        settings: context-manager factory ``settings(n)`` wrapping every loss evaluation; default is the
            exact (Cholesky) path.
        on_step: called as ``on_step(t, loss)`` after every step; a returned dict is shown in the progress bar
            and appended to ``FitResult.steps``.

    Returns:
        :class:`FitResult`.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if isinstance(iters, bool) or int(iters) != iters or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be positive and finite, got {lr!r}")
    torch.manual_seed(seed)
    likelihood = model.likelihood
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    params = [p for p in model.parameters() if p.requires_grad]
    n = model.train_inputs[0].shape[-2]
    ctx = settings or _exact_settings
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr)
    else:
        opt = torch.optim.LBFGS(params, lr=lr, max_iter=1, history_size=10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with ctx(n):
            loss = -mll(model(*model.train_inputs), model.train_targets)
        loss.backward()
        return loss

    result = FitResult()
    start = time.perf_counter()
    bar = tqdm(range(iters), desc="fit", disable=not progress, leave=True)
    for _ in bar:
        loss = float(opt.step(closure).detach())
        result.loss_trace.append(loss)
        extra = on_step(len(result.loss_trace) - 1, loss) if on_step is not None else None
        if extra:
            result.steps.append(extra)
        bar.set_postfix(loss=f"{loss:.4f}", **(extra or {}))
    result.train_time_s = time.perf_counter() - start
    result.iterations = iters
    return result


def predict(
    model: gpytorch.models.ExactGP, test_x: torch.Tensor, settings: contextlib.AbstractContextManager | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictive mean and variance of ``y`` (noise included) at ``test_x (m, d)``. Returns ``((m,), (m,))``."""
    model.eval()
    model.likelihood.eval()
    n = model.train_inputs[0].shape[-2]
    with torch.no_grad(), (settings or _exact_settings(n)):
        pred = model.likelihood(model(test_x))
        return pred.mean, pred.variance


def gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> float:
    """Mean negative log predictive density of ``y`` under independent ``N(mean, var)``."""
    return float((0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean).square() / var).mean())
