"""The wire: a message's header and its tensor frames, their dtypes and per-chunk compression."""
