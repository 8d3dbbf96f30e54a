"""The PCG posterior: the solves a GP prediction needs, with one preconditioned training system ``K̂ = K + σ² I``.

Used by :meth:`gpnys.gp.hook.PreconditionerHook.predict` and by
:class:`gpnys.bo.PreconditionedSingleTaskGP`'s posterior, so that both solve, cache and bound alike:

* **mean weights** ``α = K̂⁻¹ (y − m(X))`` (``(n,)``): one PCG solve, cached under a caller's key (data and
  hyperparameters) and started from a caller's guess (a previous solution) where there is one, else ``P̂⁻¹ r``
  (:meth:`PCGPosterior.mean_weights`); the predictive mean is ``m(x) + k_xᵀ α``;
* **kernel-column solves** ``B ≈ K̂⁻¹ R`` for ``R = K(X, X*)`` (``(n, t)``), warm-started from the latest block of
  the same shape, ``x0 = B_prev + P̂⁻¹ (R − R_prev)`` (an acquisition optimiser moves ``X*`` a little per step; a
  fantasy-based one alternates between :data:`WARM_BLOCKS` shapes at most), else ``P̂⁻¹ R``
  (:meth:`PCGPosterior.solve`);
* **quadratic forms** ``diag(Rᵀ K̂⁻¹ R)`` in the variational form ``2 rᵀb − bᵀK̂b = rᵀK̂⁻¹r − ‖e‖²_K̂`` (second order
  in the solve's error ``e``), with the bound ``‖ρ‖² / min σ²`` on what it misses (``ρ`` the true residual;
  :meth:`PCGPosterior.quad`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpnys.budget import dense_limit_bytes
from gpnys.solvers.pcg import PCGResult, pcg

__all__ = ["PCGPosterior", "WARM_BLOCKS", "WARM_SHARE"]

#: how many latest solution blocks, one per shape, :meth:`PCGPosterior.solve` keeps as warm starts: one qKG
#: evaluation solves at ``X_q`` (``fantasize``) and then at ``[X_t, X_q]`` per fantasy (its fantasy model). Older
#: blocks are also dropped while all kept ``(R, B)`` pairs pass :data:`WARM_SHARE` of the dense memory budget.
WARM_BLOCKS = 4
WARM_SHARE = 0.25

Operator = Callable[[torch.Tensor], torch.Tensor]


class PCGPosterior:
    """Posterior solves with the system ``A = K̂`` and the preconditioner solve ``M = P̂⁻¹`` (module docstring).

    Args:
        A: ``R (n, t) -> K̂ R``.
        M: ``R (n, t) -> P̂⁻¹ R``.
        maxiter: PCG iteration cap of every solve.

    Attributes:
        iterations: PCG iterations of the latest :meth:`solve` / :meth:`quad`; mean_iterations: of the latest
            solve for ``α``.

    Example:
        ``α`` and a quadratic form against dense solves:

        >>> import torch
        >>> from gpnys.gp.posterior import PCGPosterior
        >>> g = torch.Generator().manual_seed(0)
        >>> X = torch.rand(80, 2, dtype=torch.float64, generator=g)
        >>> K = torch.exp(-torch.cdist(X, X) ** 2) + 0.1 * torch.eye(80, dtype=torch.float64)
        >>> post = PCGPosterior(lambda R: K @ R, lambda R: R / 1.1, maxiter=200)
        >>> r = torch.randn(80, dtype=torch.float64, generator=g)
        >>> alpha = post.mean_weights(r, key="data", tol=1e-10).x[:, 0]
        >>> bool(torch.allclose(alpha, torch.linalg.solve(K, r)))
        True
        >>> R = torch.randn(80, 3, dtype=torch.float64, generator=g)
        >>> q, bound = post.quad(R, tol=1e-4, floor=0.1)  # q falls short of the exact form by at most bound
        >>> exact = (R * torch.linalg.solve(K, R)).sum(0)
        >>> bool(((exact - q) <= bound + 1e-12 * exact).all()), bool((q <= exact + 1e-12 * exact).all())
        (True, True)
    """

    def __init__(self, A: Operator, M: Operator, maxiter: int) -> None:
        self.A, self.M, self.maxiter = A, M, maxiter
        self._mean: tuple[Any, PCGResult] | None = None
        self._warm: dict[torch.Size, tuple[torch.Tensor, torch.Tensor]] = {}  # shape -> (R, B), latest last
        self.iterations = 0
        self.mean_iterations = 0

    def update(self, A: Operator, M: Operator) -> "PCGPosterior":
        """Solve with new operators (the preconditioner is rebuilt when the hyperparameters change); the cached
        ``α`` stays under its key and the previous block stays a warm start. Returns ``self``."""
        self.A, self.M = A, M
        return self

    @property
    def alpha(self) -> torch.Tensor | None:
        """The latest cached ``α`` (``(n,)``), or ``None``."""
        return None if self._mean is None else self._mean[1].x[:, 0]

    def mean_weights(self, r: torch.Tensor, key: Any, tol: float, start: torch.Tensor | None = None,
                     **pcg_options) -> PCGResult:
        """The PCG result of ``K̂ α = r`` (``r (n,)``; ``.x`` is ``(n, 1)``), cached under ``key`` (compared with ``==``:
        tensors in it as :class:`gpnys.keys.TensorKey`); ``start`` ``(n,)`` replaces the start ``P̂⁻¹ r``;
        ``pcg_options`` go to :func:`~gpnys.solvers.pcg.pcg` (e.g. ``lanczos=True``)."""
        if self._mean is None or self._mean[0] != key:
            rhs = r[:, None]
            x0 = start[:, None].to(rhs) if start is not None and start.shape == r.shape else self.M(rhs)
            res = pcg(self.A, rhs, precond=self.M, x0=x0, tol=tol, maxiter=self.maxiter, **pcg_options)
            self._mean = (key, res)
            self.mean_iterations = res.iterations
        return self._mean[1]

    def solve(self, R: torch.Tensor, tol: float | torch.Tensor, warm: bool = True) -> PCGResult:
        """``B ≈ K̂⁻¹ R`` (``R (n, t)``), from the latest solution of a block of that shape when ``warm``."""
        prev = self._warm.pop(R.shape, None) if warm else None
        x0 = self.M(R) if prev is None else prev[1] + self.M(R - prev[0])
        res = pcg(self.A, R, precond=self.M, x0=x0, tol=tol, maxiter=self.maxiter)
        self.iterations = res.iterations
        if warm:
            self._warm[R.shape] = (R, res.x)
            limit = WARM_SHARE * dense_limit_bytes(R.device)
            while len(self._warm) > 1 and (len(self._warm) > WARM_BLOCKS or sum(
                    2 * r.numel() * r.element_size() for r, _ in self._warm.values()) > limit):
                self._warm.pop(next(iter(self._warm)))
        return res

    def quad(self, R: torch.Tensor, tol: float | torch.Tensor, floor: torch.Tensor | float,
             warm: bool = False, rounding: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(diag(Rᵀ K̂⁻¹ R), bound)``, each ``(t,)``, in the variational form; ``floor``: the smallest noise
        variance (``λ_min(K̂) ≥ floor``); ``rounding``: the weights ``x ≈ K̂⁻¹R`` ``(n, t)`` -> the working
        precision's share of the error ``(t,)``, added to the bound (the residual, computed in that precision, does
        not show it)."""
        res = self.solve(R, tol, warm)
        # 2 r'b - b'Ab = r'K̂⁻¹r - ρ'K̂⁻¹ρ, and ρ'K̂⁻¹ρ <= ||ρ||² / λ_min(K̂) <= ||ρ||² / min σ²
        bound = res.residual.square().sum(0) / floor
        if rounding is not None:
            bound = bound + rounding(res.x)
        return (R * res.x).sum(0) + (res.x * res.residual).sum(0), bound
