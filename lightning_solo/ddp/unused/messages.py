"""What the unused-parameter policy tells the user: DDP's errors explained, and the reentrant-checkpoint Decision."""

from __future__ import annotations

from lightning_solo._compat import lightning as lightning_compat
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.advice import explain_reducer_error
from lightning_solo.ddp.unused.policy import Phase, UnusedParameters

REENTRANT_CHECKPOINT = Decision(
    "reentrant_checkpoint",
    "non-reentrant while DDP searches",
    "reentrant activation checkpointing fails DDP's unused-parameter search ('marked as ready twice'); while "
    "find_unused_parameters='auto' searches, those calls run torch's non-reentrant checkpointing (same values and "
    "gradients); find_unused_parameters=False: as stock",
)


def explain_exception(exception: BaseException, unused: UnusedParameters) -> None:
    """Add to an exception that ended the fit what ``unused`` was doing (in place of Lightning's rewrite)."""
    if unused.phase is not Phase.USER:
        explain_reducer_error(exception, unused)
        return
    lightning_compat.augment_message(
        exception,
        pattern=".*(Expected to have finished reduction in the prior iteration|not used in producing the loss).*",
        new_message=(
            "Some parameters of your LightningModule were not used in producing the loss. SoloDDP was given "
            f"find_unused_parameters={unused.setting!r}; leave it at 'auto' (the default) to detect and handle "
            "them, or set True."
        ),
    )
