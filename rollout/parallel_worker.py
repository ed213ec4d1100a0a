"""`ParallelRolloutWorker`: one rollout worker whose policy is split over `max(tensor_parallel, expert_parallel)`
ranks (`ebpo.model.parallel`), with the public methods of `rollout.worker.RolloutWorker`.

Choice: ONE process (the Ray actor the driver sees) starts its ranks with `torch.multiprocessing` (spawn), rather
than one Ray actor per rank in a placement group. The driver, the partial-rollout ledger and the weight sync keep
talking to one worker; the ranks are private to it, die with it, and need no Ray of their own. Each rank runs a
plain `RolloutWorker` (`_RankWorker`) over its parallel model, so generation, partial rollouts, block versions and
multi-turn episodes are the single-process code: the engine's scheduling depends only on tokens and
probabilities, which are the same on every rank (`rollout.parallel_runner`), so every rank makes the same model
calls in the same order. The worker forwards each call to every rank, waits for all of them, and returns rank 0's
answer (the others are the same).

Weights: each rank loads its slice with a `ShardLoader`. A state dict sent to the ranks goes through
`torch.multiprocessing` queues, i.e. shared memory: the full tensors exist once on the host (where the worker
received them), and each rank copies only its slice into its shards, so no rank ever holds the whole model.

Limits: multi-turn environments run once per rank and must be deterministic given their seed (an environment whose
observation differs between ranks would make the ranks diverge and the call fail or hang until `timeout_s`);
the base model is loaded whole in each rank before it is sliced (fine for presets and small checkpoints; a large
checkpoint needs a streaming reader).
"""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

from .worker import RolloutWorker


class _RankWorker(RolloutWorker):
    """`RolloutWorker` of one rank: its model is this rank's `ParallelLLaDA2MoeLM`; weights load slice by slice."""

    def __init__(self, model: str, decode: dict, *, tensor_parallel: int, expert_parallel: int, device: str,
                 fp8: bool = False, num_threads: int | None = None, env_factory=None, multiturn: dict | None = None):
        from ebpo.model.loading import load_model, load_model_tokenizer
        from ebpo.model.parallel import build_parallel_model, make_groups

        from . import DecodeConfig

        torch.set_num_threads(num_threads or 1)
        decode = dict(decode)
        self.decode_config = DecodeConfig.preset(decode.pop("preset", "speed"), **decode)
        self.env_factory, self.multiturn = env_factory, dict(multiturn or {})
        self.device = torch.device(device)
        full = load_model(model, device="cpu").eval()
        tp_group, ep_group = make_groups(tensor_parallel, expert_parallel)
        self.model = build_parallel_model(full, full.config, tp_group, ep_group, fp8=fp8,
                                          dtype=next(full.parameters()).dtype, device=self.device)
        del full
        self.tokenizer = load_model_tokenizer(model)
        self.fp8, self.version = fp8, 0
        self.sync_group = self.partial = self.env_runner = self.engines = None
        self.loader = None

    def load_weights(self, state_dict, version: int) -> float:
        """This rank's slices of a full state dict (learner or released names)."""
        self.begin_load()
        self.load_part(state_dict)
        return self.end_load(version)

    def begin_load(self) -> None:
        from ebpo.model.parallel import ShardLoader

        self.loader = ShardLoader(self.model)

    def load_part(self, part: dict) -> None:
        self.loader.load_all(part.items())

    def end_load(self, version: int) -> float:
        self.loader.finish()
        self.loader = None
        self._new_version(version)
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, kwargs: dict, inbox, outbox) -> None:
    """One rank: join the group, build its worker, then run the calls that arrive until None."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    cuda = str(kwargs["device"]).startswith("cuda")
    if cuda:
        kwargs = dict(kwargs, device=f"cuda:{rank}")
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        worker = _RankWorker(**kwargs)
        outbox.put((rank, True, None))
    except Exception:  # noqa: BLE001 - reported to the worker, which raises it
        outbox.put((rank, False, traceback.format_exc()))
        return
    try:
        while (call := inbox.get()) is not None:
            name, args, kw = call
            try:
                with torch.no_grad():
                    outbox.put((rank, True, getattr(worker, name)(*args, **kw)))
            except Exception:  # noqa: BLE001 - reported to the worker, which raises it
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class ParallelRolloutWorker:
    """A rollout worker over `max(tensor_parallel, expert_parallel)` ranks (module docstring). Arguments as
    `RolloutWorker`'s, plus the layout and `timeout_s`, the longest a call may wait for a rank. device "cuda":
    rank r takes cuda:r (NCCL); "cpu": gloo."""

    def __init__(self, model: str, decode: dict, *, tensor_parallel: int = 1, expert_parallel: int = 1,
                 num_threads: int | None = None, fp8: bool = False, device: str = "cpu", weights=None,
                 weights_version: int = 0, env_factory=None, multiturn: dict | None = None, timeout_s: float = 3600.0):
        tp, ep = int(tensor_parallel), int(expert_parallel)
        if min(tp, ep) < 1 or max(tp, ep) % min(tp, ep):
            raise ValueError(f"ParallelRolloutWorker: tensor_parallel = {tp}, expert_parallel = {ep}: both >= 1 "
                             "and one a multiple of the other")
        self.world, self.timeout_s, self.version = max(tp, ep), timeout_s, 0
        self.sync_group = None
        ctx = mp.get_context("spawn")
        self._inbox = [ctx.Queue() for _ in range(self.world)]
        self._outbox = ctx.Queue()
        kwargs = dict(model=model, decode=dict(decode), tensor_parallel=tp, expert_parallel=ep, device=device,
                      fp8=fp8, num_threads=num_threads, env_factory=env_factory, multiturn=multiturn)
        port = _free_port()
        self._procs = [ctx.Process(target=_rank_main, args=(r, self.world, port, kwargs, self._inbox[r], self._outbox),
                                   daemon=True) for r in range(self.world)]
        for p in self._procs:
            p.start()
        self._all("start", send=False)  # each rank reports once it holds its slice of the model
        if weights is not None:
            self.load_weights(weights, weights_version)

    # ---- forwarding
    def _all(self, name: str, *args, send: bool = True, **kw) -> list:
        """Call `name` on every rank's worker with the same arguments; every rank's answer, in rank order (a rank's
        failure comes back with its traceback; no answer within `timeout_s` is an error). send=False only waits
        for every rank's report (their start)."""
        for q in self._inbox if send else []:
            q.put((name, args, kw))
        got: dict[int, object] = {}
        errors = []
        while len(got) + len(errors) < self.world:
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout_s)
            except Exception as err:  # queue.Empty: a rank hung or died
                raise RuntimeError(f"ParallelRolloutWorker.{name}: no answer from every rank within "
                                   f"{self.timeout_s} s") from err
            if ok:
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"ParallelRolloutWorker.{name} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [got[r] for r in range(self.world)]

    # ---- RolloutWorker's methods
    def generate(self, prompt_ids, seeds, decode: dict | None = None, rows: list[dict] | None = None) -> list[dict]:
        return self._all("generate", prompt_ids, seeds, decode, rows)[0]

    def generate_partial(self, prompt_ids, seeds, tags, quota: int, min_version: int | None = None,
                         rows: list[dict] | None = None, due_version: int | None = None) -> dict:
        return self._all("generate_partial", prompt_ids, seeds, tags, quota, min_version, rows, due_version)[0]

    def partial_state(self) -> dict | None:
        return self._all("partial_state")[0]

    def restore_partial(self, state: dict | None) -> None:
        self._all("restore_partial", state)

    def load_weights(self, state_dict, version: int) -> float:
        """A full state dict, or a `WeightParts` fetched one part at a time: each rank keeps its slices."""
        import time

        from .weight_sync import WeightParts

        start = time.perf_counter()
        self._all("begin_load")
        if isinstance(state_dict, WeightParts):
            import ray

            for ref in state_dict.refs:
                self._all("load_part", ray.get(ref))
        else:
            self._all("load_part", dict(state_dict))
        self._all("end_load", version)
        self.version = int(version)
        return time.perf_counter() - start

    def join_sync_group(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float,
                        device: str = "cpu") -> None:
        """This worker (not its ranks) joins the learner's broadcast group; buckets go on to the ranks."""
        from .weight_sync import WeightBroadcastGroup

        self.close_sync_group()
        self.sync_group = WeightBroadcastGroup(addr, port, rank, world_size, timeout_s=timeout_s, device=device)

    def receive_weights(self, version: int) -> float:
        if self.sync_group is None:
            raise RuntimeError("receive_weights: this rollout worker is in no weight-sync group")
        import time

        start = time.perf_counter()
        self._all("begin_load")
        self.sync_group.receive(version, consume=lambda part: self._all("load_part", {k: v.cpu() for k, v in
                                                                                      part.items()}))
        self._all("end_load", version)
        self.version = int(version)
        return time.perf_counter() - start

    def close_sync_group(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def weights_digest(self) -> list[dict]:
        """Every rank's digest of its own shards (they do not equal the learner's whole-model digest)."""
        return self._all("weights_digest")

    def ping(self) -> int:
        return self._all("ping")[0]

    def close(self) -> None:
        """Stop the ranks (the worker is unusable afterwards)."""
        for q in self._inbox:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._procs = []

    def __del__(self):
        if getattr(self, "_procs", None):
            self.close()
