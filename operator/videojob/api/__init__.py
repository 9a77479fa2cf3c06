"""The VideoJob API: typed spec and status, rules, and parsing."""

from .common import API_GROUP, API_VERSION, KIND, PLURAL
from .resource import API_VERSION_FULL, InvalidVideoJob, Problem, VideoJob, parse_spec, parse_videojob
from .rules import SPEC_RULES, spec_problems
from .spec import VideoJobSpec, parse_bytes
from .status import Condition, ConditionType, Phase, Reason, VideoJobStatus

__all__ = [
    "API_GROUP", "API_VERSION", "API_VERSION_FULL", "KIND", "PLURAL",
    "Condition", "ConditionType", "InvalidVideoJob", "Phase", "Problem", "Reason",
    "SPEC_RULES", "VideoJob", "VideoJobSpec", "VideoJobStatus",
    "parse_bytes", "parse_spec", "parse_videojob", "spec_problems",
]  # fmt: skip
