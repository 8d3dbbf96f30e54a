"""The marginal likelihood with error bars: ``-log p(y)`` and its gradient by PCG + stochastic Lanczos quadrature, each
with a standard error, and as many probes as a requested accuracy needs.

For ``L = ½ (rᵀK̂⁻¹r + log det K̂ + n log 2π)``, ``r = y - m``, with probes ``z_j ~ N(0, P̂)`` (``j = 1..t``):

* ``rᵀK̂⁻¹r`` by PCG in the variational form ``2 rᵀa - aᵀK̂a = rᵀK̂⁻¹r - ||a - K̂⁻¹r||²_K̂``, whose error lies in
  ``[0, ||ρ||² / λ_min]`` (``ρ`` the true residual, ``λ_min ≥`` the smallest noise variance);
* ``log det K̂ = log det P̂ + (1/t) Σ_j ℓ_j`` with ``ℓ_j = n e₁ᵀ log(T_j) e₁`` from the Lanczos tridiagonal ``T_j`` of
  the CG run on ``z_j`` (Gardner et al. 2018, Sec. 4; Ubaru et al. 2017, eq. 6), and the quadrature's change from
  its second-last step as its truncation error;
* the gradient ``∂L = ½ (-aᵀ∂K̂a + (1/t) Σ_j g_j) - aᵀ∂m - ρᵀK̂⁻¹∂m`` (the last term by the mean's directions'
  solves, :func:`_mean_directions`: the mean's part is second order in the solves' errors) with the per-probe terms
  ``g_j = (K̂⁻¹z_j)ᵀ ∂K̂ P̂⁻¹z_j + ∂ log det P̂ - (P̂⁻¹z_j)ᵀ ∂P̂ P̂⁻¹z_j`` (the control variate of Wenger et al.
  2022, eq. 9, when the preconditioner is differentiable).

The ``ℓ_j`` and the ``g_j`` are i.i.d. over ``j``, so the standard errors are their sample deviations over ``√t``
(the ``ℓ_j``'s floored by the Ritz value furthest in log from their mean, :func:`slq_variance`, and the ``g_j``'s
lifted with them, :func:`gradient_spread`; the loss adds the CG bound, the Lanczos estimate and the rounding in
quadrature, the gradient the solves' shares and the products' rounding).
The per-probe ``g_j`` come from one pass of
:meth:`~gpnys.kernels.operator.StationaryKernelOperator.column_derivatives` (any other kernel: one derivative per
probe) mapped to the raw parameters by a batched vector-Jacobian product. ``aᵀ∂K̂a`` is one more column of the
first such pass, and the gradient is assembled from these sums: it costs no kernel pass of its own.

Written by hand because GPyTorch's ``InvQuadLogdet`` (linear_operator 0.6.1) returns only the probe averages: it
has no per-probe terms, so no error bar, and no way to add probes to an estimate.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import gpytorch
import torch
from linear_operator.operators import AddedDiagLinearOperator, LinearOperator
from linear_operator.utils.errors import NotPSDError

from gpnys.checks import NumericalWarning
from gpnys.gp.settings import EstimatorSettings
from gpnys.linalg import draw, small_dense
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.base import Preconditioner
from gpnys.solvers.pcg import NonFiniteError, QuadratureTest, pcg

__all__ = ["Estimate", "EstimatorState", "Evaluation", "log_prob", "slq_terms", "slq_quadrature",
           "ritz_log_square", "slq_variance", "gradient_spread", "gradient_at_noise", "PROXY_ABOVE", "NOISE_LEVEL",
           "MEAN_GAIN_SHARE"]

#: :func:`gradient_at_noise`: the gradient is taken as zero when a chi-square test at ``1 - NOISE_LEVEL`` cannot
#: tell it from its noise
NOISE_LEVEL = 0.95

#: AFN's per-probe control-variate Jacobian goes through the family itself while ``(n - k) w^2 k t`` is at most this,
#: else through the cheaper "frozen" family (a conservative standard error; :func:`log_prob`)
PROXY_ABOVE = 5e8


@dataclass
class Estimate:
    """One evaluation of ``L = -log p(y)`` (a sum over the ``n`` points; ``ExactMarginalLogLikelihood`` divides by n).

    Attributes:
        value: the estimate of ``L``.
        std_error: its standard error (probe spread, CG bound and Lanczos estimate in quadrature).
        grad_std_error: ``{parameter name: tensor}`` the standard error of each gradient component.
        n: training points; probes: probe vectors used; batches: probe batches drawn;
        cg_iterations: CG iterations of the solve with ``r`` plus the largest over probes;
        residual_bound: ``||ρ||² / (2 λ_min)``, the bound on the inverse quadratic's error (in ``L``);
        lanczos_error: the quadrature's truncation estimate (in ``L``).
        rounding_error: the working precision's share (in ``L``): ``4 u (|a|ᵀ K̂ |a| + ½ mean_j |z_j|ᵀ K̂ |u_j|)``
            with ``a = K̂⁻¹ r``, ``u_j = K̂⁻¹ z_j`` and ``u`` the dtype's unit round-off: the first-order effect of
            rounding in the products on the inverse quadratic and the log-determinant (docs/accuracy.md, "Rounding
            in float32"; :func:`_rounding`). It is part of ``std_error``.
        grad_rounding_error: ``{parameter name: tensor}``, the same for the gradient components without a probe
            term (the mean's: :func:`_mean_error`; 0 elsewhere); part of ``grad_std_error``.
        mean_curvature: ``{parameter name: tensor}``, ``∂m_cᵀ K̂⁻¹ ∂m_c`` for the mean's entries (0 elsewhere): the
            loss is quadratic in a mean that is linear in its parameters, so a gradient ``g_c`` there is worth a
            gain of ``g_c² / (2 ∂m_cᵀ K̂⁻¹ ∂m_c)`` (:func:`gradient_at_noise`).
        path: ``"iterative"`` (this estimator) or ``"cholesky"`` (GPyTorch's dense Cholesky: exact, standard
            errors 0); path_reason: why (:func:`gpnys.gp.path.choose_path`).

    Example:
        A batch-mode model's elements are independent estimates; their sum's error bar adds in quadrature:

        >>> from gpnys.gp.estimator import Estimate
        >>> total = Estimate.total([Estimate(10.0, 0.3, n=50), Estimate(12.0, 0.4, n=50)])
        >>> total.value, round(total.std_error, 6), total.n
        (22.0, 0.5, 100)
    """

    value: float
    std_error: float
    grad_std_error: dict[str, torch.Tensor] = field(default_factory=dict)
    n: int = 0
    probes: int = 0
    batches: int = 0
    cg_iterations: int = 0
    residual_bound: float = 0.0
    lanczos_error: float = 0.0
    rounding_error: float = 0.0
    path: str = "iterative"
    path_reason: str = ""
    grad_rounding_error: dict[str, torch.Tensor] = field(default_factory=dict)
    mean_curvature: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def total(cls, parts: list["Estimate"]) -> "Estimate":
        """The sum of independent estimates (the elements of a batch-mode model): values, points, probes and
        bounds add; standard errors add in quadrature; iterations are the largest."""
        def quad(values: list[Any]) -> Any:
            return sum(v * v for v in values) ** 0.5

        names = parts[0].grad_std_error.keys() if all(p.grad_std_error for p in parts) else ()
        floors = parts[0].grad_rounding_error.keys() if all(p.grad_rounding_error for p in parts) else ()
        curvatures = parts[0].mean_curvature.keys() if all(p.mean_curvature for p in parts) else ()
        return cls(value=sum(p.value for p in parts), std_error=quad([p.std_error for p in parts]),
                   grad_std_error={k: quad([p.grad_std_error[k] for p in parts]) for k in names},
                   grad_rounding_error={k: quad([p.grad_rounding_error[k] for p in parts]) for k in floors},
                   mean_curvature={k: sum(p.mean_curvature[k] for p in parts) for k in curvatures},
                   n=sum(p.n for p in parts), probes=sum(p.probes for p in parts),
                   batches=max(p.batches for p in parts), cg_iterations=max(p.cg_iterations for p in parts),
                   residual_bound=sum(p.residual_bound for p in parts),
                   lanczos_error=sum(p.lanczos_error for p in parts),
                   rounding_error=sum(p.rounding_error for p in parts), path=parts[0].path,
                   path_reason=parts[0].path_reason)

    @property
    def rounding_dominates(self) -> bool:
        """Whether the working precision's rounding term is the largest part of :attr:`std_error` (float32 on an
        ill-conditioned ``K̂``, or a preconditioner so close to ``K̂`` that the probes barely vary): more probes
        would not shrink the error bar."""
        return self.rounding_error > 0 and self.rounding_error**2 > 0.5 * self.std_error**2

    def per_point(self) -> dict[str, Any]:
        """The loss ``L / n`` (GPyTorch's ``-ExactMarginalLogLikelihood``), its standard errors (per parameter
        name) and the work, as plain numbers."""
        n = max(self.n, 1)

        def plain(v: torch.Tensor) -> float | list[float]:
            v = (v / n).reshape(-1)
            return v.tolist() if v.numel() > 1 else float(v)

        return {"loss": self.value / n, "loss_std_error": self.std_error / n,
                "loss_rounding_error": self.rounding_error / n,
                "grad_std_error": {k: plain(v) for k, v in self.grad_std_error.items()},
                "probes": self.probes, "cg_iterations": self.cg_iterations}


def _sign_generator(probe_seed: int | None, device: torch.device) -> torch.Generator:
    """The rounding term's own random signs (:data:`ROUNDING_SIGNS`): seeded from ``probe_seed`` (a fixed seed
    without one), so that drawing them, which only some evaluations do, moves neither the probes of later batches
    nor the caller's random stream."""
    return torch.Generator(device=device).manual_seed(ROUNDING_SEED + (0 if probe_seed is None else int(probe_seed)))


def _tridiagonal_eigh(tridiagonal: tuple[torch.Tensor, torch.Tensor],
                      steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of every column's leading ``steps_j x steps_j`` tridiagonal (``(m, t)`` padded diagonals of
    :func:`gpnys.solvers.pcg.pcg`), padded with decoupled unit diagonals (``log 1 = 0``) so that one batched ``eigh``
    serves all: ``(t, m)`` eigenvalues clamped above 0, ``(t, m, m)`` eigenvectors."""
    diag, off = tridiagonal
    m = diag.shape[0]
    k = steps.clamp_min(1)
    rows = torch.arange(m, device=diag.device)[:, None]
    d = torch.where(rows < k[None, :], diag, torch.ones_like(diag))
    o = torch.where(rows[:-1] < (k[None, :] - 1), off, torch.zeros_like(off)) if m > 1 else off
    T = torch.diag_embed(d.mT) + torch.diag_embed(o.mT, 1) + torch.diag_embed(o.mT, -1)
    with small_dense(m, T.device):
        evals, evecs = torch.linalg.eigh(T)
    if bool((evals <= 0).any()):
        warnings.warn("gpnys: a Lanczos tridiagonal had non-positive eigenvalues (rounding); clamped",
                      NumericalWarning, stacklevel=4)
    return evals.clamp_min(torch.finfo(T.dtype).tiny), evecs


def slq_quadrature(tridiagonal: tuple[torch.Tensor, torch.Tensor], steps: torch.Tensor,
                   n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`slq_terms`, and the full quadrature's Ritz values ``(t, m)`` (clamped above 0) for
    :func:`ritz_log_square`. Those the probe does not see, a quadrature weight ``(e₁ᵀv)²`` at most the dtype's
    ``eps``, read 0 there: the padding's, and those of the steps a column takes past its solve's rounding floor
    (the Lanczos coefficients of a rounding-level residual; in float32 at a full-rank preconditioner they read up
    to 200 times ``M``'s largest eigenvalue, with weights below 1e-38)."""
    out = []
    for drop in (0, 1):  # the full quadrature, and the one a step shorter
        evals, evecs = _tridiagonal_eigh(tridiagonal, steps - drop)
        weights = evecs[:, 0, :].square()
        out.append((n * (weights * evals.log()).sum(-1), evals))
        if drop == 0:
            ritz = torch.where(weights > torch.finfo(weights.dtype).eps, evals, torch.zeros_like(evals))
    return out[0][0], (out[0][0] - out[1][0]).abs(), ritz


def slq_terms(tridiagonal: tuple[torch.Tensor, torch.Tensor], steps: torch.Tensor,
              n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-probe ``ℓ_j = n e₁ᵀ log(T_j) e₁`` and ``|ℓ_j - ℓ_j^{(m_j - 1)}|`` (``(t,)`` each) from the padded
    tridiagonals of :func:`gpnys.solvers.pcg.pcg` and each column's step count ``m_j`` (:func:`_tridiagonal_eigh`)."""
    return slq_quadrature(tridiagonal, steps, n)[:2]


def ritz_log_square(ritz: torch.Tensor, centre: float = 0.0) -> float:
    """The largest ``(log θ - c)²`` over the Ritz values ``θ`` of the probes' tridiagonals (:func:`slq_quadrature`)
    with ``c = centre``, at most ``(log λ - c)²`` of an extreme eigenvalue ``λ`` of the preconditioned matrix ``M``
    (Ritz values interlace its spectrum). With ``c`` the mean ``tr(log M) / n`` of ``log M``'s eigenvalues (the
    ``ℓ_j``'s mean over ``n``), each ``ℓ_j = n ξ̂_jᵀ log(M) ξ̂_j`` (``ξ̂_j`` the whitened probe scaled to norm
    ``√n``) has variance about ``2 ‖log M - c I‖_F² ≥ 2 (log λ - c)²`` for Gaussian probes, and about
    ``2 (log λ - c)²`` or more for random signs where that eigenvector of ``log M`` spreads over many coordinates: a
    floor under the ``ℓ_j``'s sample variance, which collapses when one large eigenvalue makes them skewed (a scaled
    chi-square of one degree). The ``ℓ_j`` do not move when ``P̂`` is scaled (``log M`` shifted by a multiple of
    ``I``), and neither does this floor with the centre: uncentred (``c = 0``) it read ``2 log² s`` for
    ``M = s I``, whose ``ℓ_j`` are all ``n log s`` (the RAN scaling of Frangella, Tropp & Udell 2023 at full rank,
    ``P̂ = K̂ / (λ_k + μ)``), and :func:`gradient_spread` divided that by the ``ℓ_j``'s rounding-level spread."""
    kept = ritz[ritz > torch.finfo(ritz.dtype).tiny]  # not the clamped ones (a rounding-broken tridiagonal)
    return float((kept.log() - centre).square().max()) if kept.numel() else 0.0


def slq_variance(ell: torch.Tensor, ritz_log_sq: float) -> float:
    """The variance of one SLQ term ``ℓ_j`` (``ell``, ``(t,)``) that a log-determinant's standard error uses: their
    sample variance, or where larger ``2 (log θ - c)²_max`` (``ritz_log_sq``, :func:`ritz_log_square`). With one large
    eigenvalue of ``log M`` the ``ℓ_j`` are skewed, and 16 of them understated their spread by 2-3x at 3 of 20 probe
    seeds (2-D RBF, Nyström of rank 13; a Laplace classifier at outputscale 1e5: 2 of 20 seeds outside 3 standard
    errors; docs/accuracy.md).

    Example:
        >>> import torch
        >>> from gpnys.gp.estimator import slq_variance
        >>> slq_variance(torch.tensor([1.0, 1.1, 0.9, 1.0]), 0.0) == float(torch.tensor([1.0, 1.1, 0.9, 1.0]).var())
        True
        >>> slq_variance(torch.tensor([1.0, 1.1, 0.9, 1.0]), 2.0)  # the floor 2 (log θ - c)²_max
        4.0
    """
    return max(float(ell.var()) if ell.numel() > 1 else math.inf, 2 * ritz_log_sq)


def gradient_spread(J: torch.Tensor, ell: torch.Tensor, ritz_log_sq: float) -> torch.Tensor:
    """The per-probe gradient rows' variance ``(p,)`` (``J``: ``(t, p)``, the rows of the probes whose
    log-determinant terms are ``ell``, ``(t,)``): their sample variance, plus, where :func:`slq_variance` floors the
    ``ℓ_j``'s variance above their sample variance, each column's share of that gap through its regression on the
    ``ℓ_j``, ``β² (floor - s²_ℓ)``. One dominant eigenvalue of ``M`` drives both (each nearly a multiple of one
    chi-square of one degree), and 16 probes understated both spreads together: a 2-D ARD RBF's gradient was
    beyond 4 standard errors at 3 of 20 seeds (docs/accuracy.md). Rows unrelated to ``ell`` (``β ≈ 0``) keep their
    sample variance.

    Example:
        >>> import torch
        >>> from gpnys.gp.estimator import gradient_spread
        >>> ell = torch.tensor([0.1, 0.2, 0.1, 1.6], dtype=torch.float64)  # one large term: skewed
        >>> J = torch.stack([2 * ell, torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)], 1)
        >>> gradient_spread(J, ell, 0.0).tolist() == J.var(0).tolist()  # no floor: the sample variances
        True
        >>> bool(gradient_spread(J, ell, 2.0)[0] > J.var(0)[0])  # the floor 4 lifts the column that ell drives
        True
    """
    var = J.var(0) if J.shape[0] > 1 else torch.full_like(J[0], math.inf)
    floor = slq_variance(ell, ritz_log_sq)
    centred = ell.to(J) - ell.to(J).mean()
    s_ell = float(centred.square().sum())
    gap = floor - s_ell / max(ell.numel() - 1, 1)
    if ell.numel() < 3 or gap <= 0 or s_ell <= 0:
        return var
    beta = (J - J.mean(0)).mT @ centred / s_ell
    return var + beta.square() * gap


def _quadrature_test(n: int, share: float, tol_r: float, probes: int) -> QuadratureTest:
    """:func:`~gpnys.solvers.pcg.pcg`'s ``quadrature`` test for a first batch (column 0 the solve with ``r``, the
    ``probes`` probes after it, then the mean's directions): converged once column 0 has met ``tol_r`` and the
    probes' mean truncation estimate ``|ℓ_j^(m) - ℓ_j^(m-1)|`` (:func:`slq_terms`) is at most ``share`` of their
    standard error ``std(ℓ_j) / √t`` and at most half the step before's (a geometric decay: for ``log`` the Gauss
    rules converge from one side, so the remaining error is then below the last step's), after at least 3 steps. It
    then adds ``√(1 + share²) - 1`` to the loss's standard error at most (0.5 % at 0.1)."""

    def done(tridiagonal: tuple[torch.Tensor, torch.Tensor], steps: torch.Tensor, rel: torch.Tensor) -> bool:
        steps = steps[1 : 1 + probes]
        if steps.numel() < 2 or int(steps.min()) < 3 or float(rel[0]) > tol_r:
            return False
        T = (tridiagonal[0][:, 1 : 1 + probes], tridiagonal[1][:, 1 : 1 + probes])
        try:
            ell, inc = slq_terms(T, steps, n)
            _, before = slq_terms(T, steps - 1, n)
        except torch.linalg.LinAlgError:  # eigh did not converge: keep to the floor
            return False
        se = float(ell.std()) / math.sqrt(ell.numel())
        last = float(inc.mean())
        return last <= share * se and last <= 0.5 * float(before.mean())

    return done


#: the rounding term's multiple of the unit round-off's first-order effects (:class:`Estimate`), and how many of
#: the first batch's probes estimate the log-determinant's share (their ``K̂ |u_j|`` ride along in the solve's last
#: product)
ROUNDING_FACTOR, ROUNDING_PROBES = 4.0, 4

#: the solve with ``r`` runs to this share of the probes' CG tolerance with fresh probes; to the tighter one with
#: common random numbers (``probe_seed``: a quasi-Newton optimiser's line searches need the estimate smooth in the
#: hyperparameters) and where the mean has more than ``MEAN_DIRECTIONS`` parameter entries (:func:`_mean_directions`;
#: docs/accuracy.md, "Where the error bars come from")
Y_TOLERANCE_SHARE, Y_TOLERANCE_SHARE_TIGHT, MEAN_DIRECTIONS = 1e-1, 1e-2, 8

#: below this unit round-off (float32, half) the gradient's error bars hold the kernel products' rounding in the solve
#: with ``r`` (:data:`ROUNDING_SIGNS`); in float64 it was below the probes' spread by orders of magnitude
ROUNDING_EPS = 1e-10

#: refinement of the solve with ``r``: while its true residual is above ``REFINE_ABOVE`` times its tolerance (the
#: recursion's residual drifted from the true one, or the recursion broke down, e.g. float32 with a preconditioner
#: near ``K̂``), PCG runs again on the true residual from the solution so far, up to ``REFINE_ROUNDS`` times, each
#: round at most twice the first solve's iterations (iterative refinement; :func:`_refine`)
REFINE_ABOVE, REFINE_ROUNDS, REFINE_PLAIN_STEPS = 10.0, 3, 50

#: the gradient's error bars hold the probe solves' share ½ mean_j (P̂⁻¹ρ_j)ᵀ∂K̂b_j, sized on this many of the first
#: batch's probes (:func:`log_prob`; 0: not at all)
PROBE_SOLVE_PROBES = 4

#: below :data:`ROUNDING_EPS`, the gradient's error bars hold the kernel products' rounding in the solve with ``r``,
#: ``(K̂⁻¹e)ᵀ∂K̂a`` with ``e ~ u K̂|a|`` in random signs, sized on this many sign draws (:func:`log_prob`)
ROUNDING_SIGNS = 4

#: ... and only where ``u ‖K̂|a|‖`` exceeds this share of the residual ``‖ρ‖`` of the solve with ``r``: below, its
#: share is at most about that fraction of the solve's own, already in the error bars
ROUNDING_SHARE = 0.1

#: the seed of those signs, offset by ``probe_seed`` (:func:`_sign_generator`)
ROUNDING_SEED = 7919

#: :func:`gradient_at_noise`: the mean's entries (no probe term) count as converged once the gain they still offer
#: is below this share of the loss's standard error
MEAN_GAIN_SHARE = 0.1


def _mean_directions(mean: torch.Tensor, tensors: list[torch.Tensor],
                     limit: int = MEAN_DIRECTIONS) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(D, index)``: the columns ``D = ∂m/∂θ_c`` (``(n, p)``) of the mean ``m`` (``(n,)``) for the ``p`` entries
    ``index`` of the flattened ``tensors`` it depends on, by reverse-over-reverse (``g(u) = Dᵀu`` is linear in
    ``u``); empty ``(n, 0)`` for a mean without parameters, ``None`` when ``p > limit``."""
    n = mean.shape[-1]
    empty = mean.new_zeros(n, 0), torch.zeros(0, dtype=torch.long, device=mean.device)
    if not tensors or not mean.requires_grad:
        return empty
    u = torch.zeros(n, dtype=mean.dtype, device=mean.device, requires_grad=True)
    g = torch.autograd.grad(mean, tensors, grad_outputs=u, create_graph=True, allow_unused=True)
    entries, at = [], 0  # (flat index, g's entry) of every entry the mean depends on
    for gi, p in zip(g, tensors):
        if gi is not None and gi.requires_grad:
            entries += [(at + c, v) for c, v in enumerate(gi.reshape(-1))]
        at += p.numel()
    if len(entries) > limit:
        return None
    if not entries:
        return empty
    cols = [torch.autograd.grad(v, u, retain_graph=True)[0] for _, v in entries]
    index = torch.tensor([c for c, _ in entries], dtype=torch.long, device=mean.device)
    return torch.stack(cols, 1).detach(), index


def _rounding(X: torch.Tensor, Z: torch.Tensor, K_abs: torch.Tensor | None) -> float:
    """The rounding term of :class:`Estimate` (in ``L``'s units) from the first batch's solves ``X = K̂⁻¹ [r, Z]``
    and ``K_abs = K̂ |X[:, :c]|`` (``(n, c)``, taken in the solve's last product): with ``u`` the dtype's unit
    round-off, ``4 u |a|ᵀ K̂ |a|`` for the inverse quadratic (``a = X[:, 0]``) plus ``2 u mean_j |z_j|ᵀ K̂ |u_j|``
    over the probes there for the log-determinant, each the first-order effect of a relative perturbation ``u`` in
    every product's entries (``δ(aᵀK̂a)``, ``tr(K̂⁻¹ δK̂)``). About ``1e-16 n`` in float64 on a well-conditioned
    ``K̂``, and the larger part of the error in float32 on an ill-conditioned one."""
    if K_abs is None:
        return 0.0
    u = torch.finfo(X.dtype).eps / 2
    quad = abs(float(X[:, 0].abs() @ K_abs[:, 0]))  # |K̂| = K̂ for a non-negative kernel
    c = K_abs.shape[1]
    logdet = float((Z[:, : c - 1].abs() * K_abs[:, 1:]).sum(0).abs().mean()) if c > 1 else 0.0
    return ROUNDING_FACTOR * u * (quad + 0.5 * logdet)


def _mean_error(sol: Any, batch: int) -> torch.Tensor | None:
    """The working precision's floor ``(p,)`` in the mean's gradient ``-aᵀ∂m - ρᵀK̂⁻¹∂m`` (the entries of
    :func:`_mean_directions`; the directions' solves ``X_c = K̂⁻¹∂m_c`` in ``sol``'s columns after ``1 + batch``):
    ``4 u |X_c|ᵀ K̂ |a|``, the first-order effect of a relative rounding ``u`` in ``ρ = r - K̂a``, as
    :func:`_rounding` for the loss. ``None`` without directions or the solve's ``K̂ |a|``. Negligible in float64;
    in float32 on an ill-conditioned ``K̂`` the solves stall at this floor and the mean's gradient, which has no
    probe term, was 10-30 % off with a standard error of 0."""
    X = sol.x[:, 1 + batch :]
    if X.shape[1] == 0 or sol.abs_products is None:
        return None
    return ROUNDING_FACTOR * (torch.finfo(X.dtype).eps / 2) * (X.abs().mT @ sol.abs_products[:, 0])


def hyperparameter_summary(kernel: gpytorch.kernels.Kernel, noise: torch.Tensor) -> str:
    """``lengthscale=[...], outputscale=..., noise=...`` of ``kernel`` and the ``noise`` variances, for error
    messages."""
    parts = []
    for name, module in (("lengthscale", getattr(kernel, "base_kernel", kernel)), ("outputscale", kernel)):
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}={[float(f'{v:.4g}') for v in value.detach().reshape(-1)[:8].tolist()]}")
    parts.append(f"noise={[float(f'{v:.4g}') for v in noise.detach().reshape(-1)[:8].tolist()]}")
    return ", ".join(parts)


@dataclass
class EstimatorState:
    """What one evaluation of :func:`log_prob` reads; it writes nothing back (its result is an :class:`Evaluation`).

    Attributes:
        model: the module whose parameters get gradients (their Jacobian rows give the gradient's standard errors).
        preconditioner: ``P`` of ``K + mu I``; s2: the outputscale, 0-dim (``P̂ = s² P``).
        noise: the training noise variances, 0-dim or ``(n,)`` (``λ_min`` of the variational bound).
        settings: the accuracy knobs (:class:`~gpnys.gp.settings.EstimatorSettings`).
        warm_start: ``K̂⁻¹ r`` of a previous evaluation, ``(n,)``, or ``None``.
        variance_reduction: subtract the preconditioner's control variate (Wenger et al. 2022, eq. 9).
        control_variate_terms: ``(Z, schur=None, split=False) -> (log det P̂, [z_jᵀ P̂⁻¹ z_j]_j) | None`` with
            autograd (:meth:`~gpnys.gp.hook.PreconditionerHook.control_variate_terms`).
        frozen_jacobian_terms: ``Z -> [(tensor, per-probe rows)] | None``, AFN's frozen family in closed form.
        describe: the current hyperparameters in words, for error messages.
        path_reason: why the preconditioned path runs (copied into the :class:`Estimate`).
    """

    model: torch.nn.Module
    preconditioner: Preconditioner
    s2: torch.Tensor
    noise: torch.Tensor
    settings: EstimatorSettings
    warm_start: torch.Tensor | None = None
    variance_reduction: bool = False
    control_variate_terms: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    frozen_jacobian_terms: Callable[[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]] | None] | None = None
    describe: Callable[[], str] = lambda: ""
    path_reason: str = ""


@dataclass
class Evaluation:
    """The result of :func:`log_prob`: ``log_prob`` (0-dim, the estimate of ``log p(y)``, with the estimator's
    gradient), its
    :class:`Estimate`, ``warm_start`` (``K̂⁻¹ r``, ``(n,)``, the next evaluation's start) and the counts of
    preconditioner ``applications`` and probe ``samples`` it used."""

    log_prob: torch.Tensor
    estimate: Estimate
    warm_start: torch.Tensor
    applications: int
    samples: int


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter of ``model`` that requires a gradient: the names of
    :attr:`Estimate.grad_std_error`."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class _RepGradient(torch.autograd.Function):
    """``θ -> 0`` whose gradient with respect to ``op.representation()`` is given: the surrogate that carries the
    estimator's gradient. Its terms ``Σ_c l_cᵀ ∂K̂ r_c`` are sums of the per-column derivatives the error bars need
    anyway (:func:`_column_rep_grads`), so no kernel pass is spent on them again (a whole pass over ``K``;
    docs/accuracy.md)."""

    @staticmethod
    def forward(ctx, grads, like, *reps):  # type: ignore[override]
        ctx.grads = grads
        return like.new_zeros(())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (None, None, *[None if g is None else grad * g for g in ctx.grads])


def _column_rep_grads(op: LinearOperator, U: torch.Tensor, V: torch.Tensor) -> list[torch.Tensor | None]:
    """Per column ``j``, ``op._bilinear_derivative(u_j, v_j)`` stacked: one entry ``(t, *shape)`` per tensor of
    ``op.representation()`` (``None`` where it has none)."""
    if isinstance(op, AddedDiagLinearOperator):
        return [*_column_rep_grads(op._linear_op, U, V), *_column_rep_grads(op._diag_tensor, U, V)]
    if hasattr(op, "column_derivatives"):
        return list(op.column_derivatives(U, V))
    per = [op._bilinear_derivative(U[:, j : j + 1], V[:, j : j + 1]) for j in range(U.shape[1])]
    return [None if per[0][i] is None else torch.stack([p[i] for p in per]) for i in range(len(per[0]))]


def _jacobian(outputs: list[torch.Tensor], grads: list[torch.Tensor], params: list[torch.Tensor],
              t: int, chunk: int = 16) -> torch.Tensor:
    """Rows ``j``: ``Σ_o grads[o][j] · ∂outputs[o]/∂params``, flattened over the parameters: ``(t, p)``.

    With fewer parameter entries ``p`` than rows, by reverse-over-reverse: ``g(u) = Σ_j u_j rows_j`` is one
    backward pass with ``create_graph``, linear in ``u``, and column ``c`` of the result is ``∂g_c/∂u`` — ``p + 1``
    passes instead of ``t`` (the AFN / Nyström control variate's rows cost a backward through the ``n x k`` build
    each, a large share of an evaluation). Otherwise (or where an op has no double backward) one backward pass per
    row: on CPU a plain loop (faster there than torch's vmap-batched passes), elsewhere batches of ``chunk`` rows
    (a batch holds ``chunk`` copies of the graph's buffers); see docs/accuracy.md."""
    width = sum(p.numel() for p in params)
    if not outputs:
        return params[0].new_zeros(t, width) if params else torch.zeros(t, 0)
    if width + 1 < t:
        try:
            return _jacobian_by_columns(outputs, grads, params, t)
        except (RuntimeError, NotImplementedError):
            pass  # no double backward somewhere in the graph: by rows
    out = []
    for a in range(0, t, chunk):
        gs = [g[a : a + chunk] for g in grads]
        m = gs[0].shape[0]
        rows = None
        if gs[0].device.type != "cpu":  # batched (vmap) passes: fewer launches on an accelerator
            try:
                rows = torch.autograd.grad(outputs, params, grad_outputs=gs, retain_graph=True, allow_unused=True,
                                           is_grads_batched=True)
            except (RuntimeError, NotImplementedError):  # an op without a batching rule
                rows = None
        if rows is None:  # one row at a time: on CPU faster than vmap (docs/accuracy.md)
            per = [torch.autograd.grad(outputs, params, grad_outputs=[g[j] for g in gs], retain_graph=True,
                                       allow_unused=True) for j in range(m)]
            rows = tuple(None if per[0][i] is None else torch.stack([r[i] for r in per])
                         for i in range(len(params)))
        out.append(_flatten(rows, params, m))
    return torch.cat(out)


def _jacobian_by_columns(outputs: list[torch.Tensor], grads: list[torch.Tensor], params: list[torch.Tensor],
                         t: int) -> torch.Tensor:
    """:func:`_jacobian` a column at a time (reverse-over-reverse, its docstring). ``g`` is taken at ``u = 1``:
    being linear, ``g(1)`` is the sum of the rows, which checks the columns (a custom backward that cuts the graph
    to ``u`` would drop terms silently); a mismatch raises ``RuntimeError``."""
    g0 = grads[0]
    u = torch.ones(t, dtype=g0.dtype, device=g0.device, requires_grad=True)
    weighted = [torch.tensordot(u.to(g.dtype), g, dims=1) for g in grads]  # Σ_j u_j grads[o][j]
    g = torch.autograd.grad(outputs, params, grad_outputs=weighted, retain_graph=True, create_graph=True,
                            allow_unused=True)
    flat = _flatten(g, params)
    zero = torch.zeros(t, dtype=flat.dtype, device=flat.device)
    cols = []
    for c in range(flat.numel()):
        col = None
        if flat[c].requires_grad:
            (col,) = torch.autograd.grad(flat[c], u, retain_graph=True, allow_unused=True)
        cols.append(zero if col is None else col.to(flat.dtype))
    J = torch.stack(cols, 1).detach()
    total = flat.detach()
    rtol = max(1e-6, 1e3 * torch.finfo(total.dtype).eps)  # rounding of a t-term sum
    if not torch.allclose(J.sum(0), total, rtol=rtol, atol=rtol * float(total.abs().max())):
        raise RuntimeError("reverse-over-reverse Jacobian does not sum to the gradient")
    return J


def _flatten(grads: tuple[torch.Tensor | None, ...], params: list[torch.Tensor],
             rows: int | None = None) -> torch.Tensor:
    """Gradients per parameter (``None``: unused, zero) as one vector, or ``(rows, p)`` for batched ones."""
    lead = () if rows is None else (rows,)
    return torch.cat([p.new_zeros(*lead, p.numel()) if g is None else g.reshape(*lead, -1)
                      for g, p in zip(grads, params)], dim=-1)


def _split(vec: torch.Tensor, params: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, p in params:
        out[name] = vec[at : at + p.numel()].reshape(p.shape).detach()
        at += p.numel()
    return out


def log_prob(state: EstimatorState, mvn: gpytorch.distributions.MultivariateNormal,
             value: torch.Tensor) -> Evaluation:
    """``log p(value)`` under the training marginal ``mvn`` (``(n,)`` mean, ``K̂``), preconditioned by
    ``state.preconditioner`` and estimated as in the module docstring. Returns an :class:`Evaluation` whose
    ``log_prob`` (0-dim) has the estimate as its value and the (control-variate) estimator's gradient."""
    settings = state.settings
    cov = mvn.lazy_covariance_matrix.evaluate_kernel()
    n = cov.shape[-1]
    P, s2 = state.preconditioner, state.s2
    counts = {"applications": 0, "samples": 0}

    def M(R: torch.Tensor) -> torch.Tensor:
        counts["applications"] += 1
        return P.solve(R) / s2

    def K_inv(R: torch.Tensor) -> torch.Tensor:
        """The stand-in for ``K̂⁻¹R`` in the solves' error estimates (:meth:`Preconditioner.inverse_estimate`):
        ``M(R)`` but for a preconditioner scaled away from ``K̂`` (the RAN-scaled Nyström) or built for the mean of
        per-point noise."""
        counts["applications"] += 1
        return P.inverse_estimate(R, min_shift) / s2

    def A(V: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return cov._matmul(V)

    mean = mvn.mean
    r = (value - mean).detach()
    if not bool(torch.isfinite(r).all()):  # the targets are checked finite: the mean is not
        raise NonFiniteError(f"the prior mean m(X) holds NaN or inf (the mean module's parameters), at "
                             f"{state.describe()}")
    lam_min = float(state.noise.detach().min())
    # the smallest per-point shift, for a preconditioner built for their mean (Preconditioner.inverse_estimate)
    min_shift = lam_min / float(s2) if state.noise.dim() == 1 else None
    maxiter = settings.max_cg_iterations
    target = settings.target_rel_error
    # the gradient's terms only where autograd will ask for them
    params = trainable_parameters(state.model) if torch.is_grad_enabled() else []
    tensors = [p for _, p in params]
    # the mean's gradient -aᵀ∂m is first order in the solve's error and has no probe term: its directions ∂m/∂θ
    # ride in the first batch, and -aᵀ∂m - ρᵀK̂⁻¹∂m is second order (docs/accuracy.md); a mean with many parameters
    # rides without them and keeps the tighter solve
    directions = _mean_directions(mean, tensors)
    D, d_index = directions if directions is not None else (r.new_zeros(n, 0), None)
    # the inverse quadratic's column rides along with the first probes (same kernel passes), at a tighter
    # tolerance: its gradient -a^T dK a is first order in the solve's error (at cg_tolerance it would be biased)
    loose = directions is not None and settings.probe_seed is None
    share = Y_TOLERANCE_SHARE if loose else Y_TOLERANCE_SHARE_TIGHT
    tol_r = share * settings.cg_tolerance if target is None else min(target, share * settings.cg_tolerance)
    mean_correction = mean_error = curvature = None
    solve_rows: list[torch.Tensor | None] | None = None  # δaᵀ∂K̂a per representation tensor
    probe_solve_rows: list[torch.Tensor | None] | None = None  # mean_j (P̂⁻¹ρ_j)ᵀ∂K̂b_j, the probes' solves' share
    rounding_rows: list[torch.Tensor | None] | None = None  # (P̂⁻¹e_k)ᵀ∂K̂a per sign draw k (below ROUNDING_EPS)
    solve_dirs = rounding_dirs = None  # P̂⁻¹ρ (n, 1) and P̂⁻¹e_k (n, ROUNDING_SIGNS): a's first-order errors
    bound = 0.0
    iterations = 0
    a = inv_quad = None
    logdet_p = float(P.logdet() + n * torch.log(s2))

    reps = list(cov.representation())
    generator = None
    if settings.probe_seed is not None:
        generator = torch.Generator(device=r.device).manual_seed(int(settings.probe_seed))
    ell, lerr, jac, cv = [], [], [], []
    ritz_max = 0.0  # the largest (log θ - c)² of a Ritz value θ of the probes' tridiagonals (ritz_log_square)
    alpha_rows: list[torch.Tensor | None] = []
    probe_sums: list[torch.Tensor | None] = []
    cv_logdet = None
    probe_tol, floor = settings.cg_tolerance, settings.lanczos_steps
    batch = settings.num_probes
    batches = 0
    unreachable = None  # the part of the loss's error bar more probes cannot shrink, where it exceeds the target
    stalled = (0, 0, 0.0)  # columns cut at max_cg_iterations unconverged, columns, their worst relative residual
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=NumericalWarning)  # CG's own warnings: the error bars say it
        while True:
            Z = s2.sqrt() * P.sample(batch, generator=generator, distribution=settings.probes)
            counts["samples"] += batch
            first = a is None
            rhs = torch.cat([r[:, None], Z, D], 1) if first else Z
            tols = torch.full((rhs.shape[1],), probe_tol, dtype=torch.float64)
            if first:
                tols[0] = tol_r
                tols[1 + batch :] = tol_r  # the mean's directions: their error meets the solve with r's
            # the floor lifts only in the first batch, and only once the solve with r has converged too: the probes'
            # solves then run as long as it (no pass of their own) instead of stopping at cg_tolerance, where their
            # bias in the gradient would show against the error bars; later batches (target_rel_error) keep the
            # floor
            quad = (None if settings.lanczos_share is None or not first
                    else _quadrature_test(n, settings.lanczos_share, tol_r, batch))
            x0 = None
            warm = state.warm_start
            if first and settings.warm_start and warm is not None and warm.shape == r.shape:
                # the solve with r starts from the previous evaluation's K̂⁻¹ r (a training step moves K̂ a little);
                # the probes start at 0, as their Lanczos quadrature needs
                x0 = torch.zeros_like(rhs)
                x0[:, 0] = warm.to(rhs)
            # the solves with r and the mean's directions (no quadrature of their own) take a Galerkin step over the
            # probes' search directions once the probes have stopped: it shortens the tighter solve's tail
            # (docs/accuracy.md)
            project = estimate = None
            if first:
                project = torch.ones(rhs.shape[1], dtype=torch.bool, device=rhs.device)
                project[1 : 1 + batch] = False
                # the first probes' solve errors K̂⁻¹ρ_j, for the size of their bias (below), from the same projection
                estimate = torch.zeros_like(project)
                estimate[1 : 1 + min(batch, PROBE_SOLVE_PROBES)] = True
            try:
                sol = pcg(A, rhs, M, tol=tols, maxiter=maxiter, x0=x0, lanczos=True, miniter=floor, quadrature=quad,
                          abs_columns=1 + min(batch, ROUNDING_PROBES) if first else 0,  # for the rounding term
                          project=project, estimate=estimate)
            except NonFiniteError as err:
                raise NonFiniteError(f"{err}, at {state.describe()}") from err
            flat = sol.breakdown & (sol.iterations_per_column == 0) if sol.breakdown is not None else None
            if flat is not None and bool(flat.any()):
                # pᵀK̂p <= 0 (or rᵀP̂⁻¹r <= 0) at a first step: no quadrature, no solve; in float32 at a noise below
                # the rounding of K̂ the probes' log-determinant terms read inf and the loss NaN. linear_operator's
                # error, which BoTorch's fit_gpytorch_mll answers with a restart
                raise NotPSDError(f"gpnys: K̂ = K + noise is not numerically positive definite in "
                                  f"{str(r.dtype).removeprefix('torch.')}: CG found pᵀK̂p <= 0 at its first step on "
                                  f"{int(flat.sum())} of {rhs.shape[1]} columns, at {state.describe()} (a noise "
                                  "below the working precision's rounding of K̂); use float64 or a larger noise")
            iterations = max(iterations, sol.iterations)
            # (not ~converged: a column that met its tolerance but not the Lanczos floor reads unconverged)
            cut = (sol.iterations_per_column >= maxiter) & (sol.rel_residual > tols.to(sol.rel_residual))
            stalled = (stalled[0] + int(cut.sum()), stalled[1] + rhs.shape[1],
                       max([stalled[2]] + sol.rel_residual[cut].tolist()))
            if first:
                a, rho = sol.x[:, 0], sol.residual[:, 0]
                # a residual that drifted or a recursion that broke down (float32, P̂ near K̂); a solve that ran
                # out of iterations is not refined: its error bars say so, and rounds would repeat its cost
                spent = int(sol.iterations_per_column[0])
                if spent < maxiter and float(rho.norm()) > REFINE_ABOVE * tol_r * float(r.norm()):
                    a, rho, more = _refine(A, M, r, a, rho, tol_r, min(maxiter, 2 * spent + REFINE_PLAIN_STEPS))
                    sol.x[:, 0], iterations = a, iterations + more  # the derivative pass reads column 0
                    if sol.abs_products is not None:  # the rounding terms read K̂|a| of the refined a
                        sol.abs_products[:, 0] = A(a.abs()[:, None])[:, 0]
                inv_quad = float(r @ a + a @ rho)  # 2 r^T a - a^T K a: error in [0, ||rho||^2 / lam_min]
                bound = float(rho @ rho) / lam_min
                rounding = _rounding(sol.x, Z, sol.abs_products)
                # ρᵀK̂⁻¹∂m by the directions' solves: the mean's gradient to second order in the two solves' errors
                mean_correction = sol.x[:, 1 + batch :].mT @ rho
                mean_error = _mean_error(sol, batch)
                # what the correction leaves, ρᵀK̂⁻¹ρ_c (ρ_c: the direction's own residual), at most
                # ‖ρ‖ ‖ρ_c‖ / λ_min: a mean's gradient off by 1e-9 per point in float64 claimed 1e-14 without it
                left = float(rho.norm()) * sol.residual[:, 1 + batch :].norm(dim=0) / lam_min
                mean_error = left if mean_error is None else (mean_error.square() + left.square()).sqrt()
                curvature = (D * sol.x[:, 1 + batch :]).sum(0)  # ∂m_cᵀ K̂⁻¹ ∂m_c
            cols = slice(1, 1 + batch) if first else slice(None)
            diag, off = sol.tridiagonal
            l_j, e_j, ritz = slq_quadrature((diag[:, cols], off[:, cols]), sol.iterations_per_column[cols], n)
            # centred on the mean log eigenvalue tr(log M) / n: the floor must not move with P̂'s scale
            ritz_max = max(ritz_max, ritz_log_square(ritz, float(l_j.mean()) / n))
            U = sol.x[:, cols]
            B = M(Z)
            J = None
            if tensors:
                # a^T dK a rides along as column 0 of the first batch's per-probe pass (no pass of its own), and so
                # does δaᵀ∂K̂a with δa ≈ P̂⁻¹ρ, the first-order error of -½aᵀ∂K̂a that the solve with r leaves
                # (K̂⁻¹ρ, magnified by λ_min⁻¹): float32 gradients at a noise of 1e-4 were 5-19 standard errors off
                # without it, and float64 ones 30-55 where a preconditioner near K̂ leaves the probes little spread
                # (docs/accuracy.md)
                lefts, rights = ([sol.x[:, : 1 + batch]], [a[:, None], B]) if first else ([U], [B])
                # the products' rounding e ~ u K̂|a| moves a as a residual of that size would: where it is below
                # ROUNDING_SHARE of the residual ρ, whose share rides along anyway, it is left out (no extra columns)
                signs = (ROUNDING_SIGNS if first and sol.abs_products is not None
                         and torch.finfo(r.dtype).eps > ROUNDING_EPS
                         and torch.finfo(r.dtype).eps / 2 * float(sol.abs_products[:, 0].norm())
                         > ROUNDING_SHARE * float(rho.norm()) else 0)
                if first:
                    solve_dirs = K_inv(rho[:, None])
                    lefts.append(solve_dirs)
                    rights.append(a[:, None])
                if signs:
                    # the kernel products' rounding: the computed K̂a is off by e ~ u K̂|a| (independent signs, the
                    # probabilistic model of rounding), which moves a by K̂⁻¹e ≈ P̂⁻¹e whatever the residual says;
                    # where K̂|a| >> |r| (float32 at a small noise) no solve gets below it, and float32 noise
                    # gradients were 25 standard errors off without it (docs/accuracy.md)
                    e = (torch.finfo(r.dtype).eps / 2) * sol.abs_products[:, :1] * draw(
                        (n, signs), r.dtype, r.device, generator=_sign_generator(settings.probe_seed, r.device),
                        distribution="rademacher")
                    rounding_dirs = K_inv(e)
                    lefts.append(rounding_dirs)
                    rights.append(a[:, None].expand(-1, signs))
                shared = min(batch, PROBE_SOLVE_PROBES) if first else 0
                if shared:
                    # the probes' own solves: u_j's error K̂⁻¹ρ_j biases ½ u_jᵀ∂K̂b_j at first order; with a
                    # preconditioner near K̂ the probes barely vary and that bias can exceed their spread. Its mean
                    # over the first few probes sizes it (a bias, the same in every probe). K̂⁻¹ρ_j is CG's Galerkin
                    # estimate over every probe's search directions (within 3 % of the truth at cg_tolerance), else
                    # (directions over the memory budget) P̂⁻¹ρ_j, which a low-rank Nyström P̂ puts orders of
                    # magnitude off either way (a noise gradient's bias 1e4 read as -500; docs/accuracy.md)
                    probe_errors = sol.error_estimate
                    if probe_errors is None:
                        probe_errors = K_inv(sol.residual[:, 1 : 1 + shared])
                    lefts.append(probe_errors)
                    rights.append(B[:, :shared])
                kernel_rows = _column_rep_grads(cov, torch.cat(lefts, 1), torch.cat(rights, 1))
                if shared:
                    probe_solve_rows = [None if g is None else g[-shared:].mean(0) for g in kernel_rows]
                    kernel_rows = [None if g is None else g[:-shared] for g in kernel_rows]
                if signs:
                    rounding_rows = [None if g is None else g[-signs:] for g in kernel_rows]
                    kernel_rows = [None if g is None else g[:-signs] for g in kernel_rows]
                if first:
                    solve_rows = [None if g is None else g[-1] for g in kernel_rows]
                    alpha_rows = [None if g is None else g[0] for g in kernel_rows]
                    kernel_rows = [None if g is None else g[1:-1] for g in kernel_rows]
                sums = [None if g is None else g.sum(0) for g in kernel_rows]
                probe_sums = sums if first else [None if g is None else p + g for p, g in zip(probe_sums, sums)]
                outs = [(rep, g) for rep, g in zip(reps, kernel_rows)
                        if g is not None and isinstance(rep, torch.Tensor) and rep.requires_grad]
                J = _jacobian([o for o, _ in outs], [g for _, g in outs], tensors, batch)
            if state.variance_reduction and state.control_variate_terms is not None and tensors:
                inner = P.chosen
                afn = isinstance(inner, AFNPreconditioner)
                family = inner.control_family(settings.control_variate) if afn else None
                proxy = (afn and family != "frozen"
                         and (inner.n - inner.k) * inner.w**2 * inner.k * settings.num_probes > PROXY_ABOVE)
                # the per-probe rows then come from the frozen family's closed form (AFN splits only for a kernel of
                # the formula table, which has it), never through these terms: their rows may be split over the
                # ranks (their backward gathers; a per-probe backward through vmap could not)
                closed_rows = proxy or family == "frozen"
                terms = state.control_variate_terms(Z, split=closed_rows)
                if terms is not None:
                    cv_logdet = terms[0] if cv_logdet is None else cv_logdet
                    cv.append(terms[1])
                    spread = terms[1]
                    frozen_terms = None
                    if closed_rows and state.frozen_jacobian_terms is not None:
                        # the frozen family's rows in closed form: no backward pass per probe (or per parameter)
                        frozen_terms = state.frozen_jacobian_terms(Z)
                    if frozen_terms is not None:
                        outputs, rows = [o for o, _ in frozen_terms], [g for _, g in frozen_terms]
                    else:
                        # proxy: the per-probe Jacobian through AFN's "frozen" family (here by autograd, for a kernel
                        # outside the formula table): t backward passes through the "full" family's rebuilt FSAI
                        # rows would cost more than the rest of the evaluation. The families differ only in how much
                        # variance they remove, "frozen" the least, so the standard error is overstated, not
                        # understated (docs/accuracy.md, "Where the error bars come from")
                        if proxy:
                            frozen = state.control_variate_terms(Z, schur="frozen")
                            spread = spread if frozen is None else frozen[1]
                        outputs, rows = [spread], [torch.eye(batch, dtype=Z.dtype, device=Z.device)]
                    J = J + _jacobian(outputs, rows, tensors, batch)
            ell.append(l_j)
            lerr.append(e_j)
            if J is not None:
                jac.append(0.5 * J)
            batches += 1
            t = sum(x.shape[0] for x in ell)
            l_all = torch.cat(ell)
            spread = slq_variance(l_all, ritz_max)
            se_ld = math.sqrt(spread / t)
            lanczos = float(torch.cat(lerr).mean())
            se = math.sqrt((0.5 * se_ld) ** 2 + (0.5 * lanczos) ** 2 + (0.5 * bound) ** 2 + rounding**2)
            value_est = 0.5 * (inv_quad + logdet_p + float(l_all.mean()) + n * math.log(2 * math.pi))
            if not math.isfinite(value_est) or (J is not None and not bool(torch.isfinite(J).all())):
                raise NonFiniteError(f"the marginal likelihood's estimate or its gradient is NaN or inf, at "
                                     f"{state.describe()}")
            J_all = torch.cat(jac) if jac else None
            if target is None or t >= settings.max_probes:
                break
            grad = None
            if tensors:  # the estimate's gradient so far (the rows' mean may use a proxy control variate)
                surrogate = _surrogate(reps, a, mean, value, alpha_rows, probe_sums, t, cv_logdet, cv, tensors, d_index,
                                       mean_correction)
                g = torch.autograd.grad(surrogate, tensors, retain_graph=True, allow_unused=True)
                grad = _flatten(g, tensors)
            g_se = gradient_spread(J_all, l_all, ritz_max).sqrt() / math.sqrt(t) if J_all is not None else None
            # the solve's bound and the rounding do not shrink with more probes: past the target they stop the loop
            fixed = math.sqrt((0.5 * bound) ** 2 + rounding**2)
            if fixed >= target * abs(value_est):
                unreachable = fixed
                break
            need = _probes_needed(t, math.sqrt(max(se**2 - fixed**2, 0.0)), value_est, grad, g_se,
                                  math.sqrt(target**2 - (fixed / max(abs(value_est), 1e-300)) ** 2))
            if need <= t:
                break
            if 0.5 * lanczos > target * abs(value_est):  # the quadrature dominates: longer Lanczos runs
                probe_tol, floor = probe_tol / 10, 2 * floor
            batch = int(min(max(need - t, settings.num_probes), settings.max_probes - t))
    if stalled[0]:
        # the error bars size the solves' bias from P̂⁻¹ρ, a first-order stand-in for K̂⁻¹ρ that holds for a residual
        # near cg_tolerance; far above it (a weak preconditioner cut at the cap) it can be off by orders of magnitude
        # in either direction (a noise gradient 400 standard errors off after 2 iterations)
        warnings.warn(f"gpnys: CG stopped at max_cg_iterations={maxiter} before cg_tolerance on {stalled[0]} of "
                      f"{stalled[1]} columns (worst relative residual {stalled[2]:.2g}): the error bars do not bound "
                      "the solves' bias there; raise max_cg_iterations or use a stronger preconditioner",
                      NumericalWarning, stacklevel=3)
    if unreachable is not None:
        warnings.warn(f"gpnys: target_rel_error={target:g} is out of reach: the working precision's rounding and the "
                      f"solve's bound alone give {unreachable / n:.3g} per point, {unreachable / abs(value_est):.2g} "
                      f"of the loss, which more probes do not reduce (float64, or a better-conditioned K̂)",
                      NumericalWarning, stacklevel=3)
    t = sum(x.shape[0] for x in ell)
    grad_se = gradient_spread(J_all, l_all, ritz_max).sqrt() / math.sqrt(t) if J_all is not None and t > 1 else None
    def mapped(rows: list[torch.Tensor | None]) -> torch.Tensor:
        """Per-representation rows mapped to the parameters as the surrogate maps its terms."""
        return _flatten(torch.autograd.grad(_RepGradient.apply(rows, a, *reps), tensors, retain_graph=True,
                                            allow_unused=True), tensors)

    # the loose solve's share δaᵀ∂K̂a and the probes' solves' share ½ mean_j (P̂⁻¹ρ_j)ᵀ∂K̂b_j, added in quadrature
    for rows, weight in ((solve_rows, 1.0), (probe_solve_rows, 0.5)):
        if grad_se is not None and rows is not None:
            grad_se = (grad_se.square() + (weight * mapped(rows).to(grad_se)).square()).sqrt()
    if grad_se is not None and rounding_rows is not None:  # the products' rounding: the draws' root mean square
        draws = torch.stack([mapped([None if g is None else g[k] for g in rounding_rows])
                             for k in range(ROUNDING_SIGNS)])
        grad_se = (grad_se.square() + draws.to(grad_se).square().mean(0)).sqrt()
    if grad_se is not None and directions is None and solve_dirs is not None and mean.requires_grad:
        # a mean with more than MEAN_DIRECTIONS entries has no second-order correction: its gradient -aᵀ∂m is first
        # order in a's error, δaᵀ∂m with δa ≈ P̂⁻¹ρ (and P̂⁻¹e, the products' rounding): one vector-Jacobian product
        # each (a linear mean on 10 inputs was up to 6e-5 off with a standard error of 0)
        dirs = solve_dirs if rounding_dirs is None else torch.cat([solve_dirs, rounding_dirs], 1)
        shares = torch.stack([
            _flatten(torch.autograd.grad(mean, tensors, grad_outputs=v, retain_graph=True, allow_unused=True), tensors)
            for v in dirs.unbind(1)]).to(grad_se).square()
        rounded = shares[1:].mean(0) if shares.shape[0] > 1 else 0.0
        grad_se = (grad_se.square() + shares[0] + rounded).sqrt()
    grad_floor = grad_curvature = None
    if grad_se is not None and d_index is not None and d_index.numel():
        if mean_error is not None:
            # the mean's entries have no probe term: their error bar is the working precision's floor
            grad_floor = torch.zeros_like(grad_se)
            grad_floor[d_index] = mean_error.to(grad_se)
            grad_se = (grad_se.square() + grad_floor.square()).sqrt()
        if curvature is not None:
            grad_curvature = torch.zeros_like(grad_se)
            grad_curvature[d_index] = curvature.to(grad_se)
    estimate = Estimate(
        value=value_est, std_error=se, n=n, probes=t, batches=batches, cg_iterations=iterations,
        residual_bound=0.5 * bound, lanczos_error=0.5 * lanczos, rounding_error=rounding,
        path_reason=state.path_reason,
        grad_std_error=_split(grad_se, params) if grad_se is not None else {},
        grad_rounding_error=_split(grad_floor, params) if grad_floor is not None else {},
        mean_curvature=_split(grad_curvature, params) if grad_curvature is not None else {},
    )
    if not tensors:
        logp = torch.as_tensor(-value_est, dtype=r.dtype, device=r.device)
    else:
        surrogate = _surrogate(reps, a, mean, value, alpha_rows, probe_sums, t, cv_logdet, cv, tensors, d_index,
                               mean_correction)
        logp = -(value_est + surrogate - surrogate.detach())
    # a copy: a is a column of the whole solution block, which the kept warm start would otherwise hold
    return Evaluation(logp, estimate, a.detach().clone(), counts["applications"], counts["samples"])


def _surrogate(reps: list[Any], a: torch.Tensor, mean: torch.Tensor, value: torch.Tensor,
               alpha_rows: list[torch.Tensor | None], probe_sums: list[torch.Tensor | None], t: int,
               cv_logdet: torch.Tensor | None, cv: list[torch.Tensor], tensors: list[torch.Tensor],
               d_index: torch.Tensor | None, mean_correction: torch.Tensor | None) -> torch.Tensor:
    """A 0-dim tensor whose gradient is the estimator's ``∂L`` (module docstring) over the ``t`` probes so far:
    ``½ (-aᵀ∂K̂a + (1/t) Σ_j g_j)`` from the per-column derivatives (``alpha_rows``: ``aᵀ∂K̂a`` per representation
    tensor; ``probe_sums``: ``Σ_j (K̂⁻¹z_j)ᵀ ∂K̂ P̂⁻¹z_j``), the mean's term ``-aᵀ∂m`` with its second-order
    correction ``-ρᵀK̂⁻¹∂m`` (``mean_correction``, ``(p,)``, for the entries ``d_index`` of the flattened
    ``tensors``; ``None`` without directions) and the control variate."""
    grads = [None if g0 is None else (ps / t - g0) for g0, ps in zip(alpha_rows, probe_sums)]
    s = 0.5 * _RepGradient.apply(grads, a, *reps)
    s = s - (a * mean).sum() + (a * value).sum()
    if mean_correction is not None and d_index is not None and d_index.numel():
        s = s - (mean_correction * torch.cat([p.reshape(-1) for p in tensors])[d_index]).sum()
    if cv:
        s = s + 0.5 * (cv_logdet + torch.cat(cv).mean())
    return s


def _refine(A: Callable, M: Callable, r: torch.Tensor, a: torch.Tensor, rho: torch.Tensor, tol: float,
            maxiter: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Iterative refinement of ``K̂ a = r`` (``(n,)`` each; ``rho = r − K̂a``, the true residual): CG on ``rho``
    from 0, ``a += δ``, the residual recomputed, for at most :data:`REFINE_ROUNDS` rounds while it falls and stays
    above ``REFINE_ABOVE · tol``. Each round tries the preconditioner, then plain CG (:data:`REFINE_PLAIN_STEPS`
    steps): a drifted residual lies where the preconditioner is applied inaccurately, in float32 the directions of
    ``K̂``'s largest eigenvalues when ``P̂`` is near ``K̂``, which plain CG resolves first. Returns ``(a, rho,
    iterations spent)``."""
    spent = 0
    target = tol * float(r.norm())
    for _ in range(REFINE_ROUNDS):
        now = float(rho.norm())
        for precond, steps in ((M, maxiter), (None, REFINE_PLAIN_STEPS)):
            step = pcg(A, rho[:, None], precond, tol=max(target / max(now, 1e-300), 1e-300), maxiter=steps)
            spent += step.iterations
            a_new = a + step.x[:, 0]
            rho_new = r - A(a_new[:, None])[:, 0]
            if float(rho_new.norm()) < 0.5 * now:
                break
        if not float(rho_new.norm()) < now:
            break
        a, rho = a_new, rho_new
        if float(rho.norm()) <= REFINE_ABOVE * target:
            break
    return a, rho, spent


def _probes_needed(t: int, se: float, value: float, grad: torch.Tensor | None, g_se: torch.Tensor | None,
                   target: float) -> int:
    """Probes for the standard errors to reach ``target`` relative, from SE ∝ 1/√t: the loss's against ``|L|``,
    the gradient's (the norm of its components' SEs, the expected norm of its error) against ``||g||``."""
    ratio = se / max(target * abs(value), 1e-300)
    if grad is not None and g_se is not None and grad.numel():
        ratio = max(ratio, float(g_se.norm()) / max(target * float(grad.norm()), 1e-300))
    return t if ratio <= 1.0 else int(math.ceil(t * ratio**2 * 1.1))


def gradient_at_noise(model: torch.nn.Module, estimate: Estimate | None, level: float = NOISE_LEVEL,
                      bounds: dict[str, tuple[Any, Any]] | None = None) -> bool:
    """Whether the last gradient (the parameters' ``.grad``, of ``L / n`` as ``ExactMarginalLogLikelihood`` gives)
    is indistinguishable from zero at its error bars: ``Σ_p (g_p / SE_p)²`` over the ``m`` components is below the
    ``level`` quantile of what pure noise gives, a chi-square with ``m`` degrees of freedom (a test of ``g = 0`` at
    ``1 - level``; scipy's ``chi2.ppf``). A component without a probe term (the mean's: exact up to CG and the
    precision's floor, ``grad_rounding_error``) has no noise of its own to be at, and is not part of the test: it
    must have converged on its own, the gain it still offers, ``g² / (2 ∂mᵀK̂⁻¹∂m)`` (``mean_curvature``; the
    loss is quadratic there), below :data:`MEAN_GAIN_SHARE` of the loss's standard error
    (``|g| ≤ √(2 ∂mᵀK̂⁻¹∂m · MEAN_GAIN_SHARE · std_error)``, or its floor where larger). Without a curvature (a
    mean of more than ``MEAN_DIRECTIONS`` entries) it is measured against the smallest probe standard error of the
    others, in the test. (That yardstick alone is in other units: a constant mean 2.6 from its optimum, 19 nats of
    loss, passed as converged.) ``False`` without an estimate.

    Why a test and not the mean ``≤ 1``: at a point where the gradient *is* pure noise the mean of ``m`` squared
    standard normals exceeds 1 about 40 % of the time (``m = 7``), and with common random numbers the estimate
    barely changes between nearby iterates, so the mean could hover above 1 while L-BFGS-B spends its line
    searches on the estimator's own error (docs/accuracy.md, "Optimisers that stop at the noise").

    ``bounds``: ``{parameter name: (lower, upper)}`` (numbers or tensors, ``None`` for none) of a bounded optimiser
    (BoTorch's L-BFGS-B works on the constrained values themselves): a component at a bound whose gradient points
    out of the box has a zero projected gradient and is left out, as L-BFGS-B's own test leaves it (a BoTorch noise
    at its 1e-4 floor otherwise keeps the statistic in the hundreds while the optimiser cannot move it). All
    components held that way: ``True``.

    Example:
        Far from the optimum the gradient stands out of its noise:

        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> from gpnys.gp.estimator import gradient_at_noise
        >>> from gpnys.gp.hook import use_preconditioner
        >>> from gpnys.gp.settings import EstimatorSettings
        >>> X = torch.rand(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> model = ExactGPModel(X, torch.sin(6 * X[:, 0]), gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        >>> settings = EstimatorSettings(solver="iterative", probe_seed=0)
        >>> with use_preconditioner(model, "auto", settings=settings) as hook:
        ...     (-mll(model(X), model.train_targets)).backward()
        >>> gradient_at_noise(model, hook.last_estimate)
        False
    """
    if estimate is None or not estimate.grad_std_error:
        return False
    # the loss per point the gradient is of: a batch-mode model's elements each divide by their own n (its total
    # estimate adds them up)
    targets = getattr(model, "train_targets", None)
    n = targets.shape[-1] if isinstance(targets, torch.Tensor) and targets.dim() else estimate.n
    named = dict(model.named_parameters())
    pairs, held = [], 0
    for name, se in estimate.grad_std_error.items():
        p = named.get(name)
        if p is None or p.grad is None:
            continue
        g, se = p.grad.detach().reshape(-1), se.reshape(-1)
        rounding = estimate.grad_rounding_error.get(name)
        # the probes' part: 0 for a component without a probe term (its error bar is the precision's floor only)
        probe = se if rounding is None else (se.square() - rounding.reshape(-1).square()).clamp_min(0.0).sqrt()
        if bounds and name in bounds:
            free = _free_components(p.detach().reshape(-1), g, bounds[name])
            held += int((~free).sum())
        else:
            free = torch.ones_like(g, dtype=torch.bool)
        curvature = estimate.mean_curvature.get(name)
        if curvature is not None:  # the mean's entries: converged when the gain left is below MEAN_GAIN_SHARE of it
            worth = (2 * curvature.reshape(-1).to(se).clamp_min(0.0) * MEAN_GAIN_SHARE * estimate.std_error).sqrt()
            mean_entry = (probe == 0) & (worth > 0)
            if bool((mean_entry & free & (g.to(se).abs() * n > torch.maximum(se, worth))).any()):
                return False
            held += int((mean_entry & free).sum())  # converged: out of the test, as a component at its bound
            free = free & ~mean_entry
        pairs.append((g[free], se[free], probe[free]))
    positive = [probe[probe > 0] for _, _, probe in pairs]
    if sum(g.numel() for g, _, _ in pairs) == 0:
        return held > 0
    if sum(p.numel() for p in positive) == 0:
        return False
    floor = float(torch.cat(positive).min())
    stat = torch.cat([(g.to(se.dtype) * n / se.clamp_min(floor)).square() for g, se, _ in pairs])
    from scipy.stats import chi2  # here, not at import: scipy.stats costs about a second to import

    return bool(float(stat.sum()) <= float(chi2.ppf(level, stat.numel())))


def _free_components(value: torch.Tensor, grad: torch.Tensor, bound: tuple[Any, Any]) -> torch.Tensor:
    """Mask of the components not held at a bound by a gradient pointing outwards (value within 1e-6 relative)."""
    free = torch.ones_like(value, dtype=torch.bool)
    for b, outward in zip(bound, (grad > 0, grad < 0)):  # held at the lower bound when -g points below it: g > 0
        if b is None:
            continue
        b = torch.as_tensor(b, dtype=value.dtype, device=value.device).reshape(-1)
        if not bool(torch.isfinite(b).any()):
            continue
        at = (value - b).abs() <= 1e-6 * b.abs().clamp_min(1e-12)
        free &= ~(at & outward)
    return free
