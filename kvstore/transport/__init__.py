"""Transports move block bytes between a client and a daemon's segment; one per placement
scheme: ``shm`` (same host, one memcpy through the daemon's shared memory) and ``tcp`` (the
daemon's framed data port). A new scheme (RDMA, NIXL) is a new module with the same two calls,
``read`` and ``write``; callers never change."""
