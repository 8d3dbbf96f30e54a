"""LLA: the low-rank linearization approach (Lan et al. 2019; [SPA] §II-E eq. (4), (12); [NSL] Algorithm 2).

Map every point to ``phi(z) = Sigma^{-1} V^T k(C, z)`` (``K_mm = V Sigma^2 V^T``, the compact eigendecomposition
of the landmark kernel, [SPA] Algorithm 1 step 3: ``A = V Sigma^{-1}``, ``A^T K_mm A = I``) and run Bayesian
linear regression on the features (:class:`~gpnys.reduced.features.FeatureGP`). For GP regression
(``lambda_0 = sigma^2``: [SPA]'s KRR with the GP noise variance as the ridge; the papers themselves give no GP
formulas) the posterior mean ``phi_z^T w_hat`` is the subset-of-regressors / DTC / SGPR mean; the variance is DTC
(``v_SoR + k_zz - |phi_z|^2``, default) or SoR.

Rank-deficient ``K_mm`` (duplicated or near-duplicated landmarks, long length-scales) is the normal case, not an
edge case: eigenvalues at or below ``rtol * lambda_max`` are cut off with a :class:`NumericalWarning` (the
papers' compact eigendecomposition keeps the positive ones), never replaced by a silent jitter, which would
make ``A^T K_mm A != I`` and break the identities of [SPA] Lemma 1, eq. (15) and NCR = LLA. ``rank`` keeps only
the top eigenpairs (NSL truncation, [NSL] §3.2, Algorithm 1).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator

import gpytorch
import torch

from gpnys.budget import block_rows
from gpnys.checks import NumericalWarning, validate_choice, validate_count
from gpnys.kernels.blocks import kernel_block, kernel_diag
from gpnys.reduced.features import FeatureGP, Solver

__all__ = ["NystromFeatureMap", "LLAPosterior", "validate_regression", "validate_test_points"]

VARIANCES = ("dtc", "sor")


def kernel_in(kernel: gpytorch.kernels.Kernel, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    """``kernel`` with its floating parameters and buffers in at least ``dtype``: itself when they are, else a copy
    promoted to ``dtype`` (exact). GPyTorch evaluates a float32 kernel on float64 points partly in float32 (errors
    of 1e-9)."""
    tensors = [*kernel.parameters(), *kernel.buffers()]
    if all(torch.promote_types(t.dtype, dtype) == t.dtype for t in tensors if t.is_floating_point()):
        return kernel
    return copy.deepcopy(kernel).to(dtype)


def _finite_2d(T: torch.Tensor, name: str) -> None:
    if not isinstance(T, torch.Tensor) or T.dim() != 2 or T.shape[0] == 0 or T.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor, got {getattr(T, 'shape', type(T))}")
    if not bool(torch.isfinite(T).all()):
        raise ValueError(f"{name} contains NaN or inf")


def _same_dtype(T: torch.Tensor, X: torch.Tensor, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``T`` has ``X``'s dtype (mixed dtypes met in a matrix product as a
    ``RuntimeError``)."""
    if T.dtype != X.dtype:
        have, want = (str(t).removeprefix("torch.") for t in (T.dtype, X.dtype))
        raise ValueError(f"{name} must have X's dtype {want}, got {have} (cast it with .to(X.dtype))")


def validate_test_points(Z: torch.Tensor, d: int) -> None:
    """``ValueError`` naming ``Z`` unless it is a finite, non-empty ``(nz, d)`` tensor."""
    _finite_2d(Z, "Z")
    if Z.shape[1] != d:
        raise ValueError(f"Z must have d={d} columns like X, got {Z.shape[1]}")


def validate_regression(X: torch.Tensor, y: torch.Tensor, noise: float, landmarks: torch.Tensor | None = None,
                        prior_mean: float = 0.0, rtol: float | None = None) -> None:
    """``ValueError`` naming the argument: X ``(n, d)``, y ``(n,)`` finite, noise > 0, landmarks ``(m, d)``,
    ``1 <= m <= n``, a finite ``prior_mean``, ``rtol`` in ``(0, 1)`` or ``None``; y and landmarks in X's dtype
    (:func:`~gpnys.reduced.models.reduced_posterior` promotes mixed dtypes first, as GPyTorch does)."""
    if not math.isfinite(float(prior_mean)):
        raise ValueError(f"prior_mean must be finite, got {prior_mean!r}")
    if rtol is not None and not 0 < float(rtol) < 1:
        raise ValueError(f"rtol must be in (0, 1) (a cut-off relative to the largest eigenvalue), got {rtol!r}")
    _finite_2d(X, "X")
    if not isinstance(y, torch.Tensor) or y.shape != (X.shape[0],):
        raise ValueError(f"y must have shape ({X.shape[0]},) to match X, got {getattr(y, 'shape', type(y))}")
    _same_dtype(y, X, "y")
    if not bool(torch.isfinite(y).all()):
        raise ValueError("y contains NaN or inf")
    if not (float(noise) > 0 and float(noise) < float("inf")):
        raise ValueError(f"noise must be positive and finite, got {noise}")
    if landmarks is not None:
        _finite_2d(landmarks, "landmarks")
        _same_dtype(landmarks, X, "landmarks")
        if landmarks.shape[1] != X.shape[1]:
            raise ValueError(f"landmarks must have d={X.shape[1]} columns like X, got {landmarks.shape[1]}")
        if landmarks.shape[0] > X.shape[0]:
            raise ValueError(f"m={landmarks.shape[0]} landmarks exceed the n={X.shape[0]} training points")


class NystromFeatureMap:
    """``phi(z) = A^T k(C, z)`` with ``A = V_s Sigma_s^{-1}`` ([SPA] Alg. 1 step 3; [NSL] eq. (1), Alg. 1).

    Args:
        kernel: the GPyTorch kernel (outputscale included).
        landmarks: ``(m, d)`` points C.
        rank: keep the top ``rank`` eigenpairs only (NSL truncation); default all above the cut-off.
        rtol: eigenvalue cut-off relative to the largest; default ``m * eps`` of the working precision
            (``torch.linalg.pinv``'s rule). ``K_mm`` and its eigendecomposition are computed in at least float64.

    Where directions below the landmarks' dtype's own cut-off (``m * eps`` of float32, say) are kept, ``A``'s
    columns (``1 / sqrt(lambda)``) amplify the rounding of a float32 ``k(Z, C)`` beyond the features' size: the
    features are then computed in at least float64 (from a float64 copy of the kernel, in row blocks) and returned
    in the landmarks' dtype.

    Attributes:
        A: ``(m, s)``; s: kept directions; dropped: directions cut off as numerically zero.
        eigenvalues, eigenvectors: ``(m,)`` and ``(m, m)``, the eigendecomposition of ``K_mm`` in descending order (at
        least float64).

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import NystromFeatureMap
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> phi = NystromFeatureMap(kernel, C)
        >>> phi(X).shape, phi.dropped
        (torch.Size([200, 30]), 0)

        ``phi(x)^T phi(c) = k(x, c)`` for every landmark ``c``: the Nyström kernel is exact on the landmarks.

        >>> torch.allclose(phi(X) @ phi(C).mT, k(X, C))
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, landmarks: torch.Tensor, rank: int | None = None,
                 rtol: float | None = None) -> None:
        self.kernel, self.landmarks = kernel, landmarks
        m = landmarks.shape[0]
        if rank is not None:
            rank = validate_count(rank, "rank", 1, m, "m")
        work = torch.promote_types(landmarks.dtype, torch.float64)
        precise_kernel, C = kernel_in(kernel, work), landmarks.to(work)
        evals, V = torch.linalg.eigh(kernel_block(precise_kernel, C, C))
        evals, V = evals.flip(-1), V.flip(-1)  # descending
        rtol = m * torch.finfo(work).eps if rtol is None else float(rtol)
        keep = evals > rtol * evals[0].clamp_min(torch.finfo(work).tiny)
        self.dropped = int(m - keep.sum())
        if self.dropped:
            warnings.warn(f"Nyström: K_mm is numerically rank-deficient: {self.dropped} of {m} eigen-directions "
                          f"at or below {rtol:.2g} x lambda_max were cut off (pseudo-inverse, no jitter)",
                          NumericalWarning, stacklevel=3)
        s = int(keep.sum()) if rank is None else min(int(rank), int(keep.sum()))
        self.s = s
        self.eigenvalues, self.eigenvectors = evals, V
        A = V[:, :s] / evals[:s].sqrt()
        self.A = A.to(landmarks.dtype)
        # directions the landmarks' dtype cannot resolve are kept: the features in at least float64 (class docstring)
        self._resolved = (work == landmarks.dtype or s == 0
                          or bool(evals[s - 1] > m * torch.finfo(landmarks.dtype).eps * evals[0]))
        self._work = (precise_kernel, C, A)

    def cross(self, Z: torch.Tensor) -> torch.Tensor:
        """``k(Z, C)``: ``(nz, m)``."""
        return kernel_block(self.kernel, Z, self.landmarks)

    def __call__(self, Z: torch.Tensor) -> torch.Tensor:
        """Features ``(nz, s)`` of the rows of ``Z``."""
        if self._resolved:
            return self.cross(Z) @ self.A
        out = torch.empty(Z.shape[0], self.s, dtype=torch.promote_types(Z.dtype, self.A.dtype), device=Z.device)
        for rows, block in self._precise_blocks(Z):
            out[rows] = block
        return out

    def transpose_matmul(self, Z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``phi(Z)^T v`` (``(s,)``) for ``v (nz,)``, in at least float64 throughout (the RKHS distances of
        :mod:`gpnys.reduced.error`, where it meets large coefficients)."""
        A = self._work[2]
        v = v.to(A.dtype)
        out = A.new_zeros(self.s)
        for rows, block in self._precise_blocks(Z):
            out += block.mT @ v[rows]
        return out

    def _precise_blocks(self, Z: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows, phi(Z[rows]))`` in at least float64, over row blocks of ``Z``."""
        kernel, C, A = self._work
        step = block_rows(C.shape[0], device=Z.device)
        for i in range(0, Z.shape[0], step):
            rows = slice(i, i + step)
            yield rows, kernel_block(kernel, Z[rows].to(A.dtype), C) @ A


class LLAPosterior:
    """LLA (= NCR = SPA, [SPA] Prop 2) GP posterior with landmarks C: SoR/DTC mean, DTC or SoR variance.

    Args:
        kernel: GPyTorch kernel (outputscale included) at the chosen hyperparameters.
        X: ``(n, d)``; y: ``(n,)``; noise: ``sigma^2 > 0``; landmarks: ``(m, d)`` with ``1 <= m <= n``; y and
            landmarks in X's dtype.
        prior_mean: constant prior mean (subtracted from y, added to predictions).
        variance: ``"dtc"`` (default) or ``"sor"``.
        rank: see :class:`NystromFeatureMap`.
        rtol: see :class:`NystromFeatureMap`.
        solver: optional ``solver(M, B)`` for the ``s x s`` system (default Cholesky).

    Attributes:
        features: the :class:`NystromFeatureMap`.
        Phi: ``(n, s)`` training features (``G^T`` in the papers).
        gp: the :class:`~gpnys.reduced.features.FeatureGP`.
        w: ``(s,)`` ridge solution ``w_hat = (G G^T + sigma^2 I)^{-1} G y`` ([SPA] eq. (12)).

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import LLAPosterior, NCRPosterior
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> lla = LLAPosterior(kernel, X, y, 0.01, C)

        The GP with the Nyström kernel ``Phi Phi^T``, and the NCR predictor computed independently ([SPA] Prop 2):

        >>> Kt = lla.Phi @ lla.Phi.mT + 0.01 * torch.eye(200, dtype=torch.float64)
        >>> torch.allclose(lla.mean(Z), lla.features(Z) @ lla.Phi.mT @ torch.linalg.solve(Kt, y))
        True
        >>> torch.allclose(lla.mean(Z), NCRPosterior(kernel, X, y, 0.01, C).mean(Z))
        True

        The DTC variance adds the projection residual ``k_zz - |phi_z|^2 >= 0`` to the SoR one:

        >>> sor = LLAPosterior(kernel, X, y, 0.01, C, variance="sor")
        >>> bool((lla.variance(Z) >= sor.variance(Z)).all())
        True
    """

    method = "lla"

    def __init__(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                 landmarks: torch.Tensor, prior_mean: float = 0.0, variance: str = "dtc", rank: int | None = None,
                 rtol: float | None = None, solver: Solver | None = None) -> None:
        validate_regression(X, y, noise, landmarks, prior_mean, rtol)
        validate_choice(variance, "variance", VARIANCES)
        self.kernel, self.X, self.noise = kernel, X, float(noise)
        self.prior_mean, self.variance_kind = float(prior_mean), variance
        self.features = NystromFeatureMap(kernel, landmarks, rank=rank, rtol=rtol)
        self.Phi = self.features(X)
        self.residual = y - self.prior_mean
        self.gp = FeatureGP(self.Phi, self.residual, self.noise, solver)
        self.w = self.gp.w

    @property
    def m(self) -> int:
        return self.features.landmarks.shape[0]

    def mean(self, Z: torch.Tensor) -> torch.Tensor:
        """Predictive mean ``(nz,)`` at ``Z (nz, d)``."""
        validate_test_points(Z, self.X.shape[1])
        return self.prior_mean + self.gp.mean(self.features(Z))

    def variance(self, Z: torch.Tensor) -> torch.Tensor:
        """Latent (noise-free) predictive variance ``(nz,)``: DTC ``v_SoR + k_zz - |phi_z|^2`` or SoR."""
        validate_test_points(Z, self.X.shape[1])
        Phi_z = self.features(Z)
        v = self.gp.sor_variance(Phi_z)
        if self.variance_kind == "dtc":  # + the projection residual, >= 0 up to rounding
            v = v + (kernel_diag(self.kernel, Z) - Phi_z.square().sum(1)).clamp_min(0.0)
        return v
