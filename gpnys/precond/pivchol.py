"""GPyTorch's partial pivoted-Cholesky preconditioner ``P = L L^T + mu I`` as a gpnys :class:`Preconditioner`.

The factor ``L (n, rank)`` is computed by GPyTorch's own implementation,
``linear_operator.functions.pivoted_cholesky`` -> ``LinearOperator.pivoted_cholesky`` ->
``linear_operator.functions._pivoted_cholesky.PivotedCholesky`` (greedy max-residual-diagonal pivots,
Harbrecht et al. 2012) -- the same routine ``AddedDiagLinearOperator._preconditioner`` uses for
GPyTorch's default preconditioner (``settings.max_preconditioner_size`` = 15, stopping tolerance
``settings.preconditioner_tolerance`` = 1e-3). It is not rewritten here.

What the GPyTorch routine evaluates (linear_operator 0.6.1 / gpytorch 1.15, checked in the source and by
counting kernel calls): the algorithm itself touches only ``matrix._approx_diagonal()`` and one row per
step (``apply_permutation(matrix, pi_m[..., None])``). BUT it is run through
``PivotedCholesky.apply(self.representation_tree(), ...,*self.representation())``, and for a GPyTorch
``LazyEvaluatedKernelTensor`` (what ``kernel(X)`` returns) ``representation()`` calls
``evaluate_kernel()``, which builds the **full dense n x n kernel matrix** (one ``kernel.forward(X, X)``
call) before the first pivot. The deprecated ``beta_features.checkpoint_kernel`` path avoids that but
evaluates ``(n, chunk, d) x (n, n, d)`` broadcasted blocks, which is worse. So GPyTorch's pivoted
Cholesky on ``kernel(X)`` costs ``O(n^2)`` memory.

To keep ``O(n * rank)`` memory we hand the same GPyTorch routine a tiny LinearOperator,
:class:`KernelRowsOperator`, whose diagonal and ``_get_indices`` evaluate only the requested kernel
entries (elementwise ``kernel.forward(.., diag=True)``), so each step evaluates one kernel row. The result
equals ``kernel(X).pivoted_cholesky(rank)`` up to rounding (tested). ``lazy=False`` uses ``kernel(X)``
directly (GPyTorch's own dense path).

Solve/logdet use the QR form that GPyTorch uses (numerically sane Woodbury): with
``[L; sqrt(mu) I_k] = [Q1; Q2] R``,  ``R^T R = L^T L + mu I``, so

    P^{-1} v = (v - Q1 Q1^T v) / mu,          log det P = 2 sum log|R_ii| + (n - k) log mu

(matrix determinant lemma), and never inverts ``L^T L`` in the normal-equations form.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import gpytorch
import torch
from linear_operator.functions import pivoted_cholesky
from linear_operator.operators import LinearOperator

from gpnys.checks import NumericalWarning, validate_count
from gpnys.kernels.entries import KernelEntries, evaluate
from gpnys.linalg import draw
from gpnys.precond.base import Preconditioner

__all__ = ["PivotedCholeskyPreconditioner", "KernelRowsOperator"]


class KernelRowsOperator(LinearOperator):
    """The ``n x n`` kernel matrix ``k(X, X)`` as a LinearOperator that never materialises it.

    Only what GPyTorch's pivoted Cholesky needs is efficient: the diagonal (``O(n)`` evaluations) and
    element lookups ``_get_indices`` (one kernel evaluation per requested entry, e.g. one row). ``_matmul``
    is blocked (``O(block * n)`` memory). ``kernel`` must be evaluable with ``forward(x1, x2, diag=True)``.

    Args:
        X: ``(n, d)`` points.
        kernel: a GPyTorch kernel (used as is; strip any ``ScaleKernel`` beforehand if unit variance is wanted).
    """

    def __init__(self, X: torch.Tensor, kernel: gpytorch.kernels.Kernel) -> None:
        super().__init__(X, kernel=kernel)
        self.X = X
        self.kernel = kernel

    def _entries(self, A: torch.Tensor, B: torch.Tensor, diag: bool) -> torch.Tensor:
        with torch.no_grad():
            return evaluate(self.kernel, A, B, diag=diag).to(self.X.dtype)

    def _size(self) -> torch.Size:
        n = self.X.shape[-2]
        return torch.Size((n, n))

    def _transpose_nonbatch(self) -> "KernelRowsOperator":
        return self

    def _diagonal(self) -> torch.Tensor:
        return self._entries(self.X, self.X, diag=True)

    def _get_indices(self, row_index: torch.Tensor, col_index: torch.Tensor, *batch_indices: Any) -> torch.Tensor:
        rows, cols = torch.broadcast_tensors(row_index, col_index)
        vals = self._entries(self.X[rows.reshape(-1)], self.X[cols.reshape(-1)], diag=True)
        return vals.reshape(rows.shape)

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return KernelEntries(self.X, self.kernel).matmul(rhs)


class PivotedCholeskyPreconditioner(Preconditioner):
    """``P = L L^T + mu I`` with ``L (n, rank)`` GPyTorch's partial pivoted Cholesky factor of ``K``.

    ``K`` is the unit-variance kernel matrix (a ``ScaleKernel``'s outputscale is stripped, so ``mu`` is
    ``noise / outputscale``). Setup: ``O(n * rank * (d + rank))`` time, ``O(n * rank)`` memory with the
    default ``lazy=True``.

    Args:
        X: ``(n, d)`` points.
        kernel: GPyTorch kernel.
        mu: regularisation ``mu > 0``.
        rank: number of pivoted-Cholesky columns requested (``1 <= rank <= n``; GPyTorch's default is 15).
        error_tol: GPyTorch's early-stopping tolerance on ``trace(K - L L^T) / max(diag K)``; ``None`` =
            ``linear_operator.settings.preconditioner_tolerance`` (1e-3), exactly as GPyTorch's own
            preconditioner. The factor can therefore have fewer than ``rank`` columns; ``self.rank`` is
            the number actually computed.
        lazy: evaluate only the diagonal and the pivot rows (default). ``False`` passes ``kernel(X)``
            to GPyTorch, which forms the dense ``n x n`` matrix.

    Attributes:
        L: ``(n, rank)`` factor; pivots: ``(rank,)`` long, the pivot rows in selection order.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import PivotedCholeskyPreconditioner
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(150, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.RBFKernel().double()
        >>> P = PivotedCholeskyPreconditioner(X, kernel, mu=0.01, rank=20)

        The same factor as GPyTorch's own (dense) pivoted Cholesky, and an exact solve with ``L L^T + mu I``:

        >>> torch.allclose(P.L, kernel(X).pivoted_cholesky(rank=20))
        True
        >>> M = P.L @ P.L.mT + 0.01 * torch.eye(150, dtype=torch.float64)
        >>> v = torch.randn(150, dtype=torch.float64, generator=g)
        >>> torch.allclose(P.solve(v), torch.linalg.solve(M, v)), torch.allclose(P.logdet(), torch.logdet(M))
        (True, True)
    """

    kind = "pivchol"

    def __init__(
        self,
        X: torch.Tensor,
        kernel: gpytorch.kernels.Kernel,
        mu: float,
        rank: int = 15,
        error_tol: float | None = None,
        lazy: bool = True,
    ) -> None:
        super().__init__()
        t0 = self._start(X, mu)
        n = X.shape[0]
        self.requested_rank = validate_count(rank, "rank", 1, n)
        unit = KernelEntries(X, kernel).kernel
        op = KernelRowsOperator(X, unit) if lazy else unit(X)
        with torch.no_grad():
            L, piv = pivoted_cholesky(op, rank=self.requested_rank, error_tol=error_tol, return_pivots=True)
        L = L.to(X.dtype)
        k = L.shape[-1]
        good = torch.isfinite(L).all(dim=0)
        if not bool(good.all()):
            k = int(torch.nonzero(~good)[0])
            warnings.warn(
                f"pivoted Cholesky produced non-finite column {k}; keeping the first {k} columns",
                NumericalWarning,
                stacklevel=2,
            )
            L = L[:, :k]
        self.L = L.contiguous()
        self.pivots = piv[:k]
        self.rank = k
        eye = torch.eye(k, dtype=X.dtype, device=X.device)
        Q, R = torch.linalg.qr(torch.cat([self.L, self.mu**0.5 * eye], dim=0))
        self._Q1 = Q[:n]
        diagR = R.diagonal().abs()
        mu = torch.tensor(self.mu, dtype=X.dtype, device=X.device)
        self._logdet = 2 * diagR.log().sum() + (n - k) * torch.log(mu)
        # Square factor F (F F^T = P) for _sample(Z): L = Qc Rc (thin QR), C C^T = Rc Rc^T + mu I,
        # F = Qc C Qc^T + sqrt(mu) (I - Qc Qc^T).
        Qc, Rc = torch.linalg.qr(self.L)
        self._Qc = Qc
        self._C = torch.linalg.cholesky(Rc @ Rc.mT + self.mu * eye)
        self.lazy = lazy
        self.error_tol = error_tol
        self.setup_s = time.perf_counter() - t0

    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        return (R - self._Q1 @ (self._Q1.mT @ R)) / self.mu

    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        return self.L @ (self.L.mT @ R) + self.mu * R

    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        QtZ = self._Qc.mT @ Z
        return self._Qc @ (self._C @ QtZ) + self.mu**0.5 * (Z - self._Qc @ QtZ)

    def sample(
        self, num: int = 1, generator: torch.Generator | None = None, distribution: str = "gaussian"
    ) -> torch.Tensor:
        """``num`` draws ``L z1 + sqrt(mu) z2`` (``z1: (rank, num)``, ``z2: (n, num)``, covariance ``P``)."""
        num = int(num)
        Z1 = draw((self.rank, num), self.dtype, self.device, generator, distribution)
        Z2 = draw((self.n, num), self.dtype, self.device, generator, distribution)
        return self.L @ Z1 + self.mu**0.5 * Z2

    def logdet(self) -> torch.Tensor:
        """``log det (L L^T + mu I) = 2 sum log|R_ii| + (n - rank) log mu`` (0-dim)."""
        return self._logdet

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            requested_rank=self.requested_rank,
            landmarks="pivoted-cholesky (max residual diagonal, GPyTorch)",
            error_tol=self.error_tol,
            lazy=self.lazy,
            nnz=self.n * self.rank,
        )
        return out
