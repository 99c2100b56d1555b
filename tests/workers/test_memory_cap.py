"""The worker's memory is capped by the operating system, not only by the estimate before joining."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import python_env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_an_allocation_past_the_cap_fails_instead_of_taking_the_computers_memory() -> None:
    """``cap_process_memory(256 MiB)`` sets the data limit to 256 MiB plus 2 GiB of headroom for thread
    stacks and allocator arenas; allocating 3 GiB then fails in the process (MemoryError), while the same
    allocation without the cap succeeds."""
    code = (
        "import resource, sys\n"
        "from workers.fitting import cap_process_memory\n"
        "if sys.argv[1] == 'capped': print(cap_process_memory(256 * 2**20))\n"
        "try:\n"
        "    block = bytearray(3 * 2**30)\n"
        "    print('allocated')\n"
        "except MemoryError:\n"
        "    print('refused')\n"
    )
    capped = subprocess.run([sys.executable, "-c", code, "capped"], env=python_env(), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert capped.stdout.split() == [str(256 * 2**20 + 2 * 2**30), "refused"], capped.stderr
    free = subprocess.run([sys.executable, "-c", code, "free"], env=python_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert free.stdout.split() == ["allocated"], free.stderr
