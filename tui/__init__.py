"""The volunteer's terminal UI (Textual). It talks to the training worker only through the agent
supervisor in ``volunteer_app``; it never imports ``workers`` or ``coordinator``."""
