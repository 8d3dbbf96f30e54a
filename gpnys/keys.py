"""In-memory cache keys: tensors by their memory and version, objects by identity.

A key of ``data_ptr()`` and ``_version`` alone is fooled when a tensor is replaced, freed, and a new one allocated
at the same address: the new tensor's version is 0 again. :class:`TensorKey` holds the tensor, so its memory cannot
be handed to another tensor while the key lives, and an equal address then means the same memory.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["TensorKey", "same_objects"]


def same_objects(before: Sequence[object] | None, now: Sequence[object]) -> bool:
    """Whether two sequences hold the same objects (by identity, in order): say a model's modules at two times,
    where a replaced kernel module is a new object. ``False`` for ``before = None``.

    Example:
        >>> import torch
        >>> from gpnys.keys import same_objects
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> before = tuple(model.modules())
        >>> model[0] = torch.nn.Linear(2, 2)
        >>> same_objects(before, tuple(model.modules()))
        False
    """
    return before is not None and len(before) == len(now) and all(a is b for a, b in zip(before, now))


class TensorKey:
    """Equal to another key of a tensor with the same memory (address, shape, strides, dtype, device) at the same
    version: an in-place edit (``_version``) or a replacement (new memory) makes it unequal. Holds ``tensor``
    (``tensor.detach()``: no autograd graph is kept). Not hashable: keys are compared, not looked up.

    Example:
        >>> import torch
        >>> from gpnys.keys import TensorKey
        >>> y = torch.zeros(3)
        >>> key = TensorKey(y)
        >>> key == TensorKey(y.reshape(-1)), key == TensorKey(y.clone())  # a view of the same memory; a copy
        (True, False)
        >>> y += 1  # an in-place edit
        >>> key == TensorKey(y)
        False
    """

    __slots__ = ("tensor", "state")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.state = (tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.stride(), tensor.dtype,
                      tensor.device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorKey) and other.state == self.state

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorKey(shape={tuple(self.tensor.shape)}, version={self.state[1]})"
