"""What every role's process shares: its RunNode, its command-line options, the operator's
session, its database, and the process itself (heap, allocator, resident memory)."""
