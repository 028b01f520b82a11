"""How KV bytes move between engines: shm, tcp (staged for device caches), CUDA IPC and NIXL
behind one transport interface, with the transfer state table and block layouts."""
