"""Nyström-reduced GP posteriors and their exact error against the full GP; NYTRO; random Fourier features.

* :mod:`~gpnys.reduced.lla` — LLA (Nyström feature map + Bayesian linear regression; = SoR/DTC/SGPR),
  :mod:`~gpnys.reduced.ncr` — NCR (landmark-coefficient form; = LLA), :mod:`~gpnys.reduced.gsa` — GSA (the
  "naive" Gram substitution, two coefficient choices), :mod:`~gpnys.reduced.error` — the exact posterior and
  RKHS distances ([SPA] eq. (15), (19)), :mod:`~gpnys.reduced.nytro` — NYTRO and Nyström KRR,
  :mod:`~gpnys.reduced.rff` — random Fourier features, :mod:`~gpnys.reduced.models` — the functional
  constructor and the GPyTorch-compatible :class:`ReducedGP`, :mod:`~gpnys.reduced.nystrom_features` — the
  scikit-learn transformer :class:`NystromFeatures` (NSL kernel SVMs with any linear learner).

The landmark rules (uniform / FPS / k-means / ridge leverage) and ``m="auto"`` are
:func:`gpnys.landmarks.select_landmarks` and :func:`gpnys.landmarks.choose_m`.
"""

from gpnys.reduced.error import ExactPosterior, landmark_rkhs_error, rkhs_error
from gpnys.reduced.gsa import GSAPosterior
from gpnys.reduced.lla import LLAPosterior, NystromFeatureMap
from gpnys.reduced.models import METHODS, ReducedGP, reduced_posterior
from gpnys.reduced.ncr import NCRPosterior
from gpnys.reduced.nytro import nystrom_krr, nytro
from gpnys.reduced.rff import RandomFourierFeatures, RFFPosterior

__all__ = ["ExactPosterior", "rkhs_error", "landmark_rkhs_error", "GSAPosterior", "LLAPosterior", "NCRPosterior",
           "NystromFeatureMap", "NystromFeatures", "RFFPosterior", "RandomFourierFeatures", "ReducedGP",
           "reduced_posterior", "METHODS", "nytro", "nystrom_krr"]


def __getattr__(name: str):
    # NystromFeatures on first use (PEP 562): its module imports scikit-learn (~2 s), which the rest of the package
    # and every CLI subcommand do without
    if name == "NystromFeatures":
        from gpnys.reduced.nystrom_features import NystromFeatures

        return NystromFeatures
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "NystromFeatures"})
