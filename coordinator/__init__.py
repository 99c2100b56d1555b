"""volunteer-coordinator: the organizers' server. It admits volunteers with signed expiring tokens,
hands out work, keeps the contribution ledger and checkpoints, runs each run's bootstrap swarm peer
and serves the dashboard. It is the authority and the bookkeeper, never a parameter server.

Where things are, by process and concern:

* the ``volunteer-coordinator`` command: :mod:`~coordinator.cli` (``checkpoints ...`` in
  :mod:`~coordinator.checkpoint_cli`);
* the web process (``serve``): :mod:`coordinator.api` (routes, the app and its lifespan) and the static
  ``dashboard/``;
* what every process shares: :mod:`~coordinator.settings`, :mod:`~coordinator.errors`, the store
  (:mod:`~coordinator.models`, :mod:`~coordinator.store`, ``migrations/``) and
  :mod:`~coordinator.bootstrap`, which opens a data directory;
* runs and their peers: :mod:`~coordinator.runs` (the registry), :mod:`~coordinator.files` (the files a
  run's peers fetch), :mod:`~coordinator.sessions` (join, heartbeat, leave),
  :mod:`~coordinator.retention` (what is kept of ended sessions), :mod:`~coordinator.checkpoints` (the
  checkpoint files, torch-free);
* :mod:`coordinator.accounts`: tokens and credentials, volunteers, invite codes, organizer sign-in, rate
  limits;
* :mod:`coordinator.credit`: leases, the ledger, spot checks, flags;
* :mod:`coordinator.monitoring`: the live feed, time series, peers table, ``/metrics``;
* :mod:`coordinator.swarm`: each run's swarm peer process, the only one with torch, and the manager that
  starts it.
"""
