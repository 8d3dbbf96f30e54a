"""BoTorch integration: :class:`PreconditionedSingleTaskGP`. Imported on demand — importing BoTorch raises
GPyTorch's global ``max_cholesky_size`` to 4096, which ``import gpnys`` alone must not do."""

from gpnys.bo.model import PreconditionedSingleTaskGP

__all__ = ["PreconditionedSingleTaskGP"]
