"""Factorized sparse approximate inverse (FSAI; Kolotilina & Yeremin), AFN paper Algorithm 1.

FSAI finds a sparse lower-triangular ``G`` with ``G^T G ~ A^{-1}`` for an SPD ``A`` from the entries of
``A`` on a causal kNN pattern only. This module holds

* :func:`fsai_factor` — Algorithm 1 with batched local Cholesky solves, returning ``G`` as sparse CSR;
* :class:`SparseTriangular` — products and triangular solves with ``G`` and ``G^T`` (shared with AFN);
* :class:`FSAIPreconditioner` — the standalone FSAI baseline on ``A = K + mu I`` (paper §5, w = 400).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import gpytorch
import torch

from gpnys.budget import block_rows
from gpnys.checks import NumericalWarning, validate_count
from gpnys.collectives import RowGroup, gather_rows
from gpnys.kernels.entries import KernelEntries
from gpnys.linalg import add_diag, safe_cholesky
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache, pattern_scale

__all__ = ["fsai_factor", "SparseTriangular", "FSAIPreconditioner"]



def _csr(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, n: int) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta" is not actionable for users
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, val, (n, n))


def fsai_factor(
    local_blocks_fn: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    valid: torch.Tensor,
    batch: int | None = None,
    shifts: list[float] | None = None,
    what: str = "FSAI local block",
    group: RowGroup | None = None,
    inputs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """FSAI factor ``G`` (AFN paper Algorithm 1) from local blocks of an SPD matrix ``A (n, n)``.

    Row ``i`` with pattern ``s_i = idx[i]`` (own index last): ``A_i = A[s_i, s_i]`` with padded positions
    (``valid = False``) replaced by identity rows/columns, ``y = A_i^{-1} e_w`` and
    ``G[i, s_i] = y^T / sqrt(y_w)``. With ``A_i = L L^T`` this row equals the last row of ``L^{-1}``
    (``L^{-1} e_w = e_w / L_ww`` gives ``y = L^{-T} e_w / L_ww`` and ``y_w = 1 / L_ww^2``), which is what is
    computed: one batched Cholesky (``cholesky_ex``) and one triangular solve per batch of rows, with
    ``y_w = 1 / L_ww^2 > 0`` by construction. A block that is not numerically SPD gets an escalating diagonal
    shift via :func:`safe_cholesky` (a :class:`NumericalWarning`; the shifts are appended to ``shifts``), so no
    NaNs are produced.

    Args:
        local_blocks_fn: maps index sets ``(b, w)`` to the blocks ``A[s, s]``, ``(b, w, w)``. Entries at
            padded positions are ignored.
        idx: ``(n, w)`` long pattern, ``idx[i, -1] == i`` and every valid entry ``<= i`` (see ``causal_knn``).
        valid: ``(n, w)`` bool mask of real pattern entries.
        batch: rows per batch; default keeps ``batch * w * w`` below ~4M entries.
        shifts: list that receives the diagonal shifts used.
        what: name used in warnings.
        group: compute only this rank's rows of ``G`` and gather the others' (one ``all_gather`` of ``n w``
            values; :mod:`gpnys.kernels.backends.partitioned`); ``None``: all rows here.
        inputs: tensors every rank must hold identically, checked at the gather (default: the first row's
            block, which carries the points and the hyperparameters); the first gives the values' dtype.

    Returns:
        ``G``: ``(n, n)`` sparse CSR, lower triangular with positive diagonal, sorted columns, ``nnz =
        valid.sum()``, dtype of the blocks.

    Example:
        >>> import torch
        >>> from gpnys.precond.fsai import fsai_factor
        >>> from gpnys.precond.knn import causal_knn
        >>> X = torch.rand(60, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> A = torch.exp(-torch.cdist(X, X).square()) + 0.1 * torch.eye(60, dtype=torch.float64)
        >>> blocks = lambda I: A[I[:, :, None], I[:, None, :]]  # A[s, s] for each row's index set s

        A full causal pattern (``w = n``) makes FSAI exact, ``G^T G = A^{-1}``; a sparse one approximates it:

        >>> G = fsai_factor(blocks, *causal_knn(X, 60)).to_dense()
        >>> torch.allclose(G.mT @ G, torch.linalg.inv(A))
        True
        >>> fsai_factor(blocks, *causal_knn(X, 10)).values().numel()  # 10 per row, fewer in the first rows
        555
    """
    n, w = idx.shape
    dev = idx.device
    batch = int(batch) if batch else block_rows(w * w, device=dev)

    def rows(lo: int, hi: int) -> torch.Tensor:  # (hi - lo, w) values of G's rows lo..hi, in pattern order
        vals: list[torch.Tensor] = []
        for a in range(lo, hi, batch):
            I, M = idx[a : min(a + batch, hi)], valid[a : min(a + batch, hi)]
            A = local_blocks_fn(I)
            eye = torch.eye(w, dtype=A.dtype, device=A.device)
            A = torch.where(M[:, :, None] & M[:, None, :], A, eye)
            L, info = torch.linalg.cholesky_ex(A)
            bad = info > 0
            if bool(bad.any()):
                L[bad] = safe_cholesky(A[bad], what, shifts)
            rhs = torch.zeros(A.shape[0], w, 1, dtype=A.dtype, device=A.device)
            rhs[:, -1] = 1.0
            g = torch.linalg.solve_triangular(L.mT, rhs, upper=True)[..., 0]  # (b, w) = last rows of L^{-1}
            broken = ~(torch.isfinite(g).all(dim=1) & (g[:, -1] > 0))
            if bool(broken.any()):  # L_ww underflowed: SPD in name only; shift such blocks harder
                g[broken] = _shifted_rows(A[broken], rhs[broken], what, shifts)
            vals.append(g)
        return torch.cat(vals)

    if group is not None and inputs is None:
        inputs = [local_blocks_fn(idx[:1]).reshape(1, -1)]
    G_vals = gather_rows(group, f"{what} rows", n, rows, inputs or [], (w,))
    # CSR with ascending columns per row: pads (valid=False) are dropped, the diagonal ends each row.
    key = torch.where(valid, idx, torch.full_like(idx, n))
    key, order = torch.sort(key, dim=1)
    G_vals = G_vals.gather(1, order)
    keep = key < n
    crow = torch.zeros(n + 1, dtype=torch.long, device=dev)
    crow[1:] = keep.sum(dim=1).cumsum(0)
    return _csr(crow, key[keep], G_vals[keep], n)


def _shifted_rows(A: torch.Tensor, rhs: torch.Tensor, what: str, shifts: list[float] | None) -> torch.Tensor:
    """Rows of ``fsai_factor`` for blocks whose factor gave non-finite values: shift until they are finite."""
    scale = A.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(torch.finfo(A.dtype).tiny)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    factor = 10.0 * torch.finfo(A.dtype).eps
    for _ in range(20):
        shift = factor * scale
        if shifts is not None:
            shifts.append(float(shift.max()))
        warnings.warn(
            f"{what}: factor not usable; added a diagonal shift up to {float(shift.max()):.3g} "
            f"to {A.shape[0]} block(s)",
            NumericalWarning,
            stacklevel=3,
        )
        L = safe_cholesky(A + shift[:, None, None] * eye, what, shifts)
        g = torch.linalg.solve_triangular(L.mT, rhs, upper=True)[..., 0]
        if bool((torch.isfinite(g).all(dim=1) & (g[:, -1] > 0)).all()):
            return g
        factor *= 10.0
    raise RuntimeError(f"{what}: no usable factor even after diagonal shifts")


def _tri_solve(T: torch.Tensor, B: torch.Tensor, upper: bool) -> torch.Tensor:
    """``T^{-1} B`` for a sparse CSR triangular ``T (n, n)`` and dense ``B (n, t)``.

    ``torch.triangular_solve`` handles CSR on CPU (MKL) and CUDA (cuSPARSE). Only if this build lacks it
    (e.g. no MKL), fall back to SciPy's ``spsolve_triangular`` on a CPU copy: the one place data leaves torch.
    """
    B = B.contiguous()
    try:
        return torch.triangular_solve(B, T, upper=upper).solution
    except (RuntimeError, NotImplementedError):  # pragma: no cover - depends on the torch build
        if T.device.type != "cpu":  # CUDA has it (cuSPARSE); an error there (e.g. out of memory) is real
            raise
        import scipy.sparse
        import scipy.sparse.linalg

        crow, col, val = (t.cpu().numpy() for t in (T.crow_indices(), T.col_indices(), T.values()))
        S = scipy.sparse.csr_matrix((val, col, crow), shape=T.shape)
        X = scipy.sparse.linalg.spsolve_triangular(S, B.cpu().numpy(), lower=not upper)
        return torch.as_tensor(X, dtype=B.dtype, device=B.device)


class SparseTriangular:
    """A sparse lower-triangular ``G (n, n)`` (CSR) with ``G^T`` kept in CSR too, for all four applies.

    Attributes:
        G, GT: CSR tensors; ``diag``: ``(n,)`` positive diagonal of ``G``; ``nnz``: stored nonzeros of ``G``.
    """

    def __init__(self, G: torch.Tensor) -> None:
        self.G = G
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.GT = G.t().to_sparse_csr()
        self.diag = G.values()[G.crow_indices()[1:] - 1]  # columns ascend, the diagonal ends each row
        self.nnz = int(G.values().numel())

    def __deepcopy__(self, memo: dict[int, Any]) -> "SparseTriangular":
        """``copy.deepcopy``: torch deep-copies no sparse CSR tensor (it reads a storage they lack), so the copy
        clones ``G`` (bit for bit) and forms ``G^T`` again."""
        copied = SparseTriangular(self.G.clone())
        memo[id(self)] = copied
        return copied

    def mm(self, R: torch.Tensor) -> torch.Tensor:
        """``G R`` for ``R: (n, t)``."""
        return self.G @ R

    def tmm(self, R: torch.Tensor) -> torch.Tensor:
        """``G^T R``."""
        return self.GT @ R

    def solve(self, R: torch.Tensor) -> torch.Tensor:
        """``G^{-1} R`` (sparse forward substitution)."""
        return _tri_solve(self.G, R, upper=False)

    def tsolve(self, R: torch.Tensor) -> torch.Tensor:
        """``G^{-T} R`` (sparse backward substitution with the upper-triangular ``G^T``)."""
        return _tri_solve(self.GT, R, upper=True)

    def logdiag(self) -> torch.Tensor:
        """``sum_i log G_ii`` (0-dim)."""
        return self.diag.log().sum()


def resolve_pattern_inputs(
    X: torch.Tensor, kernel: gpytorch.kernels.Kernel, cache: PointCache | None
) -> tuple[KernelEntries, PointCache, torch.Tensor | None]:
    """``(KernelEntries, PointCache, ARD scale or None)`` for a build on ``X`` (shared by FSAI and AFN)."""
    ke = KernelEntries(X, kernel)
    if cache is None:
        cache = PointCache(X)
    else:
        cache.check(X)
    return ke, cache, pattern_scale(ke.kernel, X)


class FSAIPreconditioner(Preconditioner):
    """FSAI applied directly to ``A = K + mu I`` in the data order of ``X``: ``P = (G^T G)^{-1}``.

    The standalone FSAI baseline of the AFN paper (§5, w = 400 nearest neighbours). ``G`` comes from
    :func:`fsai_factor` on the causal kNN pattern of ``X`` (for ARD kernels, of ``X / lengthscale``); only
    pattern entries of ``A`` are evaluated.

    * ``solve(R) = G^T (G R)`` (two sparse products), ``matmul(R) = G^{-1} G^{-T} R`` (two sparse solves),
    * ``logdet() = -2 sum log G_ii``, ``sample`` draws ``G^{-1} Z``, ``rank = 0``.

    Args:
        X: ``(n, d)`` points; kernel: a GPyTorch kernel (a ``ScaleKernel``'s outputscale is stripped);
        mu: ``> 0``; w: nonzeros per row of ``G`` (``1 <= w <= n``); cache: optional :class:`PointCache`.
        diag: optional per-point shifts ``(n,)`` on the diagonal instead of ``mu`` (``A = K + diag(mu_i)``).
        group: compute this rank's rows of ``G`` and gather the others' (``torch.distributed``; ``True``: the
            default group; :func:`fsai_factor`); the pattern is computed on every rank. ``None``: all rows here.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import FSAIPreconditioner
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(100, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.MaternKernel(nu=1.5).double()
        >>> kernel.lengthscale = 0.3
        >>> A = kernel(X).to_dense().detach() + 0.1 * torch.eye(100, dtype=torch.float64)  # K + mu I
        >>> b = torch.randn(100, dtype=torch.float64, generator=g)

        With a full pattern (``w = n``) ``G`` is the inverse Cholesky factor of ``A``: ``G^T G = A^{-1}``.

        >>> P = FSAIPreconditioner(X, kernel, mu=0.1, w=100)
        >>> torch.allclose(P.solve(b), torch.linalg.solve(A, b))
        True
        >>> torch.allclose(P.logdet(), torch.logdet(A))
        True

        With ``w = 10`` nonzeros per row, ``solve`` is ``G^T (G b)`` for the sparse lower-triangular ``G``:

        >>> P = FSAIPreconditioner(X, kernel, mu=0.1, w=10)
        >>> G = P.G.to_dense()
        >>> torch.equal(G, G.tril()), torch.allclose(P.solve(b), G.mT @ (G @ b))
        (True, True)
    """

    kind = "fsai"

    @torch.no_grad()
    def __init__(
        self,
        X: torch.Tensor,
        kernel: gpytorch.kernels.Kernel,
        mu: float,
        w: int = 400,
        cache: PointCache | None = None,
        diag: torch.Tensor | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        t0 = self._start(X, mu, diag)
        ranks = RowGroup.of(group)
        self.w = validate_count(w, "w", 1, self.n)
        self.rank = 0
        ke, cache, scale = resolve_pattern_inputs(X, kernel, cache)
        hits0 = cache.hits
        idx, valid = cache.knn("data", None, self.w, scale)
        self.cache_hits = cache.hits - hits0
        shift = self._shift

        def blocks(I: torch.Tensor) -> torch.Tensor:  # A[s, s] = K[s, s] + mu I (or + diag(mu_s)), (b, w, w)
            return add_diag(ke.batched(I), shift(I))

        G = fsai_factor(blocks, idx, valid, shifts=self.shifts, what="FSAI(K + mu I)", group=ranks,
                        inputs=None if ranks is None else [X, blocks(idx[:1]).reshape(1, -1)])
        self.factor = SparseTriangular(G)
        self.setup_s = time.perf_counter() - t0

    @property
    def G(self) -> torch.Tensor:
        """The FSAI factor ``G`` (sparse CSR, lower triangular)."""
        return self.factor.G

    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        return self.factor.tmm(self.factor.mm(R))

    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        return self.factor.solve(self.factor.tsolve(R))

    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        return self.factor.solve(Z)

    def logdet(self) -> torch.Tensor:
        return -2.0 * self.factor.logdiag()

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(w=self.w, nnz=self.factor.nnz, cache_hits=self.cache_hits)
        return out
