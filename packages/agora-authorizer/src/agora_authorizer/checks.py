"""The admission checks that need no dial-back: hardware minimums, software, accounts.

Each returns a :class:`Refusal` with a sentence naming what was seen and what the run needs,
or None when the check passes. A threshold of 0 (or an empty list) switches its check off.
"""

from __future__ import annotations

from agora_core.admission import HardwareReport, JoinRequest, Refusal, RefusalReason
from agora_core.admission.software import parse_allowed
from agora_core.config import AdmissionConfig

GB = 1e9


def check_hardware(config: AdmissionConfig, role: str, hardware: HardwareReport) -> Refusal | None:
    """Workers only: a trainer streams data and needs no accelerator."""
    if role != "worker":
        return None
    if config.allowed_devices and not (
        hardware.device_name in config.allowed_devices or hardware.device in config.allowed_devices
    ):
        return Refusal(
            RefusalReason.DEVICE_NOT_ALLOWED,
            f"device {hardware.device_name or hardware.device!r} is not one of this run's "
            f"{', '.join(config.allowed_devices)}",
        )
    if hardware.device_memory_bytes < config.min_device_memory_gb * GB:
        return Refusal(
            RefusalReason.DEVICE_MEMORY,
            f"device memory {hardware.device_memory_bytes / GB:.1f} GB is below this run's "
            f"{config.min_device_memory_gb:g} GB",
        )
    if hardware.host_memory_bytes < config.min_host_memory_gb * GB:
        return Refusal(
            RefusalReason.HOST_MEMORY,
            f"host memory {hardware.host_memory_bytes / GB:.1f} GB is below this run's "
            f"{config.min_host_memory_gb:g} GB",
        )
    return None


class SoftwarePolicy:
    """The integrity check: every package a node reports must be on the allowed list (by
    version and source digest; a digest of ``*`` allows any source of that version). With an
    empty list the check is off."""

    def __init__(self, entries: list[str]):
        self.entries = list(entries)
        self.allowed = parse_allowed(self.entries)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed)

    def check(self, request: JoinRequest) -> Refusal | None:
        if not self.enabled:
            return None
        if not request.software:
            return Refusal(RefusalReason.SOFTWARE, "the request reports no software")
        for name, report in sorted(request.software.items()):
            allowed = self.allowed.get(name)
            if allowed is None:
                return Refusal(RefusalReason.SOFTWARE, f"package {name} is not part of this run's build")
            version, digest = report["version"], report["digest"]
            if (version, digest) not in allowed and (version, "*") not in allowed:
                versions = sorted({v for v, _ in allowed})
                if version not in versions:
                    why = f"version {version} is not allowed (this run allows {', '.join(versions)})"
                else:
                    why = f"its sources (digest {digest[:12]}...) differ from the released {version}"
                return Refusal(RefusalReason.SOFTWARE, f"{name}: {why}; install the run's release unmodified")
        return None
