"""The hang watchdog: heartbeats (heartbeat.py), the pure verdict (verdict.py), the thread (watchdog.py), the
flight recorder's environment and words (flight_recorder.py), and SoloDDP's side of it (session.py)."""

from lightning_solo.ddp.watchdog.flight_recorder import decide_flight_recorder
from lightning_solo.ddp.watchdog.heartbeat import Heartbeat, HeartbeatWriter
from lightning_solo.ddp.watchdog.session import WatchdogSession
from lightning_solo.ddp.watchdog.verdict import RankView, Verdict, judge
from lightning_solo.ddp.watchdog.watchdog import HANG_EXIT_CODE, Watchdog, WatchdogSettings, next_store_prefix

__all__ = ["HANG_EXIT_CODE", "Heartbeat", "HeartbeatWriter", "RankView", "Verdict", "Watchdog",
           "WatchdogSession", "WatchdogSettings", "decide_flight_recorder", "judge", "next_store_prefix"]  # fmt: skip
