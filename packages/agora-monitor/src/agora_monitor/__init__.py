"""agora-monitor: watches a run from inside its DHT, keeps its history in a database, and
serves a live dashboard of it. No torch: a monitor runs on any small machine."""

__version__ = "0.1.0"
