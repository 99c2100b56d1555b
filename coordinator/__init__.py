"""volunteer-coordinator: the organizers' server. It admits volunteers with signed expiring tokens,
hands out work, keeps the contribution ledger and checkpoints, runs each run's bootstrap swarm peer
and serves the dashboard. It is the authority and the bookkeeper, never a parameter server.
"""
