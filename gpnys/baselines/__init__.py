"""The references gpnys is compared against, above the training API (:mod:`gpnys.gp`).

* :mod:`~gpnys.baselines.exact` — :func:`cholesky_loss`, the exact ``-MLL / n`` by one Cholesky with a closed-form
  gradient;
* :mod:`~gpnys.baselines.mll` — :func:`evaluate`, one loss + gradient by Cholesky, GPyTorch's CG or any gpnys
  preconditioner (through :func:`gpnys.gp.hook.use_preconditioner`), and :func:`grad_errors`;
* :mod:`~gpnys.baselines.laplace` — :func:`dense_laplace`, the dense Laplace approximation for GP classification
  (R&W 2006, Algorithm 3.1);
* :mod:`~gpnys.baselines.higp_adapter` — :func:`evaluate_higp`, the same record from HiGP (imported only when called);
* :mod:`~gpnys.baselines.provenance` — :func:`provenance`, the command, date, commit, device and versions every
  benchmark's JSON carries.
"""

from gpnys.baselines.exact import cholesky_loss
from gpnys.baselines.higp_adapter import evaluate_higp
from gpnys.baselines.laplace import DenseLaplace, dense_laplace
from gpnys.baselines.mll import METHODS, evaluate, grad_errors
from gpnys.baselines.provenance import provenance

__all__ = ["METHODS", "DenseLaplace", "cholesky_loss", "dense_laplace", "evaluate", "evaluate_higp", "grad_errors",
           "provenance"]
