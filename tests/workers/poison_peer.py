"""One peer of a small real hivemind swarm on loopback, for the poisoning test and benchmark (test-only).

``python tests/workers/poison_peer.py '{"index": 0, "steps": 60, "mode": "local", ...}'`` trains the
shapes-dalle tiny model with the worker's own optimizer (``workers.collab.build_optimizer``, which installs
the robust averaging) and prints one JSON line per step: ``{"step", "loss", "epoch"}``; the first line is
``{"maddrs": [...]}`` so that the next peers can join. Options:

* ``poison``: ``"nan"``, ``"inf"``, ``"huge"`` (1e6) or ``"mixed"`` (the three in turn, part by part):
  every tensor part this peer *sends* in an all-reduce is replaced (a test-only wrapper around hivemind's ``AllReduceRunner._generate_input_for_peer``; the
  peer's own reducer and its local values stay as they are, so the damage can only come from what it sends).
* ``defence``: false installs plain hivemind averaging (for the benchmark's undefended comparison).
* ``initial_peers``, ``seed`` (model and data order), ``mode`` (``local``, ``gradients`` or ``diloco``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")


def poison_outgoing(kind: str) -> None:
    """Make every part this process sends into an all-reduce NaN, +inf or 1e6 (the weight stays)."""
    import torch
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import averaging_pb2

    values = {
        "nan": [float("nan")],
        "inf": [float("inf")],
        "huge": [1e6],
        "mixed": [float("nan"), 1e6, float("inf")],
    }
    cycle = values[kind]

    async def generate(self: Any, peer_index: int) -> Any:
        parts = self.tensor_part_container.iterate_input_parts_for(peer_index)
        first, count = True, 0
        async for part in parts:
            value = cycle[count % len(cycle)]
            count += 1
            poisoned = serialize_torch_tensor(torch.full(tuple(part.size), value, dtype=torch.float32))
            if first:
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id, tensor_part=poisoned,
                    weight=self.weight,
                )  # fmt: skip
                first = False
            else:
                yield averaging_pb2.AveragingData(tensor_part=poisoned, weight=self.weight)

    AllReduceRunner._generate_input_for_peer = generate  # type: ignore[method-assign]


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    import hivemind
    import torch

    import workers.compat as compat
    from volunteer_app.protocol import OptimizerSettings, PeerAssignment
    from workers.collab import ByteCounter, build_optimizer
    from workers.optim import optimizer_parts
    from workers.tasks import load_task

    torch.set_num_threads(1)
    torch.manual_seed(int(args.get("seed", 0)))
    if not args.get("defence", True):
        compat.install_robust_averaging = lambda: None  # type: ignore[assignment]
    if args.get("poison"):
        poison_outgoing(str(args["poison"]))
    spec = load_task("shapes-dalle")
    config = spec.make_config({"preset": "tiny", "samples_per_shard": 64, "seed": 0})
    runtime = spec.build_runtime(config)
    model = runtime.build_model()
    dht = hivemind.DHT(
        initial_peers=args.get("initial_peers") or [], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_relay=False, auto_nat=False, nat_port_map=False,
    )  # fmt: skip
    print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    micro = 16
    target = int(args.get("target_batch_size", 96))
    settings = OptimizerSettings(
        update_mode=args.get("mode", "local"), target_batch_size=target, matchmaking_time=2.0,
        averaging_timeout=15.0, average_state_every=1, grad_compression="none", state_compression="none",
    )  # fmt: skip
    assignment = PeerAssignment(
        device="cpu", threads=1, micro_batch_size=micro, accumulation_steps=1, client_mode=False, amp=False,
        offload_optimizer=False, delay_optimizer_step=False,
    )  # fmt: skip
    groups, optimizer_factory, scheduler_factory = optimizer_parts(
        runtime, model, config, samples_per_epoch=target
    )
    opt = build_optimizer(
        dht=dht, run_id=str(args.get("run_id", "poison")), params=groups, optimizer_factory=optimizer_factory,
        settings=settings, assignment=assignment, micro_batch_size=micro, counter=ByteCounter(),
        scheduler_factory=scheduler_factory, report_interval=1.0,
    )  # fmt: skip
    index = int(args.get("index", 0))
    shard, step = index * 1000, 0
    steps = int(args.get("steps", 60))
    while step < steps:
        for batch in runtime.shard_batches(shard, batch_size=micro, seed=int(args.get("seed", 0)) + index):
            loss = runtime.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = float(loss.detach())
            print(json.dumps({"step": step, "loss": value, "epoch": opt.local_epoch}), flush=True)
            step += 1
            if step >= steps:
                break
        shard += 1
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(json.dumps({"done": True, "finite_parameters": finite, "epoch": opt.local_epoch}), flush=True)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
