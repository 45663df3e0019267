"""AsyncSPARTA weight averaging over a fault-tolerant butterfly all-reduce."""

from agora_worker.averaging.averager import Averager, RoundReport
from agora_worker.averaging.segments import FlatParameters, SegmentLayout

__all__ = ["Averager", "FlatParameters", "RoundReport", "SegmentLayout"]
