"""Learning per sample of two *real* hivemind peers on loopback, on the simulation's data, seed and schedule.

    python tests/perf/bench_learning_swarm.py --round-samples 256 --samples 100000 --seed 0 [--blocking]

``bench_learning.py local`` simulates the local-updates mode in one process; this runs the same arithmetic
through the swarm's real averaging (``workers.collab.build_optimizer``: hivemind's optimizer, the robust
all-reduce, the run's compression, the tracker's epochs) with no coordinator, leases or agent in between.
Each peer is a process with one thread and trains the shards the simulation's replica of the same index
trains (``r``, ``r + 2``, ... in order), a local step per ``--micro-batch`` samples; the swarm averages every
``2 x --round-samples`` samples. Every ``--eval-every`` samples (both peers together) each peer saves its
parameters; at the end the parent evaluates peer 0's model and the two peers' mean at each point on the
task's held-out captions, as the simulation evaluates its replicas, and prints one JSON line per point. A peer
stops when its partner is done; if that leaves it within half a round of the last point, it saves there.

``--blocking`` makes every local step wait for a running averaging round (hivemind 1.1.12's own behaviour)
instead of stepping on while it runs (the worker's: ``workers.compat.GuardedStateAverager.step``), so a
round's result is applied before the next step, as in the simulation without ``--stale-samples``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

_PEER = r"""
import json, sys, time
from pathlib import Path
import hivemind, torch

args = json.loads(sys.argv[1])
torch.set_num_threads(1)
from volunteer_app.protocol import OptimizerSettings, PeerAssignment
from workers import collab, compat
from workers.optim import optimizer_parts
from workers.tasks import load_task

rank, out = args["rank"], Path(args["out"])
spec = load_task("shapes-dalle")
config = spec.make_config(args["config"])
runtime = spec.build_runtime(config)
torch.manual_seed(getattr(config, "seed", 0))
model = runtime.build_model()
early = args["early_rounds"] or [0, args["round_samples"] // 2]
settings = OptimizerSettings(
    target_batch_size=2 * args["round_samples"], matchmaking_time=args["matchmaking_time"],
    state_compression=args["state_compression"], early_epochs=early[0], early_target_batch_size=2 * early[1],
    early_matchmaking_time=args["early_matchmaking_time"])
groups, factory, scheduler = optimizer_parts(runtime, model, config, samples_per_epoch=settings.samples_at_epoch)
dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=args["initial_peers"], start=True)
print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
if args["plain_averaging"]:
    compat.install_robust_averaging = lambda: None  # hivemind's own all-reduce: a plain mean
if args["blocking"]:
    compat.GuardedStateAverager._is_plain_local_step = lambda self, kwargs: False
assignment = PeerAssignment(device="cpu", threads=1, micro_batch_size=args["micro_batch"], accumulation_steps=1,
                            client_mode=False, amp=False, offload_optimizer=False, delay_optimizer_step=False)
opt = collab.build_optimizer(dht=dht, run_id=args["run_id"], params=groups, optimizer_factory=factory,
                             settings=settings, assignment=assignment, micro_batch_size=args["micro_batch"],
                             counter=collab.ByteCounter(), scheduler_factory=scheduler)
if args.get("verbose"):
    import logging
    opt.status_loglevel = opt.state_averager.status_loglevel = logging.INFO
(out / f"ready-{rank}").touch()
while not all((out / f"ready-{r}").exists() for r in range(2)):
    time.sleep(0.05)
time.sleep(2.0)  # both peers' progress records in the DHT

def stream():
    shard, lap, shards = rank, 0, spec.num_shards(config)
    while True:
        yield from runtime.shard_batches(shard % shards, batch_size=args["micro_batch"], seed=lap)
        shard += 2
        lap += shard // shards

def save(point):
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"r{rank}-{point}.pt")

done, next_save, started, epoch_seen = 0, args["save_every"], time.perf_counter(), 0
for batch in stream():
    loss = runtime.loss(model, batch)
    loss.backward()
    n = runtime.batch_size_of(batch)
    opt.step(batch_size=n)
    opt.zero_grad(set_to_none=True)
    done += n
    if opt.local_epoch != epoch_seen:  # when each epoch began, in this peer's samples (a few are printed)
        epoch_seen = opt.local_epoch
        if epoch_seen in (1, 2, 3) or epoch_seen == early[0]:
            print(json.dumps({"rank": rank, "epoch": epoch_seen, "at_samples": done}), flush=True)
    if done >= next_save:
        save(next_save)
        next_save += args["save_every"]
    if done >= args["samples"] or (out / f"done-{1 - rank}").exists():
        if next_save <= args["samples"] and done >= next_save - args["round_samples"] // 2:
            save(next_save)  # the partner finished first, this peer a few steps short of the last point
        break  # a peer alone would wait out every round (--blocking) or train on without averaging
print(json.dumps({"rank": rank, "samples": done, "epoch": opt.local_epoch,
                  "seconds": round(time.perf_counter() - started, 1)}), flush=True)
(out / f"done-{rank}").touch()
while not all((out / f"done-{r}").exists() for r in range(2)):
    time.sleep(0.05)  # a partner still training keeps its rounds
opt.shutdown()
dht.shutdown()
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-samples", type=int, default=256, help="samples per peer per round")
    parser.add_argument("--samples", type=int, default=100_000, help="samples in both peers together")
    parser.add_argument("--eval-every", type=int, default=20_000)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matchmaking-time", type=float, default=0.5)
    parser.add_argument(
        "--early-rounds",
        type=int,
        nargs=2,
        default=None,
        metavar=("ROUNDS", "SAMPLES"),
        help="the run's first ROUNDS epochs have SAMPLES per peer (OptimizerSettings.early_epochs), as "
        "bench_learning.py --early-rounds simulates",
    )
    parser.add_argument("--early-matchmaking-time", type=float, default=0.5)
    parser.add_argument("--state-compression", default="none", choices=["none", "fp16", "8bit"])
    parser.add_argument("--blocking", action="store_true", help="local steps wait for a running round")
    parser.add_argument(
        "--plain-averaging",
        action="store_true",
        help="hivemind's own all-reduce (a plain mean) instead of the worker's robust one (workers.robust)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="the peers log every round (hivemind's messages)"
    )
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    import torch

    from tests.conftest import python_env
    from workers.tasks import load_task

    config: dict[str, Any] = {
        "preset": "mini",
        "decay_samples": 120_000,
        "seed": args.seed,
        "eval_prompts": 256,
    }
    for item in args.config:
        key, _, value = item.partition("=")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    with tempfile.TemporaryDirectory(prefix="bench-learning-swarm-") as tmp:
        out = Path(tmp)
        common = {
            "config": config,
            "round_samples": args.round_samples,
            "micro_batch": args.micro_batch,
            "matchmaking_time": args.matchmaking_time,
            "state_compression": args.state_compression,
            "early_rounds": args.early_rounds,
            "early_matchmaking_time": args.early_matchmaking_time,
            "blocking": args.blocking,
            "verbose": args.verbose,
            "plain_averaging": args.plain_averaging,
            "samples": args.samples // 2,
            "save_every": args.eval_every // 2,
            "run_id": f"bench_learning_swarm_{time.time_ns()}",
            "out": str(out),
        }
        env = python_env(**({"HIVEMIND_LOGLEVEL": "INFO"} if args.verbose else {}))
        peers: list[subprocess.Popen[str]] = []
        initial: list[str] = []
        for rank in range(2):
            peer = subprocess.Popen(
                [sys.executable, "-c", _PEER, json.dumps({**common, "rank": rank, "initial_peers": initial})],
                stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            )  # fmt: skip
            peers.append(peer)
            assert peer.stdout is not None
            line = peer.stdout.readline()
            if not line:
                raise SystemExit(f"peer {rank} did not start")
            initial = json.loads(line)["maddrs"]
        for peer in peers:
            assert peer.stdout is not None
            for line in peer.stdout:
                print(line.strip(), flush=True)
            if peer.wait() != 0:
                raise SystemExit("a peer failed")
        spec = load_task("shapes-dalle")
        runtime: Any = spec.build_runtime(spec.make_config(config))
        model = runtime.build_model()
        torch.set_num_threads(2)
        for step in range(args.eval_every // 2, args.samples // 2 + 1, args.eval_every // 2):
            if not all((out / f"r{r}-{step}.pt").exists() for r in range(2)):
                break  # the partner stopped first
            states = [torch.load(out / f"r{r}-{step}.pt") for r in range(2)]
            record: dict[str, Any] = {"samples": 2 * step}
            for label, state in (
                ("peer0", states[0]),
                ("mean", {k: (states[0][k] + states[1][k]) / 2 for k in states[0]}),
            ):
                model.load_state_dict(state)
                metrics = runtime.evaluate(model)
                record[label] = {
                    "loss": round(metrics["loss"], 4),
                    "prompt_accuracy": metrics["prompt_accuracy"],
                }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
