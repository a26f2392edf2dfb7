"""SoloDDP: Lightning's DDPStrategy with defaults that are right for 1..N devices.

``solo_ddp.py`` holds the class and its wiring; its exact-resume hooks are ``resume_hooks.py`` and its
unused-parameter hooks ``unused_hooks.py``, one concern each.
"""

from lightning_solo.strategy.solo_ddp import SoloDDP

__all__ = ["SoloDDP"]
