"""Learning per sample of each update mode, simulated in one process (no network, no hivemind).

    python tests/perf/bench_learning.py single --samples 100000
    python tests/perf/bench_learning.py local --replicas 2 --round-samples 1024 --samples 100000
    python tests/perf/bench_learning.py diloco --replicas 2 --round-samples 2048 --samples 100000
    python tests/perf/bench_learning.py gradients --replicas 2 --round-samples 2048 --samples 100000
    python tests/perf/bench_learning.py local --replicas 2 --round-samples 1024 --stale-samples 600
    python tests/perf/bench_learning.py gradients --replicas 4 --round-samples 512 --samples 60000 --non-iid --robust

What the swarm's update modes do to the model, sample for sample, without the noise of a busy machine
(wall time does not enter): ``replicas`` models train in lock-step on different shards, as equally fast
peers would, and every ``round-samples`` samples *per replica* they synchronise as the mode says:

* ``single``: one process alone (``--replicas`` is ignored), an optimizer step per micro-batch;
* ``gradients``: gradient averaging: one optimizer step per ``round-samples x replicas`` samples;
* ``local``: each replica steps on its own micro-batches; parameters are averaged every round;
* ``diloco``: like ``local``, then the averaged parameters' offset from the last synchronised ones is
  the gradient of an outer SGD with Nesterov momentum (``--outer-lr``, ``--outer-momentum``).

``--stale-samples N`` (local, diloco) applies each round's result as the real swarm's background averaging
does: by the delta rule, after every replica trained N more samples.
Evaluations are of the round's average (with ``--stale-samples``, before it reaches the replicas).
``--trained-per-round FIRST LATER`` (local, diloco) lets each round run longer than the schedule counts, as the
real swarm's epochs do. ``--early-rounds ROUNDS SAMPLES`` (local, diloco) gives the first ROUNDS rounds SAMPLES
per replica (a run's ``early_epochs``; the bytes figure counts the later rounds only). ``--average-moments`` averages the AdamW moments in every round too.
``--robust`` (local, gradients) averages as the real swarm's robust all-reduce does (:mod:`workers.robust`,
hivemind's parts: the parameters in ``local``, each replica's gradient in ``gradients``) and counts the parts a
replica kept its own values for. ``--non-iid`` (shapes-dalle) gives each replica its own data: only the samples
whose caption's first shape is one of its share of the four shapes (the others' samples are dealt to them), as
volunteers with different data would train. ``--eval-before-averaging`` evaluates
replica 0 at the end of each round, before the averaging: a peer's model as a checkpoint may catch it.

The learning-rate schedule is the task config's (``--config lr=2e-3 lr_schedule=cosine ...``), stepped
per global epoch of ``round-samples x replicas`` samples, as hivemind steps it. Every ``--eval-every``
samples, and at the end, the synchronised model is evaluated on the task's held-out set (``eval_prompts``
captions drawn greedily and judged). Prints one JSON line per evaluation and a summary: samples to reach
``--target`` prompt accuracy and the bytes one peer would send per trained sample (fp16, each round).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _parse_config(items: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    return config


def _grad_or_zeros(p: Any) -> Any:
    import torch

    return p.grad if p.grad is not None else torch.zeros_like(p)


def _non_iid_streams(runtime: Any, num_shards: int, replicas: int, micro_batch: int) -> list[Any]:
    """A stream of micro-batches per replica over the task's shards: replica ``r`` gets only the samples whose
    caption's first shape word is one of the shapes ``r, r + replicas, ...`` of ``SHAPES`` (one after the other,
    a micro-batch each). Samples are dealt from the shards in order, as they come; a sample of a shape no
    replica holds (more than four replicas) is not trained."""
    import torch

    from workers.tasks.shapes_dalle.data import SHAPE_WORDS, SHAPES

    word_shape = {word: SHAPES.index(shape) for shape, words in SHAPE_WORDS.items() for word in words}
    queues: list[list[Any]] = [[] for _ in SHAPES]
    state = {"shard": 0, "lap": 0}

    def label(row: Any) -> int:
        words = runtime.text_tokenizer.decode(row[: runtime.text_len].tolist()).split()
        return next((word_shape[w] for w in words if w in word_shape), 0)

    def refill() -> None:
        for batch in runtime.shard_batches(state["shard"], batch_size=256, seed=state["lap"]):
            for row in batch:
                queues[label(row)].append(row)
        state["shard"] += 1
        if state["shard"] == num_shards:
            state["shard"], state["lap"] = 0, state["lap"] + 1

    def stream(shapes: list[int], micro_batch: int) -> Any:
        turn = 0
        while True:
            shape = shapes[turn % len(shapes)]
            turn += 1
            while len(queues[shape]) < micro_batch:
                refill()
            rows, queues[shape][:] = queues[shape][:micro_batch], queues[shape][micro_batch:]
            yield torch.stack(rows)

    return [
        stream(list(range(r, len(SHAPES), replicas)), micro_batch) for r in range(min(replicas, len(SHAPES)))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["single", "gradients", "local", "diloco"])
    parser.add_argument("--task", default="shapes-dalle")
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--round-samples", type=int, default=1024, help="samples per replica per round")
    parser.add_argument("--samples", type=int, default=100_000, help="samples in all replicas together")
    parser.add_argument("--eval-every", type=int, default=10_000)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument(
        "--stale-samples",
        type=int,
        default=0,
        help="local, diloco: samples each replica trains between a round's end and its result's arrival "
        "(applied by the delta rule, as hivemind's background averaging does; 0: at once)",
    )
    parser.add_argument(
        "--robust",
        action="store_true",
        help="local, gradients: average as the real swarm's robust all-reduce does (workers.robust), counting "
        "the parts a replica kept its own values for",
    )
    parser.add_argument(
        "--clip-factor",
        type=float,
        default=None,
        help="--robust: CenteredClip's radius in median distances (default workers.robust.CENTERED_CLIP_TAU_FACTOR)",
    )
    parser.add_argument(
        "--non-iid",
        action="store_true",
        help="shapes-dalle: each replica trains only on samples whose caption's first shape is in its share of "
        "the four shapes (volunteers with different data)",
    )
    parser.add_argument(
        "--eval-before-averaging",
        action="store_true",
        help="evaluate replica 0 at the end of a round, before its averaging (default: the averaged model)",
    )
    parser.add_argument(
        "--fp16-averaging",
        action="store_true",
        help="local, diloco: round every contribution and the result to fp16, as the swarm's default "
        "state compression sends them",
    )
    parser.add_argument(
        "--trained-per-round",
        type=int,
        nargs=2,
        default=None,
        metavar=("FIRST", "LATER"),
        help="local, diloco: samples each replica actually trains in the first round and in each later one, "
        "as the real swarm's epochs overshoot the target (its tracker sees its partners' progress late); the "
        "schedule still steps once per round, as if each round had --round-samples per replica",
    )
    parser.add_argument(
        "--average-moments",
        action="store_true",
        help="local, diloco: average the AdamW moments (exp_avg, exp_avg_sq) in every round too, as hivemind's "
        "average_opt_statistics does",
    )
    parser.add_argument(
        "--early-rounds",
        type=int,
        nargs=2,
        default=None,
        metavar=("ROUNDS", "SAMPLES"),
        help="local, diloco: the first ROUNDS rounds have SAMPLES per replica instead of --round-samples "
        "(frequent averaging early, then rarer: post-local SGD); the schedule follows the samples planned",
    )
    parser.add_argument(
        "--first-round-samples",
        type=int,
        default=None,
        metavar="SAMPLES",
        help="local, diloco: samples each replica trains before the first round, whatever the schedule plans "
        "(real peers train alone until their tracker sees the partner: ~1,300 each in a demo)",
    )
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--target", type=float, default=0.8, help="prompt accuracy to report samples for")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.early_rounds and (args.mode not in ("local", "diloco") or args.trained_per_round):
        parser.error("--early-rounds applies to the local and diloco modes, without --trained-per-round")
    if args.first_round_samples and (args.mode not in ("local", "diloco") or args.trained_per_round):
        parser.error(
            "--first-round-samples applies to the local and diloco modes, without --trained-per-round"
        )
    if args.trained_per_round and args.mode not in ("local", "diloco"):
        parser.error("--trained-per-round applies to the local and diloco modes")
    if args.average_moments and (args.robust or args.stale_samples):
        parser.error("--average-moments goes with rounds applied at once by the plain mean")
    if args.robust and (args.mode not in ("local", "gradients") or args.stale_samples):
        parser.error(
            "--robust simulates the local and gradients modes' rounds applied at once (no --stale-samples)"
        )
    if args.non_iid and (args.task != "shapes-dalle" or args.mode == "single" or args.replicas > 4):
        parser.error("--non-iid applies to shapes-dalle with 2-4 replicas")

    import torch

    from workers.compat import states_spread
    from workers.optim import OuterNesterov, ScheduleSettings, adamw, param_groups
    from workers.tasks import load_task

    torch.set_num_threads(args.threads)
    if args.clip_factor is not None:
        import workers.robust

        workers.robust.CENTERED_CLIP_TAU_FACTOR = args.clip_factor
    spec = load_task(args.task)
    overrides = _parse_config(args.config)
    overrides.setdefault("eval_prompts", args.eval_prompts)
    config = spec.make_config(overrides)
    runtime: Any = spec.build_runtime(config)
    schedule = ScheduleSettings.from_config(config)
    replicas = 1 if args.mode == "single" else args.replicas
    per_epoch = args.micro_batch if args.mode == "single" else args.round_samples * replicas
    weight_decay = float(getattr(config, "weight_decay", 0.0))
    models = [runtime.build_model() for _ in range(1 if args.mode == "gradients" else replicas)]
    optimizers = [
        adamw(param_groups(m, weight_decay=weight_decay), lr=schedule.peak_lr, weight_decay=weight_decay)
        for m in models
    ]
    outer = (
        OuterNesterov(list(models[0].parameters()), lr=args.outer_lr, momentum=args.outer_momentum)
        if args.mode == "diloco"
        else None
    )
    num_shards = spec.num_shards(config)

    def batches(replica: int) -> Any:
        shard, lap = replica, 0
        while True:
            yield from runtime.shard_batches(shard % num_shards, batch_size=args.micro_batch, seed=lap)
            shard += replicas
            lap += shard // num_shards

    streams = (
        [batches(r) for r in range(replicas)]
        if not args.non_iid
        else _non_iid_streams(runtime, num_shards, replicas, args.micro_batch)
    )
    out = args.out.open("a") if args.out else None

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    label = {
        "mode": args.mode,
        "replicas": replicas,
        "round_samples": args.round_samples,
        "micro_batch": args.micro_batch,
        "config": overrides,
        "outer": [args.outer_lr, args.outer_momentum] if outer else None,
        "stale_samples": args.stale_samples,
        "fp16_averaging": args.fp16_averaging,
        "average_moments": args.average_moments,
        "trained_per_round": args.trained_per_round,
        "early_rounds": args.early_rounds,
        "first_round_samples": args.first_round_samples,
        "robust": args.robust,
        "clip_factor": args.clip_factor,
        "non_iid": args.non_iid,
    }
    emit({"start": label})
    samples = 0
    epoch = 0
    next_eval = args.eval_every
    reached: int | None = None
    started = time.perf_counter()
    curve: list[tuple[int, float, float]] = []

    def round_size(e: int) -> int:
        """Samples per replica planned for round ``e`` (local, diloco)."""
        if args.early_rounds and e < args.early_rounds[0]:
            return args.early_rounds[1]
        return args.round_samples

    def planned_midpoint() -> float:
        """The samples the schedule is read at for the current epoch: the middle of the epoch as planned."""
        if not args.early_rounds:
            return (epoch + 0.5) * per_epoch
        before = sum(round_size(e) for e in range(epoch)) * replicas
        return before + 0.5 * round_size(epoch) * replicas

    def set_lr() -> None:
        lr = schedule.lr_at(planned_midpoint())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def evaluate(average: list[Any] | None = None) -> None:
        """Replica 0, or (``average``) the round's average put in its place for the evaluation."""
        nonlocal reached
        model = models[0]
        kept = None
        if average is not None:
            with torch.no_grad():
                kept = [p.detach().clone() for p in model.parameters()]
                for p, a in zip(model.parameters(), average, strict=True):
                    p.copy_(a)
        metrics = runtime.evaluate(model)
        if kept is not None:
            with torch.no_grad():
                for p, k in zip(model.parameters(), kept, strict=True):
                    p.copy_(k)
        curve.append((samples, metrics["prompt_accuracy"], metrics["loss"]))
        spread_since, spreads[:] = list(spreads), []
        if reached is None and metrics["prompt_accuracy"] >= args.target:
            reached = samples
        emit(
            {
                "samples": samples,
                "loss": round(metrics["loss"], 4),
                "prompt_accuracy": round(metrics["prompt_accuracy"], 4),
                "object_accuracy": round(metrics["object_accuracy"], 4),
                "lr": schedule.lr_at(planned_midpoint()),
                **({"parts_kept_own": refused, "rounds": rounds} if args.robust else {}),
                **(
                    {"parts_changed": tally["changed"], "parts_averaged": tally["parts"]}
                    if args.robust
                    else {}
                ),
                # the replicas' spread at the ends of the rounds since the last evaluation: mean and largest
                **(
                    {
                        "spread": round(sum(spread_since) / len(spread_since), 5),
                        "spread_max": round(max(spread_since), 5),
                    }
                    if spread_since
                    else {}
                ),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )

    spreads: list[float] = []  # each round's replica_spread, before averaging

    def replica_spread(params: list[list[Any]]) -> float:
        """How far the replicas lie from their mean at a round's end (what the coordinator's checkpoints record
        as ``peer_spread``)."""
        mean = [torch.stack([t.detach() for t in group]).mean(dim=0) for group in zip(*params, strict=True)]
        return float(states_spread([[t.detach() for t in p] for p in params], mean))

    pending: tuple[list[Any], list[list[Any]]] | None = None
    refused = rounds = 0
    from workers.robust import ChangeHistory

    tally = {"parts": 0, "changed": 0}  # --robust gradients: parts averaged, and those the rules changed
    history = ChangeHistory()  # replica 0's references for the gradient parts it reduces (--robust gradients)

    def robust_round(params: list[list[Any]]) -> int:
        """One state-averaging round as the real swarm's robust all-reduce does it (workers.robust): every
        tensor split into hivemind's parts, each part reduced by one replica (contiguous shares of the
        total size), partners' contributions screened by the reducer, the reducer's answer screened by
        each receiver. Returns the number of (part, receiver) pairs that kept their own values."""
        from workers.robust import robust_mean, screen_deltas

        total = sum(p.numel() for p in params[0])
        part_values = 2**19 // 2  # hivemind's DEFAULT_PART_SIZE_BYTES over fp16's 2 bytes per value
        offset, kept_own = 0, 0
        for tensors in zip(*params, strict=True):
            flats = [t.detach().view(-1) for t in tensors]
            for start in range(0, flats[0].numel(), part_values):
                parts = [f[start : start + part_values] for f in flats]
                reducer = min(replicas - 1, (offset + start) * replicas // total)
                dropped: list[int] = []
                result = robust_mean(
                    [(part.clone(), 1.0) for part in parts],
                    parts[0].shape,
                    dropped,
                    own=reducer,
                    kind="parameters",
                )
                if not torch.isfinite(result).all():
                    continue
                plain = torch.stack(parts).mean(dim=0)
                tally["parts"] += 1
                if not torch.allclose(result, plain, rtol=1e-4, atol=1e-6 * float(plain.abs().max())):
                    tally["changed"] += 1  # the robust rules moved this honest part's average
                for r, part in enumerate(parts):
                    if r != reducer:  # the receiver screens the reducer's answer as the worker does
                        report = screen_deltas(
                            [[result - part]], [[part]], own_index=None, senders=replicas, kind="parameters"
                        )
                        if report:
                            kept_own += 1
                            continue
                    part.copy_(result)
                kept_own += len(dropped)
            offset += flats[0].numel()
        return kept_own

    def robust_gradient_round(grads: list[list[Any]], model: Any) -> int:
        """One gradient-averaging round as the real swarm's robust all-reduce does it: each tensor in hivemind's
        parts, each part reduced by one replica (robust_mean of the replicas' gradients, equal weights) and the
        answer screened by every other receiver (screen_deltas, which learns each part's reference as the
        workers do). Replica 0's view of the result goes into ``model``'s gradients. Returns the (part,
        receiver) pairs and contributions left out."""
        import torch

        from workers.robust import robust_mean, root_mean_square, screen_deltas

        total_size = sum(g.numel() for g in grads[0])
        rms = [root_mean_square([g]) for g in grads]
        part_values = 2**19 // 2
        offset, kept_own, part_id = 0, 0, 0
        for index, p in enumerate(model.parameters()):
            flats = [g[index].view(-1) for g in grads]
            merged = flats[0].clone()
            for start in range(0, flats[0].numel(), part_values):
                parts = [f[start : start + part_values] for f in flats]
                reducer = min(replicas - 1, (offset + start) * replicas // total_size)
                dropped: list[int] = []
                result = robust_mean(
                    [(part, 1.0) for part in parts], parts[0].shape, dropped, own=reducer, rms=rms[reducer]
                )
                kept_own += len(dropped)
                plain = torch.stack(parts).mean(dim=0)
                tally["parts"] += 1
                if not torch.allclose(result, plain, rtol=1e-4, atol=1e-6 * float(plain.abs().max())):
                    tally["changed"] += 1  # the robust rules moved this honest part's average
                # replica 0 screens the answer as a worker does (the part numbered as in the worker's history;
                # the parts it reduces itself teach the history)
                before: list[list[Any]] = [[] for _ in range(part_id)]
                report = screen_deltas(
                    [*before, [result - parts[0]]],
                    [*before, [parts[0]]],
                    own_index=part_id if reducer == 0 else None,
                    senders=replicas,
                    history=history,
                )
                part_id += 1
                if report:
                    kept_own += 1
                    continue
                merged[start : start + part_values] = result
            offset += flats[0].numel()
            p.grad = (merged * replicas).view_as(p)  # a sum over the replicas' samples, as in the plain mode
        return kept_own

    def average(group: tuple[Any, ...]) -> Any:
        if not args.fp16_averaging:
            return torch.stack(group).mean(dim=0)
        # what fp16 state compression does to a 2-peer all-reduce: the partners' values arrive rounded to
        # fp16, and the mean goes back to them rounded again (the reducer's own share stays fp32; here every
        # share is rounded, so this errs towards more rounding, by at most one rounding per value)
        return torch.stack([t.half().float() for t in group]).mean(dim=0).half().float()

    def apply_delta(averaged: list[Any], contributed: list[list[Any]]) -> None:
        with torch.no_grad():
            for model, snapshot in zip(models, contributed, strict=True):
                for p, a, c in zip(model.parameters(), averaged, snapshot, strict=True):
                    p.add_(a - c)

    set_lr()
    while samples < args.samples:
        # one round: every replica trains round_samples samples
        if args.mode == "gradients":
            model, optimizer = models[0], optimizers[0]
            total = 0
            grads: list[list[Any]] = []
            for r in range(replicas):
                done = 0
                while done < args.round_samples:
                    batch = next(streams[r])
                    n = runtime.batch_size_of(batch)
                    loss = runtime.loss(model, batch) * n
                    loss.backward()
                    done += n
                total += done
                if args.robust:  # each replica's own gradient (a sum over its samples), as a peer sends it
                    grads.append([_grad_or_zeros(p).clone() for p in model.parameters()])
                    model.zero_grad(set_to_none=True)
            if args.robust:
                refused += robust_gradient_round(grads, model)
                rounds += 1
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(total)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += total
        else:
            done = [0] * replicas
            this_round = round_size(epoch)
            if args.trained_per_round:
                this_round = args.trained_per_round[0 if epoch == 0 else 1]
            if args.first_round_samples and epoch == 0:
                this_round = args.first_round_samples
            while min(done) < this_round:
                if pending is not None and min(done) >= args.stale_samples:
                    apply_delta(*pending)
                    pending = None
                for r in range(replicas):
                    if done[r] >= this_round:
                        continue
                    batch = next(streams[r])
                    loss = runtime.loss(models[r], batch)
                    loss.backward()
                    optimizers[r].step()
                    optimizers[r].zero_grad(set_to_none=True)
                    n = runtime.batch_size_of(batch)
                    done[r] += n
                    samples += n
                    if args.mode == "single" and samples // per_epoch != epoch:
                        epoch = samples // per_epoch
                        set_lr()
            if replicas > 1 and args.eval_before_averaging and samples >= next_eval:
                evaluate()  # one replica as the round left it, before averaging: what a checkpoint may catch
                while next_eval <= samples:
                    next_eval += args.eval_every
            if replicas > 1:
                with torch.no_grad():
                    params = [list(m.parameters()) for m in models]
                    spreads.append(replica_spread(params))
                    if pending is not None:  # the round ended before the previous result arrived
                        apply_delta(*pending)
                        pending = None
                    if args.robust:
                        refused += robust_round(params)
                        rounds += 1
                    else:
                        averaged = [average(group) for group in zip(*params, strict=True)]
                        if outer is not None:
                            averaged = outer.step(averaged)
                        if args.stale_samples:
                            # the real swarm averages in the background: the result arrives while the peers
                            # train on, and is applied by hivemind's delta rule (local += averaged - contributed)
                            pending = (averaged, [[p.detach().clone() for p in mp] for mp in params])
                        else:
                            for model_params in params:
                                for p, a in zip(model_params, averaged, strict=True):
                                    p.copy_(a)
                    if args.average_moments:
                        for group in zip(*params, strict=True):
                            states = [opt.state[p] for opt, p in zip(optimizers, group, strict=True)]
                            for key in ("exp_avg", "exp_avg_sq"):
                                mean = torch.stack([state[key] for state in states]).mean(dim=0)
                                for state in states:
                                    state[key].copy_(mean)
        if args.mode != "single":
            epoch += 1
            set_lr()
        if samples >= next_eval:
            # the round's average, also when it has not reached the replicas yet (--stale-samples): what the
            # swarm learned, as the fresh rounds' figures measure it
            evaluate(pending[0] if pending is not None else None)
            while next_eval <= samples:
                next_eval += args.eval_every
    if not curve or curve[-1][0] != samples:
        evaluate(pending[0] if pending is not None else None)  # and at the end, wherever it falls
    parameters = sum(p.numel() for p in models[0].parameters())
    # fp16 parameters (local, diloco) or gradients (gradients) once per round; a 2-peer all-reduce sends
    # half the tensor and receives the other half averaged, so ~1x the tensor per round per peer.
    bytes_per_sample = (
        0.0 if replicas == 1 else 2 * parameters * (replicas - 1) / replicas / args.round_samples
    )
    emit(
        {
            "summary": label,
            "samples_to_target": reached,
            "target": args.target,
            "final_accuracy": curve[-1][1] if curve else None,
            "final_loss": curve[-1][2] if curve else None,
            "bytes_sent_per_sample": round(bytes_per_sample, 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
