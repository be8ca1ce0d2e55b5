"""worldstream's wire: the protocol (``ipc.protocol``), the SDK (``ipc.client``, ``ipc.aio_client``) and the planes."""
