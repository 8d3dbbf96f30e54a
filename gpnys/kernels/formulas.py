"""The one table of stationary kernel formulas that every compute backend reads.

Every kernel gpnys evaluates itself is a unit-variance function of the scaled distance
``r = |(x - x') / l|`` (GPyTorch's length-scale convention). The backends need two functions of ``r``:

* the kernel ``k(r)``;
* ``h(r) = k'(r) / r``, the factor of the length-scale derivative
  ``d k / d l_d = -h(r) (x_d - x'_d)^2 / l_d^3`` (:mod:`gpnys.kernels.operator`).

Matérn ``nu = p + 1/2`` (Rasmussen & Williams 2006, eq. 4.16) is ``k = P(a) e^{-a}`` with ``a = sqrt(2 nu) r`` and
a polynomial ``P`` of degree ``p``; then ``k'(r) = c (P'(a) - P(a)) e^{-a}`` and ``h = c^2 Q(a) e^{-a}`` with
``Q(a) = (P'(a) - P(a)) / a``, a polynomial for ``nu >= 3/2``; for ``nu = 1/2``, ``h = -e^{-r} / r`` is singular
at ``r = 0``, where it only ever multiplies ``(x_d - x'_d)^2 = 0`` and is taken as 0. RBF is
``k = exp(-r^2 / 2)``, ``h = -k``.

Backends use the table in their own form: :func:`k_and_h` for torch (and KeOps ``LazyTensor``) expressions, the
coefficients (:attr:`Formula.p`, :attr:`Formula.q`) as compile-time constants of the Triton kernels, and
:func:`unit_kernel` for the cutoff radius. The in-place CPU tile evaluator of :mod:`gpnys.kernels.tiles` is a
hand-fused form of the same formulas (tested against :func:`k_and_h`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Formula", "FORMULAS", "formula", "unit_kernel", "k_and_h", "k_of_r2", "k_of_r"]


@dataclass(frozen=True)
class Formula:
    """One row of the table.

    Attributes:
        nu: Matérn smoothness; ``None`` for RBF.
        c2: ``2 nu`` (exact; 1 for RBF, unused); ``c = sqrt(c2)`` scales ``a = c r``.
        p: coefficients ``P(a) = p[0] + p[1] a + ...`` (Matérn; RBF: ``()``).
        q: coefficients of ``Q(a)`` such that ``h = c^2 Q(a) e^{-a}`` (Matérn ``nu >= 3/2``); for ``nu = 1/2``,
            ``h = c^2 q[0] e^{-a} / a`` (:attr:`singular`).
        singular: ``h`` has a ``1 / a`` pole at ``r = 0`` (Matérn-1/2).
    """

    nu: float | None
    c2: float
    p: tuple[float, ...]
    q: tuple[float, ...]
    singular: bool

    @property
    def c(self) -> float:
        return math.sqrt(self.c2)

    @property
    def rbf(self) -> bool:
        return self.nu is None


def _matern(nu: float, p: tuple[float, ...]) -> Formula:
    """Row for ``k = P(a) e^{-a}``: ``Q = (P' - P) / a`` from the coefficients."""
    dp = tuple(i * p[i] for i in range(1, len(p))) + (0.0,)  # P' padded to deg P
    diff = tuple(a - b for a, b in zip(dp, p))  # P' - P
    singular = diff[0] != 0.0
    q = diff[:1] if singular else diff[1:]
    return Formula(nu=nu, c2=2.0 * nu, p=p, q=q, singular=singular)


#: Matérn ``nu`` (``None`` = RBF) -> formula; the Matérn polynomials are R&W eq. 4.17 in ``a = sqrt(2 nu) r``
FORMULAS: dict[float | None, Formula] = {
    None: Formula(nu=None, c2=1.0, p=(), q=(), singular=False),
    0.5: _matern(0.5, (1.0,)),
    1.5: _matern(1.5, (1.0, 1.0)),
    2.5: _matern(2.5, (1.0, 1.0, 1.0 / 3.0)),
}


def formula(nu: float | None) -> Formula:
    """The row for Matérn ``nu`` (``None``: RBF); ``ValueError`` for any other smoothness."""
    try:
        return FORMULAS[None if nu is None else float(nu)]
    except KeyError:
        raise ValueError(f"nu must be one of 0.5, 1.5, 2.5 (or None for RBF), got {nu!r}") from None


def _horner(coefs: tuple[float, ...], a: Any) -> Any:
    out = coefs[-1]
    for c in reversed(coefs[:-1]):
        out = out * a + c
    return out


def unit_kernel(r: float, nu: float | None) -> float:
    """``k(r)`` for a Python float ``r >= 0`` (the cutoff radius' bisection)."""
    f = formula(nu)
    if f.rbf:
        return math.exp(-0.5 * r * r)
    a = f.c * r
    return _horner(f.p, a) * math.exp(-a)


def k_and_h(r2: Any, nu: float | None, tiny: float = 1e-30) -> tuple[Any, Any]:
    """``(k, h)`` from squared distances ``r2`` for any array type with ``exp``/``sqrt`` methods (torch tensors,
    KeOps ``LazyTensor``). Matérn-1/2's pole is regularised as ``1 / (a + tiny)`` (it multiplies 0 there)."""
    f = formula(nu)
    if f.rbf:
        k = (-0.5 * r2).exp()
        return k, -k
    a = f.c * r2.sqrt()
    e = (-a).exp()
    k = _horner(f.p, a) * e if len(f.p) > 1 else e
    c2 = f.c2
    if f.singular:
        return k, (c2 * f.q[0]) * e / (a + tiny)
    return k, c2 * (_horner(f.q, a) * e if len(f.q) > 1 else f.q[0] * e)


def k_of_r2(r2: Any, nu: float | None) -> Any:
    """``k`` alone from squared distances ``r2`` (torch tensors): :func:`k_and_h` without the derivative factor."""
    return (-0.5 * r2).exp() if formula(nu).rbf else k_of_r(r2.sqrt(), nu)


def k_of_r(r: Any, nu: float | None) -> Any:
    """``k`` from distances ``r`` (torch tensors): differentiable at ``r = 0`` where ``r`` is (``torch.cdist``'s
    is), unlike a square root of ``r2``."""
    f = formula(nu)
    if f.rbf:
        return (-0.5 * r * r).exp()
    a = f.c * r
    return _horner(f.p, a) * (-a).exp() if len(f.p) > 1 else (-a).exp()
