"""BoTorch integration: :class:`PreconditionedSingleTaskGP` and its fantasy models, :class:`PreconditionedFantasyGP`.
Imported on demand — importing BoTorch raises GPyTorch's global ``max_cholesky_size`` to 4096, which
``import gpnys`` alone must not do."""

from gpnys.bo.model import PosteriorSolveError, PreconditionedFantasyGP, PreconditionedSingleTaskGP

__all__ = ["PreconditionedSingleTaskGP", "PreconditionedFantasyGP", "PosteriorSolveError"]
