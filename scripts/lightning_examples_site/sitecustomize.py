"""Offline, downsized, comparable runs of Lightning's example scripts (``scripts/lightning_examples.py``).

Active only when ``LIGHTNING_EXAMPLES_ARM`` is set (``stock`` or ``solo``), in the example's process and in the
rank processes that Lightning's launcher starts from it. It then:

* seeds ``random``, numpy and torch with 0, so both arms start from the same state;
* replaces what would download with seeded synthetic data of the same kind: torchvision's ``MNIST``, ``CIFAR10``
  and ``ImageFolder`` (PIL images, so the examples' transforms run), ``download_and_extract_archive`` (a no-op),
  pretrained weights (``get_torchvision_model`` builds with ``weights=None``) and, when it is not installed, ``gym``
  (a small CartPole-shaped environment with the old 4-tuple ``step`` API the examples use);
* makes every ``Trainer`` a 2-process CPU run with ``DDPStrategy(**kw)`` (stock) or ``SoloDDP(**kw)`` (solo), ``kw``
  from ``LIGHTNING_EXAMPLES_STRATEGY`` (JSON, default none), with the overrides in ``LIGHTNING_EXAMPLES_TRAINER``
  (JSON) on top of what the example asked for;
* after each ``Trainer.fit``, saves the module's ``state_dict``, the float ``callback_metrics``, the strategy's class and world size to
  ``LIGHTNING_EXAMPLES_OUT`` (rank 0; other ranks add ``.rank<N>``; ``torch.save``; the last fit wins).
"""

import os

if os.environ.get("LIGHTNING_EXAMPLES_ARM") in ("stock", "solo"):
    import json
    import random
    import sys
    import types

    import numpy as np
    import torch
    from PIL import Image

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    def _image(index: int, size: tuple, mode: str) -> Image.Image:
        g = torch.Generator().manual_seed(index)
        channels = 3 if mode == "RGB" else 1
        pixels = torch.randint(0, 256, (size[1], size[0], channels), generator=g, dtype=torch.uint8)
        return Image.fromarray(pixels.squeeze(-1).numpy(), mode=mode)

    class _Images(torch.utils.data.Dataset):
        """Seeded synthetic images: ``(image, label)``, ``image`` a PIL image, or the transform's output."""

        size, mode, n_classes = (28, 28), "L", 10

        def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False, **_):
            self.train, self.transform = train, transform
            self.length = self.train_length if train else self.test_length

        def __len__(self):
            return self.length

        def __getitem__(self, index):
            img = _image(index + (0 if self.train else 10**6), self.size, self.mode)
            return (self.transform(img) if self.transform else img), index % self.n_classes

    class FakeMNIST(_Images):
        train_length, test_length = 60000, 10000

    class FakeCIFAR10(_Images):
        size, mode, train_length, test_length = (32, 32), "RGB", 50000, 10000

    class FakeImageFolder(_Images):
        """Two classes, eight 64x64 RGB images per folder."""

        size, mode, n_classes, train_length = (64, 64), "RGB", 2, 16

        def __init__(self, root, transform=None, **_):
            super().__init__(train=True, transform=transform)
            self.classes, self.targets = ["a", "b"], [i % 2 for i in range(self.length)]

    import torchvision.datasets
    import torchvision.datasets.utils

    torchvision.datasets.MNIST = FakeMNIST
    torchvision.datasets.CIFAR10 = FakeCIFAR10
    torchvision.datasets.ImageFolder = FakeImageFolder
    torchvision.datasets.utils.download_and_extract_archive = lambda *args, **kwargs: None

    from lightning.pytorch.utilities import model_helpers

    _get_model = model_helpers.get_torchvision_model
    model_helpers.get_torchvision_model = lambda name, *a, weights=None, **kw: _get_model(name, *a, **kw)

    try:
        import gym
    except ImportError:

        class Discrete:
            def __init__(self, n):
                self.n, self._rng = n, random.Random(0)

            def sample(self):
                return self._rng.randrange(self.n)

        class Box:
            def __init__(self, shape):
                self.shape = shape

        class CartPoleLike:
            """Four floats of state, two actions, reward 1 a step, done after 20 steps."""

            def __init__(self):
                self.observation_space, self.action_space = Box((4,)), Discrete(2)
                self._rng, self._t = np.random.RandomState(0), 0

            def reset(self):
                self._t = 0
                return self._rng.uniform(-0.05, 0.05, 4).astype(np.float32)

            def step(self, action):
                self._t += 1
                state = self._rng.uniform(-1, 1, 4).astype(np.float32) + float(action)
                return state, 1.0, self._t >= 20, {}

        gym = types.ModuleType("gym")
        gym.Env, gym.make = CartPoleLike, lambda name, **_: CartPoleLike()
        gym.spaces = types.ModuleType("gym.spaces")
        gym.spaces.box, gym.spaces.discrete = (
            types.ModuleType("gym.spaces.box"),
            types.ModuleType("gym.spaces.discrete"),
        )
        gym.spaces.box.Box, gym.spaces.discrete.Discrete = Box, Discrete
        for _mod in (gym, gym.spaces, gym.spaces.box, gym.spaces.discrete):
            sys.modules[_mod.__name__] = _mod

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_solo import SoloDDP

    _init, _fit = pl.Trainer.__init__, pl.Trainer.fit

    def _trainer_init(self, *args, **kwargs):
        kwargs.update(json.loads(os.environ.get("LIGHTNING_EXAMPLES_TRAINER", "{}")))
        solo = os.environ["LIGHTNING_EXAMPLES_ARM"] == "solo"
        strategy_kwargs = json.loads(os.environ.get("LIGHTNING_EXAMPLES_STRATEGY", "{}"))
        kwargs.update(accelerator="cpu", devices=2, strategy=(SoloDDP if solo else DDPStrategy)(**strategy_kwargs))
        _init(self, *args, **kwargs)

    def _trainer_fit(self, *args, **kwargs):
        out = _fit(self, *args, **kwargs)
        if os.environ.get("LIGHTNING_EXAMPLES_OUT"):
            metrics = {k: float(v) for k, v in self.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
            state = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
            decisions = {k: str(d.value) for k, d in getattr(self.strategy, "decisions", {}).items()}
            setup = {"strategy": type(self.strategy).__name__, "world_size": self.world_size, "decisions": decisions}
            out_file = os.environ["LIGHTNING_EXAMPLES_OUT"] + (
                "" if self.global_rank == 0 else f".rank{self.global_rank}"
            )
            torch.save({"state_dict": state, "metrics": metrics, **setup}, out_file)
        return out

    pl.Trainer.__init__, pl.Trainer.fit = _trainer_init, _trainer_fit
