"""Random number generator states, in a form that loads with ``torch.load(weights_only=True)``: this process's
torch, CUDA, NumPy and Python generators (what an exact resume restores), and the NumPy state codec that
PowerSGD's own generator uses too."""

from __future__ import annotations

import random
from typing import Any

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
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_state()}
    if cuda and torch.cuda.is_initialized():  # (is_available() can cost ~0.1 ms a call: not every step)
        # Only this rank's device: another layout (8 GPUs per process before, 4 now, or per-task binding)
        # has other device indices, but each rank still draws from the generator of its own device.
        device = torch.cuda.current_device()
        state["cuda"] = {"device": device, "state": torch.cuda.get_rng_state(device)}
    try:
        import numpy as np
    except ImportError:
        return state
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
        import numpy as np

        set_numpy_state(np.random, state["numpy"])


def _python_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]
