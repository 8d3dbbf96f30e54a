"""NYTRO — Nyström subsampling plus early stopping (Angles et al. 2015) — and Nyström kernel ridge regression.

Both fit ``f(z) = k(z, C) alpha`` over ``m`` landmarks ``C`` ([NYTRO] eq. (17)) through ``R (m, k)`` with
``R R^T = K_mm^+`` and ``A = K_nm R (n, k)`` ([NYTRO] §2.3, eq. (16), and its appendix Prop. 1):

* **NYTRO** ([NYTRO] §3.1, eq. (18)-(19); eq. (18) as printed applies ``K_nm`` to ``beta (k,)``, a size error,
  corrected to ``A = K_nm R``): gradient descent on
  the unpenalised ``(1/2n) ||A beta - y||^2`` from ``beta_0 = 0``,

      beta_t = beta_{t-1} - (gamma / n) A^T (A beta_{t-1} - y),     alpha_t = R beta_t,

  with ``gamma = 1 / max_i k(x_i, x_i)`` (so ``(gamma / n) ||A^T A|| <= 1``). The iteration count ``t`` is the
  regulariser: the fitted values are ``[I - (I - (gamma/n) A A^T)^t] y`` and step ``t`` pairs with the Tikhonov
  parameter ``lambda = 1 / (gamma t)`` (:meth:`NytroPath.lam`). ``K_nm`` and ``R`` are applied as products,
  ``O(nm + mk)`` per step; nothing ``n x n`` is formed.
* **Nyström KRR / NKRLS** ([NYTRO] eq. (16)): ``alpha = R (A^T A + lambda n I)^{-1} A^T y``, which equals
  ``(K_mn K_nm + lambda n K_mm)^+ K_mn y``; a whole ``lambda`` grid costs one eigendecomposition of ``A^T A``.

``R`` comes from a thresholded eigendecomposition of ``K_mm`` (``R = V_k diag(e_k^{-1/2})`` keeping
``e > rtol * e_max``), not the paper's QR + Cholesky (§2.3), which needs ``K_mm`` of full numerical rank. Any
``R`` with ``R R^T = K_mm^+`` gives the same ``alpha`` path.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import gpytorch
import torch

from gpnys.checks import NumericalWarning, validate_choice, validate_count, validate_positive
from gpnys.kernels.blocks import kernel_block, kernel_diag
from gpnys.reduced.lla import NystromFeatureMap, _finite_2d, validate_regression

__all__ = ["STOP_RULES", "NytroPath", "landmark_factor", "nystrom_krr", "nytro", "predict"]

STOP_RULES = ("threshold", "best", "none")



def _validate_data(X: torch.Tensor, y: torch.Tensor, landmarks: torch.Tensor) -> None:
    """X ``(n, d)``, y ``(n,)`` finite; landmarks ``(m, d)`` finite with ``1 <= m <= n`` (``ValueError`` otherwise)."""
    validate_regression(X, y, 1.0, landmarks)  # no noise in NYTRO/NKRLS: a placeholder that always passes


def landmark_factor(kernel: gpytorch.kernels.Kernel, landmarks: torch.Tensor,
                    rtol: float | None = None) -> NystromFeatureMap:
    """``R (m, k)`` with ``R R^T = K_mm^+`` as the ``.A`` of a Nyström feature map on ``landmarks``.

    ``K_mm = V diag(e) V^T`` is decomposed in at least float64; eigenvalues ``e <= rtol * e_max`` are dropped with
    a :class:`NumericalWarning` giving their number, and ``R = V_k diag(e_k^{-1/2})``. The default ``rtol`` is
    ``m * eps`` of the landmarks' dtype — the precision ``K_mm`` was evaluated in — so float32 rounding noise is
    never inverted. Returns the map: ``.A`` = R (landmarks' dtype), ``.s`` = k, ``.dropped`` = ``m - k``,
    ``.cross(Z)`` = ``k(Z, C)``.
    """
    m = landmarks.shape[0]
    rtol = m * torch.finfo(landmarks.dtype).eps if rtol is None else validate_positive(rtol, "rtol")
    return NystromFeatureMap(kernel, landmarks, rtol=rtol)


@dataclass
class NytroPath:
    """A NYTRO regularisation path of ``T`` steps (``T = t_stop`` for ``stop="threshold"``, else ``t_max``).

    Attributes:
        alpha: ``(T, m)``, row ``t - 1`` = ``alpha_t`` (landmark coefficients after ``t`` steps).
        t_stop: selected step count (1-based); alpha_stop: ``(m,)`` = ``alpha[t_stop - 1]``.
        gamma: ``gamma`` of the step ``gamma / n``; n: training points; rank: ``k`` = kept ``K_mm`` directions.
        val_rmse: ``(T,)`` validation RMSE per step, or ``None``; val_rmse0: RMSE of ``alpha_0 = 0`` (or ``None``).
        predictions: ``(T, nz)`` predictions ``k(Z, C) alpha_t`` at ``Z``, or ``None``.
        stop: the stopping rule used.
    """

    alpha: torch.Tensor
    t_stop: int
    alpha_stop: torch.Tensor
    gamma: float
    n: int
    rank: int
    stop: str
    val_rmse: torch.Tensor | None = None
    val_rmse0: float | None = None
    predictions: torch.Tensor | None = None

    @property
    def step(self) -> float:
        """The gradient step ``gamma / n``."""
        return self.gamma / self.n

    def lam(self, t: int | torch.Tensor) -> float | torch.Tensor:
        """Tikhonov parameter ``lambda = 1 / (gamma t)`` matched to step ``t`` ([NYTRO] Thm 5: NYTRO after ``t``
        steps is within ``c_t <= 16`` of NKRLS at this ``lambda`` in expected excess risk)."""
        return 1.0 / (self.gamma * t)


def _validation_set(X_val: torch.Tensor | None, y_val: torch.Tensor | None, d: int) -> bool:
    """Check ``X_val (n_val, d)`` / ``y_val (n_val,)`` (both or neither); return whether they are given."""
    if (X_val is None) != (y_val is None):
        raise ValueError("X_val and y_val must be given together")
    if X_val is None:
        return False
    _finite_2d(X_val, "X_val")
    if X_val.shape[1] != d:
        raise ValueError(f"X_val must have d={d} columns like X, got {X_val.shape[1]}")
    if not isinstance(y_val, torch.Tensor) or y_val.shape != (X_val.shape[0],):
        raise ValueError(f"y_val must have shape ({X_val.shape[0]},) to match X_val, got "
                         f"{getattr(y_val, 'shape', type(y_val))}")
    if not bool(torch.isfinite(y_val).all()):
        raise ValueError("y_val contains NaN or inf")
    return True


def nytro(kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, landmarks: torch.Tensor,
          t_max: int = 500, gamma: float | None = None, X_val: torch.Tensor | None = None,
          y_val: torch.Tensor | None = None, Z: torch.Tensor | None = None, stop: str = "threshold",
          tau: float = 0.05, rtol: float | None = None) -> NytroPath:
    """NYTRO ([NYTRO] §3.1, eq. (17)-(19), eq. (18) corrected; the validation protocol of §4): the early-stopping
    path on landmarks.

    Args:
        kernel: GPyTorch kernel (outputscale included).
        X: ``(n, d)``; y: ``(n,)`` targets (centre them: the model has no bias); landmarks: ``(m, d)``, ``m <= n``;
            y and landmarks in X's dtype.
        t_max: maximum number of steps.
        gamma: the step is ``gamma / n``; default ``1 / max_i k(x_i, x_i)`` (``1 / outputscale`` for a
            ``ScaleKernel`` over a stationary kernel), which guarantees convergence.
        X_val: ``(n_val, d)`` validation inputs; required by ``stop`` ``"threshold"``/``"best"``.
        y_val: ``(n_val,)`` validation targets; required with ``X_val``.
        Z: ``(nz, d)`` points at which to predict after every step.
        stop: ``"threshold"`` — first ``t`` whose relative validation-RMSE decrease
            ``(e_{t-1} - e_t) / e_{t-1}`` is below ``tau``, with ``e_0`` the RMSE of ``alpha_0 = 0`` (one reading of
            §4's "validation error ceases to be decreasing up to a given threshold"); the path ends there.
            ``"best"`` — run ``t_max`` steps, pick ``argmin_t e_t``.
            ``"none"`` — run ``t_max`` steps, pick the last.
        tau: threshold of ``"threshold"`` (paper: 5%).
        rtol: eigenvalue cut-off of :func:`landmark_factor`.

    Returns:
        :class:`NytroPath` with ``alpha (T, m)``, validation RMSEs ``(T,)`` and predictions ``(T, nz)``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import nytro
        >>> from gpnys.reduced.nytro import landmark_factor
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> y = y - y.mean()  # the model has no bias
        >>> path = nytro(kernel, X, y, C, t_max=100, stop="none")
        >>> path.alpha.shape, path.t_stop
        (torch.Size([100, 30]), 100)

        After ``t`` steps the fitted values are the spectral filter ``[I - (I - (gamma/n) A A^T)^t] y``:

        >>> A = k(X, C) @ landmark_factor(kernel, C).A
        >>> S = torch.eye(200, dtype=torch.float64) - path.gamma / 200 * A @ A.mT
        >>> fit = y - torch.linalg.matrix_power(S, 100) @ y
        >>> torch.allclose(k(X, C) @ path.alpha_stop, fit)
        True

        With a validation set, ``stop="best"`` picks the step of least validation RMSE:

        >>> path = nytro(kernel, X[50:], y[50:], C, t_max=100, X_val=X[:50], y_val=y[:50], stop="best")
        >>> path.t_stop == int(path.val_rmse.argmin()) + 1
        True
    """
    _validate_data(X, y, landmarks)
    t_max = validate_count(t_max, "t_max")
    validate_choice(stop, "stop", STOP_RULES)
    tau = validate_positive(tau, "tau")
    has_val = _validation_set(X_val, y_val, X.shape[1])
    if stop != "none" and not has_val:
        raise ValueError(f"stop={stop!r} needs a validation set: pass X_val and y_val (or use stop='none')")
    if Z is not None:
        _finite_2d(Z, "Z")
        if Z.shape[1] != X.shape[1]:
            raise ValueError(f"Z must have d={X.shape[1]} columns like X, got {Z.shape[1]}")
    n = X.shape[0]
    if gamma is None:
        gamma = 1.0 / float(kernel_diag(kernel, X).max())
    gamma = validate_positive(gamma, "gamma")
    landmarks = landmarks.to(X)
    fmap = landmark_factor(kernel, landmarks, rtol)
    R = fmap.A.to(X)
    Knm = fmap.cross(X).to(X)
    eta = gamma / n
    val = val0 = None
    if has_val:
        Kvm = fmap.cross(X_val.to(X)).to(X)
        y_val = y_val.to(X)
        val = X.new_empty(t_max)
        val0 = prev = float(y_val.square().mean().sqrt())  # e_0: the RMSE of alpha_0 = 0
    alphas = X.new_empty(t_max, fmap.A.shape[0])
    alpha, beta = X.new_zeros(R.shape[0]), X.new_zeros(R.shape[1])
    T = t_max
    for t in range(1, t_max + 1):
        beta = beta - eta * (R.mT @ (Knm.mT @ (Knm @ alpha - y)))  # (gamma/n) A^T (A beta - y), as products
        alpha = R @ beta
        alphas[t - 1] = alpha
        if has_val:
            val[t - 1] = (Kvm @ alpha - y_val).square().mean().sqrt()
            if stop == "threshold":
                err = float(val[t - 1])
                if not prev - err >= tau * prev:  # relative decrease below tau (or a NaN: stop)
                    T = t
                    break
                prev = err
    alphas = alphas[:T]
    if not bool(torch.isfinite(alphas[-1]).all()):
        warnings.warn(f"NYTRO diverged: the step gamma/n = {eta:.3g} is too large (need (gamma/n) ||A^T A|| < 2; "
                      "the default gamma = 1 / max k(x, x) always converges)", NumericalWarning, stacklevel=2)
    val_rmse = None if val is None else val[:T]
    t_stop = int(torch.argmin(val_rmse)) + 1 if stop == "best" else T
    return NytroPath(
        alpha=alphas, t_stop=t_stop, alpha_stop=alphas[t_stop - 1], gamma=gamma, n=n, rank=fmap.s, stop=stop,
        val_rmse=val_rmse, val_rmse0=val0,
        predictions=None if Z is None else predict(kernel, landmarks, alphas, Z.to(X)),
    )


def _lam_values(lam: float | torch.Tensor | Sequence[float]) -> tuple[list[float], bool]:
    """``lam`` as a list of positive floats and whether it was a scalar (``ValueError`` naming ``lam``)."""
    scalar = not isinstance(lam, (torch.Tensor, Sequence)) or (isinstance(lam, torch.Tensor) and lam.dim() == 0)
    if isinstance(lam, torch.Tensor) and lam.dim() > 1:
        raise ValueError(f"lam must be a number or a 1-D tensor, got shape {tuple(lam.shape)}")
    values = [lam] if scalar else (lam.tolist() if isinstance(lam, torch.Tensor) else list(lam))
    if not values:
        raise ValueError("lam is empty")
    return [validate_positive(v, "lam") for v in values], scalar


def nystrom_krr(kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, landmarks: torch.Tensor,
                lam: float | torch.Tensor | Sequence[float], rtol: float | None = None) -> torch.Tensor:
    """Nyström KRR / NKRLS ([NYTRO] eq. (16)): ``alpha = R (A^T A + lambda n I)^{-1} A^T y``.

    Equals ``(K_mn K_nm + lambda n K_mm)^+ K_mn y`` (the SoR/DTC mean with noise variance ``n lambda``). All
    ``lambda`` share one eigendecomposition ``A^T A = W diag(s) W^T`` (in at least float64):
    ``alpha = R W diag(1 / (s + lambda n)) W^T A^T y``. Cost ``O(n m^2 + m^3 + |lambda| m^2)``.

    Args:
        kernel: GPyTorch kernel; X: ``(n, d)``; y: ``(n,)``; landmarks: ``(m, d)`` with ``m <= n``; y and
            landmarks in X's dtype.
        lam: ``lambda > 0``, a number or a 1-D tensor/sequence of them.
        rtol: eigenvalue cut-off of :func:`landmark_factor`.

    Returns:
        ``(m,)`` for a number, ``(len(lam), m)`` for a 1-D ``lam``; in X's dtype.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import nystrom_krr
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> alpha = nystrom_krr(kernel, X, y, C, lam=1e-3)
        >>> ref = torch.linalg.solve(k(C, X) @ k(X, C) + 1e-3 * 200 * k(C, C), k(C, X) @ y)
        >>> torch.allclose(alpha, ref, atol=1e-6)
        True
        >>> nystrom_krr(kernel, X, y, C, lam=[1e-3, 1e-2, 1e-1]).shape  # a grid: one eigendecomposition
        torch.Size([3, 30])
    """
    _validate_data(X, y, landmarks)
    values, scalar = _lam_values(lam)
    landmarks = landmarks.to(X)
    fmap = landmark_factor(kernel, landmarks, rtol)
    work = torch.promote_types(X.dtype, torch.float64)
    R = fmap.A.to(work)
    A = fmap.cross(X).to(work) @ R
    s, W = torch.linalg.eigh(A.mT @ A)
    c = W.mT @ (A.mT @ y.to(work))
    shifts = torch.tensor(values, dtype=work, device=X.device) * X.shape[0]
    coef = c / (s.clamp_min(0.0) + shifts[:, None])  # (L, k)
    alpha = (coef @ W.mT @ R.mT).to(X.dtype)  # (L, m)
    return alpha[0] if scalar else alpha


def predict(kernel: gpytorch.kernels.Kernel, landmarks: torch.Tensor, alpha: torch.Tensor,
            Z: torch.Tensor) -> torch.Tensor:
    """``f(Z) = k(Z, C) alpha`` ([NYTRO] eq. (17)): ``(nz,)`` for ``alpha (m,)``, ``(T, nz)`` for a path ``(T, m)``.

    Computed in Z's dtype and device.
    """
    _finite_2d(landmarks, "landmarks")
    _finite_2d(Z, "Z")
    if Z.shape[1] != landmarks.shape[1]:
        raise ValueError(f"Z must have d={landmarks.shape[1]} columns like landmarks, got {Z.shape[1]}")
    m = landmarks.shape[0]
    if not isinstance(alpha, torch.Tensor) or alpha.dim() not in (1, 2) or alpha.shape[-1] != m:
        raise ValueError(f"alpha must have shape ({m},) or (T, {m}), got {getattr(alpha, 'shape', type(alpha))}")
    Kzm = kernel_block(kernel, Z, landmarks.to(Z)).to(Z)
    return alpha.to(Z) @ Kzm.mT
