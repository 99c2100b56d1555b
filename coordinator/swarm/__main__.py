"""``python -m coordinator.swarm --data-dir DIR --run NAME``: one run's swarm peer
(:mod:`coordinator.swarm.peer`), as ``volunteer-coordinator serve`` starts it
(:mod:`coordinator.swarm.manager`)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # before hivemind is imported
    from coordinator.swarm.peer import main

    sys.exit(main())
