"""Remote CPU workers on a Ray cluster (`remote_workers=fusionflow.RayWorkers(...)`), one worker kind
beside the local CPU workers and the accelerator. The training process never imports ray:

  config.py   RayWorkers, the public configuration; `connect`, run by the gateway only
  kind.py     RemoteWorkers, the worker kind on the loader's board (runtime/board.py WorkerKind), in the
              training process: feeds the gateway, completes what it returns, restarts it
  link.py     GatewayLink, the training process's handle on one gateway process (start, stop, its session)
  gateway.py  the gateway process, Ray's driver: actors, calls in flight, results into the ring
  actors.py   RemoteActors, the gateway's Ray actors: asked for, probed, replaced, killed
  task.py     RemoteTask, what runs inside an actor (a local worker's per-sample code)

Ray (and cloudpickle) are the `ray` extra.
"""
