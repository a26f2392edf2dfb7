"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

``solo_ddp.py`` holds the class and its wiring; its exact-resume hooks are ``resume_hooks.py`` and its
unused-parameter hooks ``unused_hooks.py``, one concern each. ``fsdp.py``: SoloFSDP, fully sharded (FSDP2).
"""

from lightning_solo.strategy.fsdp import SoloFSDP
from lightning_solo.strategy.solo_ddp import SoloDDP

__all__ = ["SoloDDP", "SoloFSDP"]
