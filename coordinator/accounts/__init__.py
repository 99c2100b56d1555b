"""Who may call the coordinator, and how often.

* :mod:`~coordinator.accounts.authority`: the signing keys, the organizer token, volunteer credentials and
  peer tokens.
* :mod:`~coordinator.accounts.volunteers`: registering, listing, banning and unbanning volunteers.
* :mod:`~coordinator.accounts.invites`: invite codes of invite-only runs, and the bound on guessing them.
* :mod:`~coordinator.accounts.logins`: the organizers' dashboard sign-in (a cookie for the organizer token).
* :mod:`~coordinator.accounts.limits`: rate limits and guess budgets per caller.
"""
