"""Conformance of every preconditioner with the interface of gpnys.precond.base and with dense references.

:class:`PreconditionerTestCase` holds the checks, in the manner of linear_operator's ``LinearOperatorTestCase``;
each preconditioner of :data:`~gpnys.precond.strategy.PRECONDITIONERS` (``"none"`` aside) is one small subclass
that names it and supplies its options (and what it should report: kind, rank, landmarks), ``"auto"`` twice, once
for each of its choices. A new preconditioner gets a subclass here before it is used anywhere.

Every check runs in float32 and float64, and, for the preconditioners that take per-point shifts
(:data:`~gpnys.precond.strategy.DIAG_PRECONDITIONERS`), with a scalar ``mu`` and with ``diag=`` shifts spanning two
decades. ``P`` is compared with its dense form ``dense_P(P)`` (``P`` applied to the identity, tests/helpers.py):

* the interface of :class:`~gpnys.precond.base.Preconditioner`: ``n``, ``rank``, ``kind``, ``chosen``,
  ``landmark_rows()``, ``summary()``, ``diag``, dtype / shape / device of every apply, wrong shapes refused;
* ``P`` is symmetric positive definite; ``P.solve(P.matmul(V)) = V`` and ``P.solve`` is the dense inverse;
* ``logdet()`` is ``slogdet`` of the dense ``P``;
* ``sample``: the factor ``F`` (``_sample(I)``, ``F F^T = P``) and the covariance of 20 000 public draws, projected
  on six directions, within 5 % (a tolerance a wrong scale or factor fails);
* the same seed gives the same bits (apply, solve, log-determinant, draws); for the seeded rules another seed
  another ``P``;
* at full size (every point a landmark, a full FSAI pattern) ``P`` is ``K + mu I`` or ``K + diag(mu_i)``, up to the
  constant factor of the RAN scaling;
* a ``ScaleKernel``'s outputscale is stripped (``P`` approximates the unit-variance system).
"""

from __future__ import annotations

import copy
import functools
import pickle

import gpytorch
import pytest
import torch
from helpers import dense_P, make_kernel, points

from gpnys.precond import Preconditioner
from gpnys.precond.strategy import (
    DIAG_PRECONDITIONERS,
    HOOK_DIAG_PRECONDITIONERS,
    PRECONDITIONERS,
    make_preconditioner,
)

N, D = 200, 2
MU = 1e-2
F64 = torch.float64
#: machine epsilon: the tolerances are multiples of it (times cond(P), or its square root, where rounding grows so)
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float64: torch.finfo(torch.float64).eps}


def pytest_generate_tests(metafunc):
    """``noise``: ``"scalar"``, and ``"per-point"`` for the preconditioners that take ``diag=``."""
    cls = metafunc.cls
    if cls is not None and issubclass(cls, PreconditionerTestCase) and "noise" in metafunc.fixturenames:
        metafunc.parametrize("noise", ["scalar", "per-point"] if cls.takes_diag() else ["scalar"])


@functools.lru_cache(maxsize=None)
def data(dtype: torch.dtype) -> torch.Tensor:
    """``(N, D)`` points in ``[0, 4]^2``."""
    return points(N, D, dtype=dtype, seed=0, scale=4.0)


@functools.lru_cache(maxsize=None)
def shifts(dtype: torch.dtype) -> torch.Tensor:
    """Per-point shifts ``MU * 10^u``, ``u`` uniform in ``[-1, 1]`` (two decades)."""
    u = torch.rand(N, generator=torch.Generator().manual_seed(5), dtype=F64) * 2.0 - 1.0
    return (MU * 10.0**u).to(dtype)


#: (class, dtype, noise) -> the preconditioner, built once for the checks that only read it
_BUILT: dict = {}


class PreconditionerTestCase:
    """The checks every preconditioner passes (module docstring). Subclasses set:

    * ``NAME``: the :func:`make_preconditioner` name; ``OPTIONS``: its keyword arguments; ``LENGTHSCALE``: the
      Matérn-3/2 kernel's;
    * ``KIND``: ``P.kind``; ``CHOSEN_KIND``: ``P.chosen.kind`` when ``P`` delegates (``auto``), else ``None``;
    * ``RANK``: the rank ``P`` reports (``None``: at most the requested ``OPTIONS["rank"]``);
    * ``LANDMARKS``: ``landmark_rows()`` gives ``rank`` rows (else ``None``);
    * ``SEEDED``: another seed gives another ``P``;
    * ``FULL``: options under which ``P`` is the system itself (``None``: no such size); ``SCALED``: up to a constant.
    """

    NAME = ""
    OPTIONS: dict = {}
    LENGTHSCALE = 1.0
    KIND = ""
    CHOSEN_KIND: str | None = None
    RANK: int | None = None
    LANDMARKS = False
    SEEDED = False
    FULL: dict | None = None
    SCALED = False

    @classmethod
    def takes_diag(cls) -> bool:
        return cls.NAME in DIAG_PRECONDITIONERS

    # -- building -----------------------------------------------------------------------------------------------
    def kernel(self, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
        return make_kernel("matern32", self.LENGTHSCALE, dtype)

    def build(self, dtype: torch.dtype, noise: str = "scalar", seed: int = 0, kernel=None, **options) -> Preconditioner:
        diag = shifts(dtype) if noise == "per-point" else None
        mu = MU if diag is None else float(diag.mean())  # (make_preconditioner: mu is then their mean)
        with torch.no_grad():
            return make_preconditioner(self.NAME, data(dtype), kernel or self.kernel(dtype), mu, seed=seed, diag=diag,
                                       **{**self.OPTIONS, **options})

    def built(self, dtype: torch.dtype, noise: str) -> Preconditioner:
        key = (type(self), dtype, noise)
        if key not in _BUILT:
            _BUILT[key] = self.build(dtype, noise)
        return _BUILT[key]

    def system(self, dtype: torch.dtype, noise: str) -> torch.Tensor:
        """``K + mu I`` or ``K + diag(mu_i)`` in float64 (from the inputs of ``dtype`` exactly)."""
        X = data(dtype).double()
        with torch.no_grad():
            K = make_kernel("matern32", self.LENGTHSCALE, F64)(X).to_dense()
        shift = shifts(dtype).double() if noise == "per-point" else torch.full((N,), MU, dtype=F64)
        return K + torch.diag(shift)

    @staticmethod
    def dense(P: Preconditioner) -> torch.Tensor:
        """``P`` as a float64 matrix (applied in its own dtype)."""
        return dense_P(P).double()

    def expected_rank(self, P: Preconditioner) -> int | None:
        """The rank ``P`` should report (``None``: between 1 and the requested ``OPTIONS["rank"]``)."""
        return self.RANK

    @staticmethod
    def cond(Pd: torch.Tensor) -> float:
        ev = torch.linalg.eigvalsh(0.5 * (Pd + Pd.mT))
        return float(ev.max() / ev.min())

    # -- the interface --------------------------------------------------------------------------------------
    def test_interface(self, dtype, noise):
        P = self.built(dtype, noise)
        assert isinstance(P, Preconditioner)
        assert P.n == N and P.dtype == dtype and P.device == data(dtype).device
        assert P.kind == self.KIND and isinstance(P.kind, str)
        chosen = P.chosen
        assert isinstance(chosen, Preconditioner) and chosen.chosen is chosen
        if self.CHOSEN_KIND is None:
            assert chosen is P
        else:
            assert chosen is not P and chosen.kind == self.CHOSEN_KIND
        assert isinstance(P.rank, int) and 0 <= P.rank <= N and P.rank == chosen.rank
        expected = self.expected_rank(P)
        if expected is not None:
            assert P.rank == expected
        else:
            assert 1 <= P.rank <= self.OPTIONS["rank"]
        rows = P.landmark_rows()
        if self.LANDMARKS:
            assert rows.dtype == torch.long and rows.shape == (P.rank,) and rows.unique().numel() == P.rank
            assert 0 <= int(rows.min()) and int(rows.max()) < N
        else:
            assert rows is None
        if chosen is not P:
            assert P.landmark_rows() is chosen.landmark_rows()
        s = P.summary()
        assert s["kind"] == P.kind and s["n"] == N and s["rank"] == P.rank and s["mu"] == P.mu
        if noise == "per-point":
            assert torch.equal(P.diag, shifts(dtype)) and P.mu == pytest.approx(float(shifts(dtype).mean()))
        else:
            assert P.diag is None and P.mu == MU
        v = torch.randn(N, dtype=dtype, generator=torch.Generator().manual_seed(1))
        V = torch.randn(N, 3, dtype=dtype, generator=torch.Generator().manual_seed(2))
        for out, shape in ((P.solve(v), (N,)), (P.matmul(v), (N,)), (P.solve(V), (N, 3)), (P.matmul(V), (N, 3)),
                           (P.sample(4, generator=torch.Generator().manual_seed(3)), (N, 4)), (P.logdet(), ())):
            assert out.shape == shape and out.dtype == dtype and out.device == P.device
        assert torch.equal(P.solve(v), P.solve(v[:, None])[:, 0])  # a vector is one column
        for bad in (torch.zeros(N - 1, dtype=dtype), torch.zeros(N + 1, 2, dtype=dtype)):
            with pytest.raises(ValueError, match="rows"):
                P.solve(bad)
            with pytest.raises(ValueError, match="rows"):
                P.matmul(bad)

    def test_per_point_shifts_taken_or_refused(self, dtype):
        """The names of :data:`DIAG_PRECONDITIONERS` take ``diag=``; the others refuse it (not ignore it)."""
        assert set(HOOK_DIAG_PRECONDITIONERS) <= set(DIAG_PRECONDITIONERS) <= set(PRECONDITIONERS)
        if self.takes_diag():
            assert self.built(dtype, "per-point").diag is not None
        else:
            with pytest.raises(ValueError, match="diag"):
                self.build(dtype, "per-point")

    # -- P against its dense form ---------------------------------------------------------------------------
    def test_dense_P_is_symmetric_positive_definite(self, dtype, noise):
        Pd = self.dense(self.built(dtype, noise))
        assert torch.isfinite(Pd).all()
        assert float((Pd - Pd.mT).abs().max()) <= 20 * EPS[dtype] * float(Pd.abs().max())
        assert float(torch.linalg.eigvalsh(0.5 * (Pd + Pd.mT)).min()) > 0

    def test_solve_inverts_matmul(self, dtype, noise):
        P = self.built(dtype, noise)
        Pd = self.dense(P)
        cond = self.cond(Pd)
        V = torch.randn(N, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
        back = P.solve(P.matmul(V.to(dtype))).double()
        tol = 2 * EPS[dtype] * cond  # (a backward-stable apply; up to ~0.6 eps cond seen)
        assert float((back - V).abs().max()) <= tol * float(V.abs().max()), "solve(matmul(V)) = V"
        forth = P.matmul(P.solve(V.to(dtype))).double()
        assert float((forth - V).abs().max()) <= tol * float(V.abs().max()), "matmul(solve(V)) = V"
        ref = torch.linalg.solve(Pd, V)
        assert float((P.solve(V.to(dtype)).double() - ref).norm() / ref.norm()) <= tol, "solve = dense P^{-1}"

    def test_logdet_is_slogdet_of_dense_P(self, dtype, noise):
        P = self.built(dtype, noise)
        Pd = self.dense(P)
        sign, ref = torch.linalg.slogdet(Pd)
        assert float(sign) == 1.0
        # relative errors ~eps in P's factors (and in dense_P) move log det by up to ~n eps sqrt(cond) (~0.1 of it seen)
        tol = N * EPS[dtype] * max(1.0, self.cond(Pd) ** 0.5)
        assert abs(float(P.logdet()) - float(ref)) <= tol * max(1.0, abs(float(ref)) / N)

    def test_sample_factor(self, dtype, noise):
        """``_sample(Z) = F Z`` with ``F F^T = P`` (base.py's contract): ``F`` is ``_sample`` of the identity."""
        P = self.built(dtype, noise)
        F = P._sample(torch.eye(N, dtype=dtype)).double()
        Pd = self.dense(P)
        assert float((F @ F.mT - Pd).norm() / Pd.norm()) <= 5 * EPS[dtype] * self.cond(Pd) ** 0.5

    def test_sample_covariance(self, dtype, noise):
        """``P.sample`` (pivoted Cholesky: its own ``L z1 + sqrt(mu) z2``) has covariance ``P``: 20 000 draws
        projected on six random directions ``B``, ``B^T S S^T B / m`` against ``B^T P B`` (expected error ~1.5 %)."""
        P = self.built(dtype, noise)
        m = 20000
        S = P.sample(m, generator=torch.Generator().manual_seed(6)).double()
        B = torch.randn(N, 6, dtype=F64, generator=torch.Generator().manual_seed(7))
        proj = B.mT @ S
        emp, ref = proj @ proj.mT / m, B.mT @ self.dense(P) @ B
        assert float((emp - ref).norm() / ref.norm()) < 0.05
        assert bool((proj.mean(1).abs() < 5 * (ref.diagonal() / m).sqrt()).all()), "zero mean"

    # -- seeds, sizes, scales -------------------------------------------------------------------------------
    def test_same_seed_gives_the_same_bits(self, dtype):
        V = torch.randn(N, 2, dtype=dtype, generator=torch.Generator().manual_seed(8))
        runs = []
        for seed in (0, 0, 1):
            P = self.build(dtype, seed=seed)
            runs.append((P.matmul(V), P.solve(V), P.logdet(), P.sample(3, generator=torch.Generator().manual_seed(9))))
        assert all(torch.equal(x, y) for x, y in zip(runs[0], runs[1]))
        if self.SEEDED:
            assert not torch.equal(runs[0][0], runs[2][0]), "another seed, another P"

    def test_copies_give_the_same_bits(self, dtype):
        """``copy.deepcopy`` and ``pickle`` (a model that holds ``P``: a fitted classifier, a BoTorch model): the copy
        applies, solves and has the log-determinant of ``P``, bit for bit; torch deep-copies no sparse CSR tensor,
        which AFN's and FSAI's factors are."""
        V = torch.randn(N, 2, dtype=dtype, generator=torch.Generator().manual_seed(8))
        P = self.build(dtype)
        for Q in (copy.deepcopy(P), pickle.loads(pickle.dumps(P))):
            assert Q is not P
            for a, b in ((P.matmul(V), Q.matmul(V)), (P.solve(V), Q.solve(V)), (P.logdet(), Q.logdet())):
                assert torch.equal(a, b)

    def test_full_size_is_the_system(self, dtype, noise):
        """Every point a landmark / a full pattern: ``P = K + mu I`` (``K + diag(mu_i)``); ``SCALED``: a positive
        multiple of it (the RAN scaling divides by ``lam_k + mu``)."""
        if self.FULL is None:
            pytest.skip("no size at which this preconditioner is the system itself")
        P = self.build(dtype, noise, **self.FULL)
        Pd, A = self.dense(P), self.system(dtype, noise)
        c = float(torch.trace(Pd) / torch.trace(A)) if self.SCALED else 1.0
        assert c > 0
        # float32: the kernel is evaluated in float32 (its entries to a few eps) and factored in it
        tol = 5 * EPS[dtype] * self.cond(A) ** 0.5 if dtype == F64 else 2e-5
        assert float((Pd - c * A).norm() / (c * A).norm()) <= tol

    def test_outputscale_is_stripped(self):
        """``make_preconditioner`` of ``ScaleKernel(k)`` (outputscale 3) is that of ``k``: ``mu = noise / s^2``."""
        base = self.kernel(F64)
        scaled = gpytorch.kernels.ScaleKernel(self.kernel(F64)).double()
        scaled.outputscale = 3.0
        P, Q = self.build(F64, kernel=base), self.build(F64, kernel=scaled)
        assert P.rank == Q.rank
        Pd, Qd = self.dense(P), self.dense(Q)
        assert float((Pd - Qd).norm() / Pd.norm()) <= 1e-12


# -- one subclass per preconditioner ---------------------------------------------------------------------------
class TestNystrom(PreconditionerTestCase):
    """Column Nyström, FPS landmarks, the stable form (eq. 8)."""

    NAME, KIND, OPTIONS, RANK = "nystrom", "nystrom", {"rank": 30}, 30
    LANDMARKS = True
    FULL = {"rank": N}


class TestRAN(PreconditionerTestCase):
    """The RAN baseline: uniform landmarks (seeded), RAN scaling."""

    NAME, KIND, OPTIONS, RANK = "ran", "nystrom", {"rank": 30}, 30
    LANDMARKS = SEEDED = SCALED = True
    FULL = {"rank": N}


class TestSketch(PreconditionerTestCase):
    """Gaussian-sketch randomized Nyström (seeded), RAN scaling; no landmark rows."""

    NAME, KIND, OPTIONS, RANK = "sketch", "nystrom", {"rank": 30}, 30
    SEEDED = SCALED = True
    FULL = {"rank": N}


class TestFSAI(PreconditionerTestCase):
    NAME, KIND, OPTIONS, RANK = "fsai", "fsai", {"w": 10}, 0
    FULL = {"w": N}


class TestAFN(PreconditionerTestCase):
    """FPS landmarks in two dimensions (the seed draws uniform ones only), FSAI of the Schur complement."""

    NAME, KIND, OPTIONS, RANK = "afn", "afn", {"k": 40, "w": 10}, 40
    LANDMARKS = True
    FULL = {"k": N, "w": 5}  # (k is capped at n - 1: a 1 x 1 Schur complement)


class TestPivotedCholesky(PreconditionerTestCase):
    """GPyTorch's pivoted Cholesky (it may stop before the rank asked for: ``RANK`` is ``None``)."""

    NAME, KIND, OPTIONS = "pivchol", "pivchol", {"rank": 20}


class TestAutoChoosingNystrom(PreconditionerTestCase):
    """A long length-scale: the estimated rank is below ``k``, so Algorithm 5 builds a Nyström preconditioner (which
    uses ``mu``, the shifts' mean, with per-point shifts)."""

    NAME, KIND, CHOSEN_KIND, OPTIONS, LENGTHSCALE = "auto", "auto", "nystrom", {"k": 80, "w": 10}, 10.0
    LANDMARKS = True

    def expected_rank(self, P):
        assert P.choice == "nystrom" and P.estimate.k < 80
        return P.estimate.k


class TestAutoChoosingAFN(PreconditionerTestCase):
    """A short length-scale: the estimated rank reaches ``k``, so Algorithm 5 builds AFN with ``k`` landmarks (and
    the per-point shifts)."""

    NAME, KIND, CHOSEN_KIND, OPTIONS, LENGTHSCALE = "auto", "auto", "afn", {"k": 40, "w": 10}, 0.3
    LANDMARKS = True

    def expected_rank(self, P):
        assert P.choice == "afn" and P.estimate.k >= 40
        if P.diag is not None:  # AFN is built on the per-point shifts
            assert torch.equal(P.chosen.diag, P.diag)
        return 40


def test_every_name_has_a_conformance_class():
    """Every name but ``"none"`` (plain CG) is checked above, and ``"auto"`` on both of its branches."""
    names = {cls.NAME for cls in PreconditionerTestCase.__subclasses__()}
    assert names == set(PRECONDITIONERS) - {"none"}
    assert {cls.CHOSEN_KIND for cls in PreconditionerTestCase.__subclasses__() if cls.NAME == "auto"} == {"nystrom",
                                                                                                       "afn"}
