"""Remote CPU workers on a Ray cluster (`remote_workers=fusionflow.RayWorkers(...)`), one worker kind
beside the local CPU workers and the accelerator:

  config.py   RayWorkers, the public configuration, and this process's connection to Ray
  kind.py     RemoteWorkers, the worker kind on the loader's board (runtime/board.py WorkerKind)
  actors.py   RemoteActors, the kind's Ray actors: asked for, probed, replaced, killed
  task.py     RemoteTask, what runs inside an actor (a local worker's per-sample code)

Ray is imported only when a RayWorkers is constructed (the `ray` extra).
"""
