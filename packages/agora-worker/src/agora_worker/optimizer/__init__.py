"""The stage's optimizer: fp32 masters and AdamW state on the host, and the transfers of the
weights between host and device."""
