"""Every place where this project reaches into hivemind's internals, for one hivemind release.

hivemind's public API does not offer what a volunteer worker needs in several places, so this package
subclasses, patches or calls private parts of hivemind 1.1.12 (:data:`WRITTEN_FOR`). Importing it checks
the installed release (:mod:`workers.compat.version`): a different minor version is refused with a clear
error (the pin in ``pyproject.toml`` says the same), because a private attribute may have changed meaning
without changing name. Each module also checks that what it touches still exists, so a mismatch fails at
start-up, not mid-training.

Its modules mirror hivemind's own, so that a change upstream can be diffed against the code here:

| module | hivemind code it extends or replaces |
| --- | --- |
| :mod:`~workers.compat.version` | (the release check, and :func:`~workers.compat.version.require`) |
| :mod:`~workers.compat.progress` | ``optim/progress_tracker.py``: throttled progress records, the worker's readings |
| :mod:`~workers.compat.averager` | ``averaging/averager.py``: the averager process's request tasks |
| :mod:`~workers.compat.state_download` | ``averaging/averager.py``: ``load_state_from_peers``, checked and retried |
| :mod:`~workers.compat.state_averager` | ``optim/state_averager.py``: the guarded state averager, DiLoCo's |
| :mod:`~workers.compat.optimizer` | ``optim/optimizer.py``: the guarded optimizer, DiLoCo's |
| :mod:`~workers.compat.allreduce` | ``averaging/allreduce.py``, ``partition.py``: the robust reducer, byte counting |
| :mod:`~workers.compat.matchmaking` | ``averaging/key_manager.py``, ``averager.py``: the pace of DHT traffic |
| :mod:`~workers.compat.dht` | ``dht/node.py``, ``protocol.py``: the node's authorizer |
| :mod:`~workers.compat.p2p` | ``p2p/p2p_daemon.py``: circuit relays for volunteers nobody can dial |

Two styles, kept apart. Most of it subclasses hivemind through its own hooks (``Optimizer._make_state_averager``
builds our state averager) or changes one object (a tracker's reporter). Where hivemind has no hook, a
module-level name or a class attribute of hivemind is replaced for the whole process; :func:`install` applies
every such replacement (idempotent), before hivemind forks the averagers' processes, which inherit them.

Replaced for the whole process by :func:`install`:

| hivemind file:function | our replacement (module:name) | why | test |
| --- | --- | --- | --- |
| ``averaging/allreduce.py``: ``TensorPartReducer`` (the name ``AllReduceRunner`` builds its reducer from) | ``allreduce:RobustPartReducer`` (``accumulate_part`` copied from ``partition.py``, keeps each contribution) | every average is robust to a hostile group member: non-finite parts dropped, weights capped, CenteredClip (:mod:`workers.robust`) | ``tests/security/test_poisoning.py::test_honest_peers_keep_learning_while_one_peer_poisons_what_it_averages``; the maths: ``tests/workers/test_robust.py`` |
| ``averaging/allreduce.py``: ``TensorPartContainer`` | ``allreduce:RobustPartContainer`` | what other reducers send back is screened before it is used | as above; ``tests/workers/compat/test_allreduce.py::test_the_refusal_warning_says_how_large_the_refused_changes_were`` |
| ``averaging/allreduce.py``: ``AllReduceRunner.__init__`` (wrapped) | ``allreduce:install_robust_averaging`` | tells the reducer and container who this peer is, its partners' names and what they average | ``tests/workers/compat/test_allreduce.py::test_install_applies_every_replacement_once_and_a_disabled_part_stays_off`` |
| ``averaging/allreduce.py``: ``deserialize_torch_tensor`` (wrapped) | ``allreduce:count_received_bytes`` | the worker reports the bytes it receives in averaging rounds | ``tests/workers/compat/test_allreduce.py::test_install_applies_every_replacement_once_and_a_disabled_part_stays_off`` |
| ``averaging/key_manager.py``: ``GroupKeyManager.get_averagers`` (wrapped) | ``matchmaking:install_calm_matchmaking`` | an averager waiting for a partner read the group key in a loop (3,687 signed DHT reads in 4 s) | ``tests/workers/compat/test_matchmaking.py::test_an_averager_waiting_for_a_partner_reads_the_dht_twice_a_second_not_in_a_loop``, ``::test_two_peers_with_short_matchmaking_find_each_other_at_every_round`` |
| ``p2p/p2p_daemon.py``: ``P2P._make_process_args`` (wrapped) | ``p2p:install_static_relays`` | a daemon given trusted relays reserves on them at once (``-relayDiscovery=0``; with discovery it waited for four candidates or three minutes) | ``tests/net/test_reachability.py::test_two_volunteers_behind_nat_join_with_the_readme_line_and_average_together_through_the_relay`` |
| ``averaging/averager.py``: ``DecentralizedAverager._declare_for_download_periodically`` (re-written copy) | ``matchmaking:install_calm_matchmaking`` | a round marks the state changed once per tensor: dozens of signed DHT stores per round | ``tests/workers/compat/test_matchmaking.py::test_the_state_download_record_is_stored_at_most_every_declare_interval`` |

Extended through subclasses, or on one object (nothing else in the process changes):

| hivemind file:function | our replacement (module:name) | why | test |
| --- | --- | --- | --- |
| ``optim/progress_tracker.py``: ``ProgressTracker.should_report_progress``, ``report_local_progress`` (one tracker's) | ``progress:throttle_progress_reports`` | one signed DHT record per few seconds, not one per step; an epoch's first samples at once | ``tests/workers/compat/test_progress.py::test_a_peer_that_fills_an_epoch_between_two_throttled_reports_is_still_seen_by_the_swarm`` |
| ``optim/progress_tracker.py``: ``ProgressTracker.update_epoch`` (one tracker's, wrapped) | ``optimizer:GuardedOptimizer._size_epochs_as_they_begin`` | a run's early epochs have another size, set under the tracker's lock | ``tests/workers/compat/test_optimizer.py::test_a_runs_early_epochs_average_more_often_then_every_peer_switches_at_the_same_epoch`` |
| ``optim/optimizer.py``: ``Optimizer._make_state_averager`` (copy) | ``optimizer:GuardedOptimizer._make_state_averager`` | builds our state averager (guarded, or DiLoCo's) | every test in ``tests/workers/compat/test_optimizer.py`` |
| ``optim/optimizer.py``: ``Optimizer.__init__`` | ``optimizer:GuardedOptimizer.__init__`` | hivemind never pre-schedules a state-averaging round; epoch settings | ``tests/workers/compat/test_optimizer.py::test_state_averaging_rounds_are_prescheduled_so_that_their_results_arrive_soon_after_the_epoch_ends`` |
| ``optim/optimizer.py``: ``Optimizer.load_state_from_peers`` | ``optimizer:GuardedOptimizer.load_state_from_peers`` | a peer that refused every state joins the swarm's epoch with its own parameters | ``tests/workers/compat/test_optimizer.py::test_a_peer_behind_the_swarm_that_refuses_every_state_catches_up_with_its_own_parameters`` |
| ``optim/optimizer.py``: ``Optimizer._should_load_state_from_peers`` | ``optimizer:GuardedOptimizer._should_load_state_from_peers`` | in the local-updates modes a peer one epoch behind keeps its work | ``tests/workers/compat/test_optimizer.py::test_a_peer_one_epoch_behind_ends_its_epoch_in_the_local_modes_instead_of_discarding_its_work`` |
| ``optim/optimizer.py``: ``Optimizer._update_global_epoch`` | ``optimizer:GuardedOptimizer._update_global_epoch``, ``OuterStepOptimizer._update_global_epoch``; ``optimizer:update_global_epoch`` calls it | each epoch's settings; DiLoCo's anchor follows a lone peer; an idle peer still ends the epoch | ``tests/workers/compat/test_optimizer.py::test_a_runs_early_epochs_average_more_often_then_every_peer_switches_at_the_same_epoch``; idle: ``tests/workers/test_collaborative_training.py::test_pause_and_resume_lose_no_samples`` |
| ``optim/state_averager.py``: ``TrainingStateAverager._apply_averaging_results_``, ``get_current_state`` | ``state_averager:GuardedStateAverager`` | no NaN or infinity enters or leaves a peer through averaging | ``tests/workers/compat/test_state_averager.py::test_no_nan_enters_or_leaves_a_peer_through_averaging_or_state_downloads`` |
| ``optim/state_averager.py``: ``TrainingStateAverager.step``, ``_load_local_tensors_into_averager_`` | ``state_averager:GuardedStateAverager.step`` | local steps go on while a background round runs (hivemind waited: 40 % of a demo's time) | ``tests/workers/compat/test_state_averager.py::test_local_steps_go_on_while_an_averaging_round_runs_and_keep_their_progress`` |
| ``averaging/averager.py``: ``DecentralizedAverager._get_handle_name`` | ``state_averager:GuardedStateAverager._get_handle_name`` | subclasses speak the plain averager's RPC names (checkpointer, older peers) | ``tests/workers/compat/test_state_averager.py::test_the_diloco_averager_speaks_the_plain_averagers_protocol`` |
| ``optim/state_averager.py``: ``TrainingStateAverager._apply_averaging_results_`` (delta rule) | ``state_averager:OuterStepStateAverager`` | DiLoCo: an outer Nesterov step on the averaged parameters | the maths: ``tests/workers/test_optim.py::test_outer_nesterov_is_plain_averaging_at_lr_one_and_extrapolates_with_momentum``; the RPC names: above |
| ``averaging/matchmaking.py``: ``Matchmaking.min_matchmaking_time``, ``request_timeout``, ``PotentialLeaders.min_matchmaking_time`` (set in the averager's process) | ``state_averager:GuardedStateAverager.set_matchmaking_time`` | a run's early epochs match faster than its later ones | ``tests/workers/compat/test_optimizer.py::test_a_runs_early_epochs_average_more_often_then_every_peer_switches_at_the_same_epoch`` |
| ``averaging/averager.py``: ``DecentralizedAverager.load_state_from_peers``, ``_load_state_from_peers`` (re-written copy) | ``state_download:_CheckedStateDownload`` | a served state is checked before loading and taken from another peer if refused; a checkpoint is several peers' mean | ``tests/workers/compat/test_state_download.py::test_a_downloaded_state_far_worse_than_the_peers_own_is_refused_and_taken_from_another_peer``, ``::test_a_consensus_download_loads_the_mean_of_the_peers_at_the_newest_epoch`` |
| ``averaging/averager.py``: ``DecentralizedAverager._step`` | ``averager:_HeldRequestTasks._step`` | the request loop drops its task reference; a garbage collection destroyed pending rounds | ``tests/workers/compat/test_averager.py::test_a_scheduled_round_survives_a_garbage_collection_in_the_averager_process`` |
| ``optim/state_averager.py``: ``dump_optimizer_state``, ``load_optimizer_state`` | ``state_averager:dump_optimizer_state``, ``load_optimizer_state`` | checkpoints hold the optimizer's state; a mismatch is a ``ValueError`` | ``tests/coordinator/test_checkpoints.py::test_a_checkpoint_holds_the_model_optimizer_metrics_and_drawings`` |
| ``dht/protocol.py``: ``DHTProtocol.authorizer`` (read) | ``dht:node_authorizer`` | a refreshed peer token and the revocations reach the DHT's process | ``tests/coordinator/test_swarm.py::test_swarm_peer_admits_valid_tokens_refuses_forged_and_revoked_and_reads_progress`` |
| ``optim/progress_tracker.py``: ``global_progress``, ``global_epoch``, ``local_progress``; ``GradientAverager.local_samples_accumulated`` (read) | ``progress:swarm_size``, ``global_epoch``, ``samples_accumulated`` | the worker's progress events | ``tests/workers/test_collaborative_training.py::test_peers_train_together_share_state_keep_out_forgers_and_survive_a_dead_peer`` |

The package is one namespace, as when it was one module: assigning a name on it (``compat.X = ...``) assigns it
in every module of the package that holds the same object. Test builds rely on that:
``tests/security/undefended`` replaces ``compat.install_robust_averaging`` by a no-op (so :func:`install` and
the worker average plainly), ``tests/security/poisoner`` replaces ``compat.robust_mean`` (what its reducers
send back), and ``tests/perf`` benchmarks switch parts off the same way
(``tests/workers/compat/test_allreduce.py::test_a_name_replaced_on_the_package_is_replaced_where_it_is_used``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from workers.compat import (
    allreduce,
    averager,
    dht,
    matchmaking,
    optimizer,
    p2p,
    progress,
    state_averager,
    state_download,
    version,
)
from workers.compat.allreduce import (
    RobustPartContainer,
    RobustPartReducer,
    count_received_bytes,
    install_robust_averaging,
)
from workers.compat.allreduce import _note_screening as _note_screening  # its test calls compat's
from workers.compat.allreduce import robust_mean as robust_mean  # replaced by tests/security/poisoner
from workers.compat.dht import node_authorizer
from workers.compat.matchmaking import (
    MATCHMAKING_QUERY_INTERVAL,
    STATE_DECLARE_INTERVAL,
    install_calm_matchmaking,
    matchmaking_query_interval,
)
from workers.compat.optimizer import (
    FIRST_EPOCH_REFRESH_PERIOD,
    EpochSettings,
    GuardedOptimizer,
    OuterStepOptimizer,
    update_global_epoch,
)
from workers.compat.p2p import (
    install_static_relays,
    relay_service_options,
    relayed_options,
)
from workers.compat.progress import (
    FIRST_EPOCH_REPORT_INTERVAL,
    global_epoch,
    samples_accumulated,
    swarm_size,
    throttle_progress_reports,
)
from workers.compat.state_averager import (
    GuardedStateAverager,
    OuterStepStateAverager,
    dump_optimizer_state,
    load_optimizer_state,
)
from workers.compat.state_download import states_spread, tensors_finite
from workers.compat.version import WRITTEN_FOR, HivemindVersionError, check_hivemind_version

__all__ = [
    "FIRST_EPOCH_REFRESH_PERIOD",
    "FIRST_EPOCH_REPORT_INTERVAL",
    "MATCHMAKING_QUERY_INTERVAL",
    "STATE_DECLARE_INTERVAL",
    "WRITTEN_FOR",
    "EpochSettings",
    "GuardedOptimizer",
    "GuardedStateAverager",
    "HivemindVersionError",
    "OuterStepOptimizer",
    "OuterStepStateAverager",
    "RobustPartContainer",
    "RobustPartReducer",
    "check_hivemind_version",
    "count_received_bytes",
    "dump_optimizer_state",
    "global_epoch",
    "install",
    "install_calm_matchmaking",
    "install_robust_averaging",
    "install_static_relays",
    "load_optimizer_state",
    "matchmaking_query_interval",
    "node_authorizer",
    "relay_service_options",
    "relayed_options",
    "samples_accumulated",
    "states_spread",
    "swarm_size",
    "tensors_finite",
    "throttle_progress_reports",
    "update_global_epoch",
]


def install(
    *,
    query_interval: float = MATCHMAKING_QUERY_INTERVAL,
    declare_interval: float = STATE_DECLARE_INTERVAL,
    add_received: Callable[[int], None] | None = None,
) -> None:
    """Apply every process-wide replacement of the first table above. Idempotent: a later call changes only
    the settings it is given, never wraps a wrapper.

    Call it before hivemind starts the averagers' processes (they inherit what is installed then).

    :param query_interval: seconds at least between two reads of a group's key by one averager
        (:func:`install_calm_matchmaking`; :func:`matchmaking_query_interval` derives it from a run's
        matchmaking time). A later call sets it for the averager processes started after it.
    :param declare_interval: seconds at least between two records of an averager's state-download priority.
    :param add_received: called with the size of every all-reduce part this process receives
        (:func:`count_received_bytes`); None leaves the counter as it is (none, at first).
    """
    # looked up in this namespace when called, so that a build which replaced it (tests/security/undefended)
    # averages as plain hivemind does
    install_robust_averaging()
    install_calm_matchmaking(query_interval=query_interval, declare_interval=declare_interval)
    install_static_relays()
    if add_received is not None:
        count_received_bytes(add_received)


_PARTS: tuple[types.ModuleType, ...] = (
    allreduce,
    averager,
    dht,
    matchmaking,
    optimizer,
    p2p,
    progress,
    state_averager,
    state_download,
    version,
)
_UNSET = object()


class _OneNamespace(types.ModuleType):
    """The package's module type: ``compat.X = value`` also rebinds ``X`` in each of its modules where ``X``
    names the object the package named, so that the code calling it sees the replacement."""

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        if old is _UNSET or name.startswith("__"):
            return
        for part in _PARTS:
            if part.__dict__.get(name, _UNSET) is old:
                setattr(part, name, value)


sys.modules[__name__].__class__ = _OneNamespace
