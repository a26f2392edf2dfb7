"""Where a library setting lives in the runner's config: the one map from what the diagnostics name to the keys.
See docs/diagnostics.md."""

from __future__ import annotations

import json
import re
from typing import Any

#: ``Owner.argument`` → the runner's config key, where the owner's arguments do not map one group each.
CONFIG_KEYS = {
    "DataLoader.num_workers": "data.num_workers",
    "DataLoader.batch_size": "data.batch_size",
    "DataLoader.pin_memory": "data.pin_memory",
    "DataLoader.prefetch_factor": "data.prefetch_factor",
    "SoloDDP.precision": "parallelism.precision",  # the runner routes it to the strategy
    "SoloFSDP.precision": "parallelism.precision",
}

#: Owners whose every argument is one config node (``Owner.argument`` → ``<node>.argument``).
CONFIG_NODES = {
    "SoloDDP": "parallelism.strategy",
    "SoloFSDP": "parallelism.strategy",
    "Trainer": "trainer",
    "WarmupScaledLR": "callbacks.warmup_scaled_lr",
    "LossWatch": "callbacks.loss_watch",
    "TrainingDoctor": "callbacks.doctor",
    "Preflight": "callbacks.preflight",
    "ResourceMonitor": "callbacks.resource_monitor",
    "AutoBatchSize": "auto_batch_size",
}

_CALL = re.compile(r"\b(?P<owner>[A-Z]\w*)\((?P<argument>[a-z_]\w*)=(?P<value>[^()]*?)\)")


def config_key(setting: str | None) -> str | None:
    """The runner's config key for a library ``setting`` (``"Owner.argument"``); None where the runner has none."""
    if not setting:
        return None
    if setting in CONFIG_KEYS:
        return CONFIG_KEYS[setting]
    owner, _, argument = setting.partition(".")
    node = CONFIG_NODES.get(owner)
    return f"{node}.{argument}" if node and argument else None


def config_value(value: Any) -> str:
    """``value`` as a Hydra override writes it: ``true``, ``null``, ``4``, ``post_local_sgd``, ``[1,2]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, separators=(",", ":"))


def config_override(setting: str | None, value: Any) -> str | None:
    """The command-line override that applies ``setting=value`` in the runner (None where the runner has no key)."""
    key = config_key(setting)
    return f"{key}={config_value(value)}" if key else None


def with_config_keys(text: str) -> str:
    """``text`` with the runner's override appended for every library setting it names as a call
    (``DataLoader(num_workers=3)`` → ``[runner: data.num_workers=3]``); a placeholder value (``...``) gives the key."""
    found: list[str] = []
    for match in _CALL.finditer(text):
        key = config_key(f"{match['owner']}.{match['argument']}")
        if key is None:
            continue
        raw = match["value"].strip()
        override = key if raw in ("", "...") else f"{key}={_literal(raw)}"
        if override not in found:
            found.append(override)
    return f"{text} [runner: {', '.join(found)}]" if found else text


def remedy_rows(remedies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The doctor's remedies (``setting``, ``value``, ``action``, ``gain``) with the runner's override added."""
    return [{**r, "override": config_override(r.get("setting"), r.get("value"))} for r in remedies]


def _literal(raw: str) -> str:
    """A value as the diagnostics print it (Python's repr) as the runner's override spells it."""
    if len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return {"True": "true", "False": "false", "None": "null"}.get(raw, raw)
