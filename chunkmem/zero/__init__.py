"""ZeRO data parallel: chunk groups sharded over a process group, the collectives, agreement between ranks."""
