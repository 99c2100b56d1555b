"""The training worker: tasks, the hivemind authorizer and the collaborative training loop.

Importing this package is cheap and torch-free; torch and hivemind are imported by the modules that
need them (``workers.authorizer``, ``workers.trainer``, the task runtimes).
"""
