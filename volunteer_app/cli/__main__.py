"""``python -m volunteer_app.cli``: the ``volunteer-app`` command."""

import sys

from volunteer_app.cli import main

sys.exit(main())
