"""One reduced method on a train/test split, as a JSON-able record (shared by ``gpnys reduce`` and
``benchmarks/reduced_compare.py``).

Record fields: ``method``, ``m`` (landmarks; RFF: frequencies, ``2m`` features), ``landmarks`` (rule),
``fit_s``, ``predict_s``, ``test_rmse`` and ``test_nll`` (original units of y when a ``Standardizer`` is given;
NLL only where a variance exists, noise included), ``error_vs_exact`` (RKHS distance ``|f - f*|_H`` of the
predictor to the full GP's, [SPA] eq. (15)/(19); ``None`` for RFF, whose predictor is not in that RKHS) and
``mean_rmse_vs_exact`` (RMS difference of the predictive means over the test points, in the units of
``test_rmse``; ``error_vs_exact`` is in the scale the GP is fitted in).
"""

from __future__ import annotations

import time
from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_choice
from gpnys.gp.training import gaussian_nll
from gpnys.landmarks.rules import choose_m, select_landmarks
from gpnys.reduced.error import ExactPosterior, landmark_rkhs_error, rkhs_error
from gpnys.reduced.models import reduced_posterior
from gpnys.reduced.nytro import nytro
from gpnys.reduced.nytro import predict as nytro_predict

__all__ = ["evaluate_method", "EVAL_METHODS"]

EVAL_METHODS = ("exact", "gsa", "lla", "ncr", "nytro", "rff")


def _metrics(yt: torch.Tensor, mean: torch.Tensor, var: torch.Tensor | None, noise: float, transform) -> dict:
    if transform is not None:
        yt, mean = transform.inverse_y(yt), transform.inverse_y(mean)
    out: dict[str, Any] = {"test_rmse": float((mean - yt).square().mean().sqrt()), "test_nll": None}
    if var is not None:
        v = var + noise
        v = transform.inverse_variance(v) if transform is not None else v
        out["test_nll"] = gaussian_nll(yt, mean, v)
    return out


def evaluate_method(method: str, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor,
                    Xt: torch.Tensor, yt: torch.Tensor, noise: float, prior_mean: float = 0.0, m: int | str = 500,
                    landmarks: str | None = None, seed: int = 0, exact: ExactPosterior | None = None, transform=None,
                    nytro_t_max: int = 500, **options: Any) -> dict[str, Any]:
    """Fit ``method`` (one of :data:`EVAL_METHODS`) on ``(X (n, d), y (n,))``, predict at ``Xt``, score on ``yt``.

    ``exact``: the full GP posterior to compare against (needed for ``error_vs_exact``; for ``method="exact"``
    it is built here when not given). NYTRO holds out a seeded 20 % of the training points for its validation
    path and stops at the best step ([NYTRO] §4); its predictor has no variance.
    """
    validate_choice(method, "method", EVAL_METHODS)
    if method not in ("exact", "rff"):
        landmarks = landmarks or "fps"
    rec: dict[str, Any] = {"method": method, "landmarks": None if method in ("exact", "rff") else landmarks}
    t0 = time.perf_counter()
    if method == "exact":
        exact = exact or ExactPosterior(kernel, X, y, noise, prior_mean=prior_mean, seed=seed)
        fit_s, post, mm = time.perf_counter() - t0, exact, X.shape[0]
    elif method == "nytro":
        mm = choose_m(X, kernel, noise, seed=seed) if m == "auto" else int(m)
        perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed)).to(X.device)
        n_val = max(1, X.shape[0] // 5)
        val, tr = perm[:n_val], perm[n_val:]
        C, _ = select_landmarks(X[tr], min(mm, tr.numel()), landmarks, kernel=kernel, noise=noise, seed=seed)
        path = nytro(kernel, X[tr], y[tr] - prior_mean, C, t_max=nytro_t_max, X_val=X[val],
                     y_val=y[val] - prior_mean, stop="best")
        fit_s, mm = time.perf_counter() - t0, C.shape[0]  # landmarks come from the 80 % training part
        rec.update(t_stop=path.t_stop, gamma=path.gamma)
    else:
        with torch.no_grad():
            post = reduced_posterior(method, kernel, X, y, noise, m=m, seed=seed, prior_mean=prior_mean,
                                     landmarks=None if method == "rff" else landmarks, **options)
        fit_s = time.perf_counter() - t0
        mm = post.num_features // 2 if method == "rff" else post.m
    t1 = time.perf_counter()
    with torch.no_grad():
        if method == "nytro":
            mean, var = prior_mean + nytro_predict(kernel, C, path.alpha_stop, Xt), None
        else:
            mean, var = post.mean(Xt), post.variance(Xt)
    rec.update(m=mm, fit_s=fit_s, predict_s=time.perf_counter() - t1, **_metrics(yt, mean, var, noise, transform))
    rec["error_vs_exact"] = rec["mean_rmse_vs_exact"] = None
    if exact is not None:
        with torch.no_grad():
            ours, theirs = mean, exact.mean(Xt)
            if transform is not None:  # in the units of test_rmse
                ours, theirs = transform.inverse_y(ours), transform.inverse_y(theirs)
            rec["mean_rmse_vs_exact"] = float((ours - theirs).square().mean().sqrt())
            if method == "nytro":
                rec["error_vs_exact"] = landmark_rkhs_error(kernel, C, path.alpha_stop, exact)
            elif method == "exact":
                rec["error_vs_exact"] = 0.0
            elif method != "rff":
                rec["error_vs_exact"] = rkhs_error(post, exact)
    return rec
