"""One value + gradient of the negative marginal log-likelihood by several estimators, for comparisons.

``evaluate(...)`` builds an ``ExactGP`` (zero mean, ``ScaleKernel`` over an isotropic or ARD kernel) at given
hyperparameters and returns the loss ``-MLL / n`` (as GPyTorch's ``-ExactMarginalLogLikelihood``) and its
gradient with respect to the raw (softplus) parameters ``raw_lengthscale``, ``raw_outputscale``, ``raw_noise``.

Methods: ``exact`` (Cholesky, in at least float64: the reference), ``gpytorch`` (GPyTorch's defaults: CG + SLQ
with its rank-15 pivoted Cholesky, CG tolerance 1, 10 probes), and every gpnys preconditioner name through
:func:`gpnys.gp.hook.use_preconditioner`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_choice
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel
from gpnys.linalg import synchronize
from gpnys.precond.strategy import PRECONDITIONERS

__all__ = ["evaluate", "grad_errors", "validate_inputs", "METHODS"]

METHODS = ("exact", "gpytorch") + tuple(n for n in PRECONDITIONERS if n != "none")

#: lower bound of the likelihood's noise constraint in :func:`evaluate` (``GreaterThan(1e-6)``)
NOISE_LOWER_BOUND = 1e-6


def _model(X, y, kernel, lengthscale, outputscale, noise, ard):
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(NOISE_LOWER_BOUND))
    model = ExactGPModel(X, y, lik, kernel=kernel, ard=ard, mean="zero").to(X)
    model.covar_module.base_kernel.lengthscale = lengthscale
    model.covar_module.outputscale = outputscale
    lik.noise = noise
    return model


def validate_inputs(
    X: torch.Tensor, y: torch.Tensor, lengthscale: float | torch.Tensor, outputscale: float, noise: float
) -> None:
    """``ValueError`` naming the argument for mismatched shapes, NaN/inf, or non-positive hyperparameters."""
    if X.dim() != 2 or y.dim() != 1 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X must be (n, d) and y (n,) with the same n, got {tuple(X.shape)} and {tuple(y.shape)}")
    if not (torch.isfinite(X).all() and torch.isfinite(y).all()):
        raise ValueError("X or y contains NaN or inf")
    for name, val in (("outputscale", outputscale), ("noise", noise)):
        if not float(val) > 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if not float(noise) > NOISE_LOWER_BOUND:
        raise ValueError(f"noise must exceed the likelihood's lower bound {NOISE_LOWER_BOUND:g}, got {noise}")
    if not bool((torch.as_tensor(lengthscale) > 0).all()):
        raise ValueError(f"lengthscale must be positive, got {lengthscale}")


def evaluate(
    X: torch.Tensor,
    y: torch.Tensor,
    method: str,
    kernel: str = "rbf",
    lengthscale: float | torch.Tensor = 1.0,
    outputscale: float = 1.0,
    noise: float = 0.1,
    ard: bool = False,
    seed: int = 0,
    settings: EstimatorSettings | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Loss and raw-parameter gradient of ``-MLL / n`` by ``method``.

    Args:
        X: ``(n, d)`` inputs; y: ``(n,)`` targets.
        method: one of :data:`METHODS`.
        kernel: kernel name; lengthscale: scalar or ``(d,)`` with ``ard=True``; outputscale, noise: positive.
        seed: seeds torch (probes) and the preconditioner.
        settings: passed to :func:`use_preconditioner` for gpnys methods, with ``solver="iterative"``: a gpnys
            method is measured on its preconditioned path even where ``auto`` would take Cholesky.
        **options: passed to :func:`use_preconditioner` for gpnys methods.

    Returns:
        ``{"method", "loss", "grad": {"raw_lengthscale": float | list, "raw_outputscale", "raw_noise"},
        "time_s", "extra"}``, plus ``"loss_std_error"`` and ``"grad_std_error"`` (keyed like ``grad``): the
        standard errors of the estimate (:mod:`gpnys.gp.estimator`; 0 for ``exact``; absent for ``gpytorch`` and
        with ``settings.error_bars=False``). ``time_s`` is the value and the backward pass, timed after a garbage
        collection.

        ``exact`` is a float64 reference: with float32 ``X`` it evaluates Cholesky in float64 on the same
        float32-rounded data and hyperparameters (a float32 Cholesky is itself 0.2-0.6 % off on the gradient at
        small noise), so the other methods' errors against it are their own. Its ``time_s`` is of that float64
        evaluation.

    Example:
        >>> import torch
        >>> from gpnys.baselines.mll import evaluate, grad_errors
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(200, 2, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64)
        >>> exact = evaluate(X, y, "exact", lengthscale=0.3, noise=0.01)
        >>> est = evaluate(X, y, "auto", lengthscale=0.3, noise=0.01)  # PCG + SLQ, its standard errors
        >>> abs(est["loss"] - exact["loss"]) < 3 * est["loss_std_error"]
        True
        >>> max(grad_errors(est["grad"], exact["grad"]).values()) < 0.01  # every component within 1 %
        True
    """
    validate_choice(method, "method", METHODS)
    validate_inputs(X, y, lengthscale, outputscale, noise)
    torch.manual_seed(seed)
    model = _model(X, y, kernel, lengthscale, outputscale, noise, ard)
    if method == "exact":
        # the reference runs in at least float64 (float32 Cholesky is not accurate enough to measure the estimators
        # against), on the caller's rounded data and parameters: .to converts the stored values exactly
        ref_dtype = torch.promote_types(X.dtype, torch.float64)
        model = model.to(dtype=ref_dtype)
        X, y = X.to(ref_dtype), y.to(ref_dtype)
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    extra: dict[str, Any] = {}
    if method == "exact":
        ctx: Any = gpytorch.settings.max_cholesky_size(X.shape[0] + 1)
    elif method == "gpytorch":
        ctx = gpytorch.settings.max_cholesky_size(0)
    else:
        # the named method's preconditioned path, whatever "auto" would choose at this n (gpnys.gp.path)
        settings = dataclasses.replace(settings or EstimatorSettings(), solver="iterative")
        ctx = use_preconditioner(model, method, settings=settings, seed=seed, **options)
    synchronize(X.device)  # time the GPU's work, not its queue
    # no method pays for collecting an earlier one's garbage: GPyTorch's left reference cycles holding n x n buffers,
    # and a gpnys evaluation right after one took 0.4-0.7 s longer at n = 8 000 than after a collection
    gc.collect()
    t0 = time.perf_counter()
    with ctx as hook:
        loss = -mll(model(X), y)
        loss.backward()
    synchronize(X.device)
    elapsed = time.perf_counter() - t0
    if method not in ("exact", "gpytorch"):
        rec = hook.history[-1]
        extra = {"precond": rec.kind, "rank": rec.rank, "setup_s": rec.setup_s, "cg_iterations": hook.applications,
                 "kernel_fraction": hook.kernel_fraction, "path": hook.path, "path_reason": hook.path_reason}

    def g(p: torch.Tensor) -> float | list[float]:
        v = p.grad.detach().reshape(-1)
        return v.tolist() if v.numel() > 1 else float(v)

    raw = {
        "raw_lengthscale": model.covar_module.base_kernel.raw_lengthscale,
        "raw_outputscale": model.covar_module.raw_outputscale,
        "raw_noise": model.likelihood.noise_covar.raw_noise,
    }
    grad = {key: g(p) for key, p in raw.items()}
    out = {"method": method, "loss": float(loss.detach()), "grad": grad, "time_s": elapsed, "extra": extra}
    if method == "exact":  # the reference: no estimation error
        out["loss_std_error"] = 0.0
        out["grad_std_error"] = {key: (0.0 if not isinstance(v, list) else [0.0] * len(v)) for key, v in grad.items()}
    elif method != "gpytorch" and hook.last_estimate is not None and hook.last_estimate.grad_std_error:
        est = hook.last_estimate.per_point()
        names = {id(p): name for name, p in model.named_parameters()}
        out["loss_std_error"] = est["loss_std_error"]
        out["grad_std_error"] = {key: est["grad_std_error"][names[id(p)]] for key, p in raw.items()}
        extra.update(probes=est["probes"], cg_iterations_max=est["cg_iterations"])
    return out


def grad_errors(grad: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Per-component error ``|g - g*| / max(|g*|, 0.1 ||g*||_2)`` (max over ARD entries), the ``grad_rel_error``
    of ``gpnys mll`` (docs/cli.md): relative for the large components, relative to a tenth of the gradient's norm
    for the near-zero ones.

    Example:
        >>> from gpnys.baselines.mll import grad_errors
        >>> ref = {"raw_lengthscale": 1.0, "raw_outputscale": -2.0, "raw_noise": 0.0}
        >>> est = {"raw_lengthscale": 1.1, "raw_outputscale": -2.0, "raw_noise": 0.01}
        >>> {k: round(v, 4) for k, v in grad_errors(est, ref).items()}
        {'raw_lengthscale': 0.1, 'raw_outputscale': 0.0, 'raw_noise': 0.0447}
    """
    flat = {k: torch.as_tensor(v, dtype=torch.float64).reshape(-1) for k, v in ref.items()}
    norm = torch.cat(list(flat.values())).norm()
    out = {}
    for k, r in flat.items():
        v = torch.as_tensor(grad[k], dtype=torch.float64).reshape(-1)
        out[k] = float(((v - r).abs() / torch.clamp(r.abs(), min=0.1 * float(norm))).max())
    return out

