"""Processes and IPC: the shm batch ring, the CPU worker loop, the local manager, the accelerator
worker, and the global manager with its tables and lending link."""
