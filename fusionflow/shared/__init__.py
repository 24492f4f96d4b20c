"""One loader, many jobs: a FusionFlowLoader's augmented batches shared by the training processes of
one node (a sweep, a seeds study), so each image is decoded and augmented once, not once per job.

  producer.py    SharedLoader: serves the loader's epochs; batches stay in its ring until released
  hub.py         the producer's clients: connections, slot holds, the thread that serves them
  client.py      SharedLoaderClient: a job's DataLoader-like end; copies out of the read-only ring
  rendezvous.py  how a client finds and trusts its producer; the messages they exchange

`python -m fusionflow serve` (a SharedLoader from a shell) is fusionflow/tools/serve.py: it builds the
loader, which this package never imports.
"""
