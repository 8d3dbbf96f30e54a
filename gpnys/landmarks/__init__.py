"""Landmark selection for every Nyström-type method: which points, and how many.

==============================  ==========================================================================
module                          holds
==============================  ==========================================================================
:mod:`~.farthest`               :func:`fps`, farthest point sampling (AFN paper Algorithm 6), :class:`FPSResult`
:mod:`~.farthest_triton`        FPS's Triton kernel, all ``k`` steps in one program (CUDA)
:mod:`~.sampling`               :func:`uniform`, ``k`` distinct indices with a seeded generator
:mod:`~.clustering`             :func:`kmeans`, k-means++ and Lloyd (clustered Nyström), :class:`KMeansResult`
:mod:`~.leverage`               :func:`ridge_leverage_scores` and sampling by them
:mod:`~.rules`                  :func:`select` (:data:`METHODS`), :func:`select_landmarks` (:data:`RULES`),
                                :func:`choose_m` (``m = auto``)
:mod:`~.rank`                   :func:`estimate_rank`, the numerical rank of ``K`` (AFN paper Algorithm 4)
:mod:`~.distances`              :func:`fill_distance` and the blocked distance passes
==============================  ==========================================================================

All rules are seeded, device-agnostic and work in float32 and float64; distances run in row blocks, so temporary
memory stays bounded independent of ``n``.
"""

from gpnys.landmarks.clustering import KMeansResult, kmeans
from gpnys.landmarks.distances import fill_distance
from gpnys.landmarks.farthest import FPSResult, fps
from gpnys.landmarks.leverage import ridge_leverage_scores
from gpnys.landmarks.rank import RankEstimate, estimate_rank
from gpnys.landmarks.rules import METHODS, RULES, choose_m, select, select_landmarks
from gpnys.landmarks.sampling import uniform

__all__ = [
    "FPSResult",
    "KMeansResult",
    "METHODS",
    "RULES",
    "RankEstimate",
    "choose_m",
    "estimate_rank",
    "fill_distance",
    "fps",
    "kmeans",
    "ridge_leverage_scores",
    "select",
    "select_landmarks",
    "uniform",
]
