"""A worker's side of admission: what it reports, how it computes the challenge, how it waits.

In an authorized run a worker does not choose its stage. ``agora-worker run`` binds its RPC
port, answers the authorizer's dial-back there (the compute challenge runs on the worker's own
device), sends its join request and learns its stage while still queued (:func:`admit`); it
then builds the :class:`~agora_worker.worker.Worker` for that stage on the same port, which
joins the DHT and downloads the stage's state while it waits, and announces itself only once
admitted. In an open run the stage is given and the admission is
:class:`~agora_core.admission.node_admission.OpenAdmission`: the same path, nothing to wait for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import torch

from agora_core.admission.join_client import JoinStatus
from agora_core.admission.join_request import HardwareReport
from agora_core.admission.node_admission import NodeAdmission, cpu_hardware
from agora_core.config import NodeSettings
from agora_core.node.role import RoleNode


def device_matmul(device: torch.device) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The compute challenge's product on ``device``, in float32 (exact: the challenge's
    matrices hold small integers, so every partial sum is an integer float32 holds)."""

    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            product = torch.from_numpy(a).to(device) @ torch.from_numpy(b).to(device)  # (n, n)
            return product.cpu().numpy()

    return matmul


def worker_hardware(device: torch.device) -> HardwareReport:
    """What a worker computing on ``device`` reports: the accelerator and its total memory
    (the host's memory on a CPU), the host's memory and CPU count."""
    host = cpu_hardware()
    if device.type != "cuda":
        return host
    properties = torch.cuda.get_device_properties(device)
    return HardwareReport(
        device="cuda",
        device_name=properties.name,
        device_memory_bytes=int(properties.total_memory),
        host_memory_bytes=host.host_memory_bytes,
        cpu_count=host.cpu_count,
    )


def worker_admission(
    member: RoleNode,
    settings: NodeSettings,
    device: torch.device,
    on_status: Callable[[JoinStatus], None] | None = None,
) -> NodeAdmission:
    """Give ``member`` the admission of a worker that will compute on ``device``."""
    return member.ask_authorizer(
        settings, worker_hardware(device), matmul=device_matmul(device), on_status=on_status
    )


async def admit(admission: NodeAdmission, stop: asyncio.Event) -> int | None:
    """Submit and wait until the authorizer names the stage; None when ``stop`` is set first.
    AdmissionRefused when refused (the port is then the caller's to close)."""
    await admission.submit()
    placing = asyncio.get_running_loop().create_task(admission.placed())
    stopping = asyncio.get_running_loop().create_task(stop.wait())
    try:
        await asyncio.wait({placing, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not placing.done():
            placing.cancel()
    if not placing.done() or placing.cancelled():
        return None
    stage = placing.result()
    if stage is None:
        raise ValueError("the authorizer admitted this worker without naming its stage")
    return stage
