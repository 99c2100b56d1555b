"""What the organizers and volunteers see of a run while it trains.

* :mod:`~coordinator.monitoring.live`: the websocket feed of a run's stats and leaderboard.
* :mod:`~coordinator.monitoring.series`: the time series the dashboard's charts draw, kept in the store.
* :mod:`~coordinator.monitoring.peers`: the organizers' peers table and a volunteer's history.
* :mod:`~coordinator.monitoring.metrics`: ``/metrics`` for Prometheus.
"""
