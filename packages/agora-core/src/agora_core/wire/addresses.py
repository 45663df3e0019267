"""Peer addresses as the RPC layer and its security name them."""

from __future__ import annotations


def normalize_address(address: str) -> str:
    """``host:port`` or ``tcp://host:port``; port ``0`` or ``*`` means any free port on bind."""
    if "://" not in address:
        address = f"tcp://{address}"
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    return address
