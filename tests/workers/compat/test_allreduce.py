"""The all-reduce's replacements (:mod:`workers.compat.allreduce`) and :func:`workers.compat.install`, which
applies every process-wide replacement of the package. The robust reducer's maths is ``tests/workers/test_robust.py``;
the defence with real peers, ``tests/security/test_poisoning.py``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

from tests.workers.compat.peers import run_peer_script
from workers.robust import ScreenReport


def test_the_refusal_warning_says_how_large_the_refused_changes_were(caplog: Any) -> None:
    """An organizer reading a worker's log can tell honest peers refused by a tight bound (changes just over
    it) from a hostile one (changes far over it)."""
    from workers import compat

    report = ScreenReport()
    report.refuse(1, change=3.0, size=2.0)
    report.refuse(1, change=11.0, size=2.0)
    with caplog.at_level(logging.WARNING, logger="workers.compat"):
        compat._note_screening(report, ["QmAlice", "QmBob"], "run_state_averager")
    said = caplog.records[-1].getMessage()
    assert "refused 2 outlandish part(s) from peer ...QmBob" in said
    assert "the largest change refused was 5.50 times its part's size" in said


_INSTALL_SCRIPT = r"""
import json, sys
import torch
from hivemind.averaging import allreduce, key_manager
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import serialize_torch_tensor
from workers import compat

def current():
    return {"reducer": allreduce.TensorPartReducer, "container": allreduce.TensorPartContainer,
            "runner": allreduce.AllReduceRunner.__init__, "deserialize": allreduce.deserialize_torch_tensor,
            "get_averagers": key_manager.GroupKeyManager.get_averagers,
            "declare": DecentralizedAverager._declare_for_download_periodically}

hivemind = current()
if sys.argv[1] == "undefended":  # what tests/security/undefended/sitecustomize.py does
    compat.install_robust_averaging = lambda: None
first_counter, second_counter = [], []
compat.install(add_received=first_counter.append)
first = current()
compat.install(query_interval=0.125, declare_interval=1.0, add_received=second_counter.append)
second = current()
allreduce.deserialize_torch_tensor(serialize_torch_tensor(torch.zeros(4)))  # a part of 4 float32: 16 bytes
print(json.dumps({
    "robust": [first["reducer"] is compat.RobustPartReducer, first["container"] is compat.RobustPartContainer,
               first["runner"] is not hivemind["runner"]],
    "paced": [first["get_averagers"] is not hivemind["get_averagers"],
              first["declare"] is not hivemind["declare"]],
    "installed_once": all(second[k] is first[k] for k in first if k != "deserialize"),
    "intervals": [key_manager.GroupKeyManager._va_query_interval, DecentralizedAverager._va_declare_interval],
    "counted": [first_counter, second_counter],
}), flush=True)
"""


@pytest.mark.parametrize("build", ["", "undefended"])
def test_install_applies_every_replacement_once_and_a_disabled_part_stays_off(build: str) -> None:
    """One call installs robust averaging, the matchmaking's pace and the byte counter; a second call changes
    only the settings it is given (the counter counts each part once, the pace is the new one) and wraps
    nothing twice. A build that turned robust averaging off (``tests/security/undefended``) keeps hivemind's
    plain all-reduce through ``install()`` too, and the rest of it."""
    outcome, log = run_peer_script(_INSTALL_SCRIPT, build, timeout=120)
    robust = build == ""
    assert outcome["robust"] == [robust, robust, robust], log[-3000:]
    assert outcome["paced"] == [True, True], log[-3000:]
    assert outcome["installed_once"], log[-3000:]
    assert outcome["intervals"] == [0.125, 1.0], log[-3000:]
    assert outcome["counted"] == [[], [16]], log[-3000:]


def test_a_name_replaced_on_the_package_is_replaced_where_it_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compat`` is one namespace, as when it was one module: a test build that replaces ``compat.robust_mean``
    (``tests/security/poisoner``: its reducers send back garbage) changes what this process's reducers send."""
    from workers import compat

    def garbage(parts: Any, shape: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full(tuple(shape), -1000.0)

    async def reduce() -> torch.Tensor:
        reducer = compat.RobustPartReducer([torch.Size([2])], num_senders=1)
        return await reducer.accumulate_part(0, 0, torch.ones(2))

    assert torch.equal(asyncio.run(reduce()), torch.ones(2))
    monkeypatch.setattr(compat, "robust_mean", garbage)
    assert torch.equal(asyncio.run(reduce()), torch.full((2,), -1000.0))
    assert compat.allreduce.robust_mean is garbage
    monkeypatch.undo()
    assert torch.equal(asyncio.run(reduce()), torch.ones(2)), "undone, the reducers average again"
