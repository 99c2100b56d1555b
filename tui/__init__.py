"""The volunteer's app (Textual): ``volunteer-app`` in a terminal, ``volunteer-app web`` in a browser.

A client of the local agent service only: it talks to the agent over its control API
(:mod:`volunteer_app.control_client`) and reads the coordinator's public leaderboard; it imports neither
``workers`` nor ``coordinator``. Build it with ``tui.app.VolunteerApp(...)``; nothing is created when
this package is imported.
"""
