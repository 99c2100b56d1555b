"""How work becomes credit (docs/credit-and-trust.md).

* :mod:`~coordinator.credit.work`: the run's shards and the leases that hand them out.
* :mod:`~coordinator.credit.ledger`: claims checked against what the swarm saw, the leaderboard.
* :mod:`~coordinator.credit.spotchecks`: sampling completed leases for a proof-of-training check, and
  judging it (the swarm peer recomputes: :mod:`coordinator.swarm.spotchecker`).
* :mod:`~coordinator.credit.flags`: every claim capped or refused, kept for the organizers.
"""
