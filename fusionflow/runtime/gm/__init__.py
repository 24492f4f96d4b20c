"""Worker lending under a global manager (DDP: one GM per node, `global_manager=` of the loader):

  manager.py  GlobalManager: reads every local manager's progress row, orders loans (its own
              process: `python -m fusionflow.runtime.gm.manager`, or `python -m fusionflow gm ...`)
  tables.py   the job's shared-memory progress table and its rows
  link.py     GMLink: a local manager's seat at the table (join, publish, orders, peers' sockets)
  timing.py   the protocol's clocks, in one place
  agent.py    LendingAgent: a local manager's side of lending (lends idle workers, serves guests)

The rules themselves (who lends to whom) are pure, in fusionflow/scheduling/lending.py.
"""
