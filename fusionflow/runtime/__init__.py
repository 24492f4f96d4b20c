"""Processes and IPC: the shm batch ring and its slots, the board every worker kind works through,
the CPU worker loop and pool, the per-sample body, the local manager (taking a RuntimeSpec), the
global manager with its tables and lending link, core claims, auth sockets, the machine (`Host`).
The accelerator worker kind is the GPU wing's (fusionflow/accel/)."""
