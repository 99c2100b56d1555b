"""Each run's swarm peer (``python -m coordinator.swarm``): the coordinator's only process with torch and
hivemind.

* :mod:`~coordinator.swarm.peer`: the process. The run's bootstrap DHT peer; it reads the peers' signed
  progress records for the ledger, publishes revocations, and runs the parts below.
* :mod:`~coordinator.swarm.checkpointer`: downloads, evaluates and writes the swarm's state as checkpoints
  (the files' format and store are torch-free, in :mod:`coordinator.checkpoints`).
* :mod:`~coordinator.swarm.spotchecker`: recomputes sampled leases' losses (proof-of-training checks).
* :mod:`~coordinator.swarm.generate`: draws the gallery's captions for the web process.
* :mod:`~coordinator.swarm.manager`: the web process's side: starts, restarts and stops one peer per run.

Every module here imports torch and hivemind only inside the functions that use them, so that the web process
can import :mod:`~coordinator.swarm.manager` (``tests/test_import_hygiene.py`` checks it).
"""
