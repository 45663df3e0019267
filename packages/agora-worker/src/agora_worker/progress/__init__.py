"""Stage progress: when the workers of a stage step together. The decision itself is a pure
function of what a worker knows (``decision``); the tracker learns it (``tracker``)."""
