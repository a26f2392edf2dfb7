"""Random number generator states (torch, CUDA, NumPy, Python) in a form ``torch.load(weights_only=True)`` loads."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def numpy_state(generator: Any) -> dict[str, Any]:
    """A NumPy MT19937 state (``np.random`` itself, or a ``RandomState``) as tensors and plain numbers."""
    kind, keys, pos, has_gauss, gauss = generator.get_state()
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def set_numpy_state(generator: Any, saved: dict[str, Any]) -> None:
    """Put :func:`numpy_state`'s result back (also the older PowerSGD form, without ``kind``, with
    ``cached_gaussian``)."""
    gauss = saved["gauss"] if "gauss" in saved else saved["cached_gaussian"]
    keys = saved["keys"].numpy().astype("uint32")
    generator.set_state((saved.get("kind", "MT19937"), keys, saved["pos"], saved["has_gauss"], gauss))


def rng_state(cuda: bool = True) -> dict[str, Any]:
    """This process's torch, CUDA (this device's), numpy and Python RNG states."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if cuda and torch.cuda.is_initialized():  # only this rank's device: another layout has other indices
        device = torch.cuda.current_device()
        state["cuda"] = {"device": device, "state": torch.cuda.get_rng_state(device)}
    state["numpy"] = numpy_state(np.random)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put :func:`rng_state`'s result back."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"]["state"], torch.cuda.current_device())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        set_numpy_state(np.random, state["numpy"])
