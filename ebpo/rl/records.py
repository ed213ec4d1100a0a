"""The records that cross between the RL roles, checked when they are built (not where they are used).

    rollout worker --RolloutSample--> collect --StepRecord--> learn --LearnerBatch--> learner ranks

`RolloutSample`: one decoded response as the driver keeps it. `StepRecord`: everything `collect` made for
one step (rollouts, scores, advantages, the rows kept), which asynchronous RL hands from its producer
thread to the learner and saves with a checkpoint while it is in flight. `LearnerBatch`: the right-padded
tensors of one learner update. A record with a wrong shape or a missing field raises ValueError naming
the field at construction.

Multi-turn (agentic) samples carry `RolloutSample.trajectory`: their response is everything after the prompt
(model turns and environment observations), and `build_learner_batch` scores only the tokens the model
wrote (`LearnerBatch.response_mask`), after checking that no block holds a model turn together with what
came after it (`ebpo.core.likelihood.turn_response_mask`). `RolloutSample.metadata` carries other
per-sample data from a rollout to a reward and to the step's record untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ebpo.core.likelihood import response_mask_from_ids


@dataclass
class RolloutSample:
    """One response decoded by a rollout worker (`rollout.worker.RolloutWorker.generate`).

    token_ids: the response (ends at its first EOS, EOS included, or is cut at max_new_tokens);
    tail_ids: the rest of the response's last block as the sampler's canvas held it (docs/ebpo.md);
    num_forwards / num_edits: the decode's forwards and T2T rewrites; tpf: tokens per forward;
    edit_log: the decoder's rewrites ([position, old, new, ...] lists, `rollout.edits`);
    weights_version: the weight version that sampled it (asynchronous RL's staleness);
    lev_drafts: [offset, pre-edit block] of every block with a Levenshtein operation (L-EBPO, docs/ebpo.md);
    metadata: free per-sample data (kept as is; for rollouts that need more than one decode);
    trajectory: a multi-turn rollout's record (`rollout.trajectory.Trajectory.to_dict()`: `prompt_ids`, `ids`,
    `generated`, `segment`, `turns`, ...), None for single-turn samples. Then token_ids is `ids` after
    `prompt_ids` and text is the last turn's text.
    block_versions: partial rollouts (`trainer.partial_rollouts`): per absolute block of prompt + response, the
    weight version that decoded it, -1 for blocks no forward decoded; weights_version is then the oldest.
    Empty otherwise (every block is weights_version's).
    """
    token_ids: list[int]
    text: str
    num_forwards: int
    tpf: float
    num_edits: int
    finished_by_eos: bool
    tail_ids: list[int] = field(default_factory=list)
    edit_log: list[list[int]] = field(default_factory=list)
    weights_version: int = 0
    lev_drafts: list = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    trajectory: Optional[dict] = None
    block_versions: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.token_ids, list) or not all(isinstance(t, int) for t in self.token_ids):
            raise ValueError("RolloutSample.token_ids: expected a list of token ids")
        if not isinstance(self.text, str):
            raise ValueError(f"RolloutSample.text: expected a string, got {type(self.text).__name__}")
        if self.num_forwards < 0 or self.num_edits < 0:
            raise ValueError(f"RolloutSample: negative counts (num_forwards {self.num_forwards}, "
                             f"num_edits {self.num_edits})")
        if self.trajectory is not None:
            t = self.trajectory
            missing = [k for k in ("prompt_ids", "ids", "generated", "segment", "turns") if k not in t]
            if missing:
                raise ValueError(f"RolloutSample.trajectory: missing {missing}")
            if not (len(t["ids"]) == len(t["generated"]) == len(t["segment"])):
                raise ValueError(f"RolloutSample.trajectory: ids, generated and segment differ in length "
                                 f"({len(t['ids'])}, {len(t['generated'])}, {len(t['segment'])})")
            if list(t["ids"][len(t["prompt_ids"]):]) != self.token_ids:
                raise ValueError("RolloutSample.token_ids: must be the trajectory's ids after its prompt_ids")

    @property
    def prompt_ids(self) -> Optional[list[int]]:
        """A multi-turn sample's prompt as decoded (the environment's first observation included); None for
        single-turn samples (their prompt is the encoded row)."""
        return None if self.trajectory is None else list(self.trajectory["prompt_ids"])

    @classmethod
    def from_worker(cls, out: Mapping[str, Any]) -> "RolloutSample":
        """The record of one dict returned by a rollout worker; unknown keys are an error."""
        try:
            return cls(**out)
        except TypeError as err:
            raise ValueError(f"RolloutSample: the rollout worker returned {sorted(out)}: {err}") from None


@dataclass
class StepRecord:
    """What `ebpo.rl.step.collect` made for one step; B = samples drawn (prompts drawn x group size).

    rows: the prompt rows drawn (every dynamic-sampling round); prompt_ids: (B) token-id lists, one per
    sample; samples: (B) rollouts; scores: (B,) fp32 combined rewards; group_ids: (B,) long prompt index;
    advantages: (B,) fp32; keep: (B,) bool rows the learner trains on; metrics: reward, rollout and
    data metrics of the step; times: `timing_s/*` seconds (wall clock, accumulated over rounds);
    sampler_after: the prompt sampler's state after this step's draws (checkpoints of in-flight steps).
    """
    step: int
    rows: list[dict]
    prompt_ids: list[list[int]]
    samples: list[RolloutSample]
    scores: torch.Tensor
    group_ids: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]
    times: dict[str, float]
    sampler_after: dict

    def __post_init__(self):
        B = len(self.samples)
        if len(self.prompt_ids) != B:
            raise ValueError(f"StepRecord.prompt_ids: {len(self.prompt_ids)} prompts for {B} samples")
        for name in ("scores", "group_ids", "advantages", "keep"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.shape != (B,):
                raise ValueError(f"StepRecord.{name}: expected a tensor of shape ({B},), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if self.keep.dtype != torch.bool:
            raise ValueError(f"StepRecord.keep: expected bool, got {self.keep.dtype}")

    def kept(self) -> list[int]:
        """Indices of the samples the learner trains on, in draw order."""
        return self.keep.nonzero().flatten().tolist()


@dataclass
class LearnerBatch:
    """One learner update's rows, right-padded to L; B rows.

    input_ids (B, L) long prompt + response (+ tail) + padding; prompt_lens (B,) long; response_lens
    (B,) long (response without its tail); response_mask (B, L) bool: the positions scored (never
    padding, never the prompt); advantages (B,) fp32, already normalised per prompt group; group_ids
    (B,) long (bookkeeping); weight_version (B,) long or None: the weight version that sampled each row
    (asynchronous RL; None = all current).
    block_versions (B, nb) long or None (partial rollouts, docs/ebpo.md "Block-exact behaviour terms"):
    entry (i, j) is the weight version that decoded block j of row i, blocks being the absolute positions
    [j*K, (j+1)*K) of the row (prompt + response, the composites' per-block indexing), -1 where the block
    holds no decoded token (prompt-only blocks, padding, observation-only blocks). nb is normally
    ceil(L / K) (`build_learner_batch` pads to it); the learner, which knows K, reads missing trailing
    columns as -1 and refuses a version past ceil(L / K) or a block with scored tokens and no version.
    With block_versions, weight_version is the row's OLDEST decoded block's version: derived when not
    given, checked when given (a row with no decoded block then keeps its given weight_version; without
    one it is refused).
    """
    input_ids: torch.Tensor
    prompt_lens: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    response_lens: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None
    weight_version: Optional[torch.Tensor] = None
    lev_drafts: Optional[list] = None
    block_versions: Optional[torch.Tensor] = None

    def __post_init__(self):
        ids = self.input_ids
        if self.lev_drafts is not None and len(self.lev_drafts) != ids.shape[0]:
            raise ValueError(f"LearnerBatch.lev_drafts: expected one list per row ({ids.shape[0]}), got "
                             f"{len(self.lev_drafts)}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"LearnerBatch.input_ids: expected (B, L), got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        B, L = ids.shape
        if self.response_mask.shape != (B, L):
            raise ValueError(f"LearnerBatch.response_mask: expected shape ({B}, {L}), got "
                             f"{tuple(self.response_mask.shape)}")
        for name in ("prompt_lens", "advantages", "response_lens", "group_ids", "weight_version"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B,):
                raise ValueError(f"LearnerBatch.{name}: expected shape ({B},), got {tuple(t.shape)}")
        if self.block_versions is not None:
            self.weight_version = _check_block_versions(self.block_versions, self.weight_version, B)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_mapping(cls, batch: Mapping[str, Any], eos_id: int) -> "LearnerBatch":
        """A batch given as a dict of tensors (or lists): `input_ids`, `prompt_lens`, `advantages` required;
        `response_mask` computed from the ids (`ebpo.core.likelihood.response_mask_from_ids`) when missing."""
        for key in ("input_ids", "prompt_lens", "advantages"):
            if key not in batch:
                raise ValueError(f"batch: missing field {key!r} (have {sorted(batch)})")
        unknown = set(batch) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"batch: unknown fields {sorted(unknown)}; allowed {sorted(cls.__dataclass_fields__)}")
        ids = torch.as_tensor(batch["input_ids"]).long()
        if ids.dim() != 2:
            raise ValueError(f"batch.input_ids: expected (B, L), got {tuple(ids.shape)}")
        prompt_lens = torch.as_tensor(batch["prompt_lens"]).long()
        adv = torch.as_tensor(batch["advantages"]).float()
        for key, t in (("prompt_lens", prompt_lens), ("advantages", adv)):
            if t.shape != (ids.shape[0],):
                raise ValueError(f"batch.{key}: expected shape ({ids.shape[0]},), got {tuple(t.shape)}")
        resp = batch.get("response_mask")
        if resp is not None:
            resp = torch.as_tensor(resp).bool()
            if resp.shape != ids.shape:
                raise ValueError(f"batch.response_mask: expected shape {tuple(ids.shape)}, got {tuple(resp.shape)}")
        else:
            resp = response_mask_from_ids(ids, prompt_lens, eos_id)
        optional = {k: None if batch.get(k) is None else torch.as_tensor(batch[k]).long()
                    for k in ("response_lens", "group_ids", "weight_version")}
        bv = batch.get("block_versions")
        if bv is not None and not isinstance(bv, torch.Tensor):  # per-row lists, padded with -1
            bv = pad_block_versions(bv, ids.shape[0], max((len(r) for r in bv), default=0))
        return cls(input_ids=ids, prompt_lens=prompt_lens, response_mask=resp, advantages=adv,
                   lev_drafts=batch.get("lev_drafts"), block_versions=None if bv is None else bv.long(), **optional)


def _check_block_versions(bv, weight_version: Optional[torch.Tensor], B: int) -> torch.Tensor:
    """Check `LearnerBatch.block_versions` (B, nb) long; returns the rows' weight_version (B,): the oldest
    decoded block's version (derived, or the given one checked against it)."""
    if not isinstance(bv, torch.Tensor) or bv.dim() != 2 or bv.shape[0] != B:
        got = tuple(bv.shape) if isinstance(bv, torch.Tensor) else type(bv).__name__
        raise ValueError(f"LearnerBatch.block_versions: expected shape ({B}, nb), got {got}")
    if bv.dtype != torch.long:
        raise ValueError(f"LearnerBatch.block_versions: expected dtype torch.int64, got {bv.dtype}")
    if bv.numel() and int(bv.min()) < -1:
        raise ValueError(f"LearnerBatch.block_versions: versions are >= 0, or -1 for an undecoded block; got "
                         f"{int(bv.min())}")
    decoded = bv >= 0
    has = decoded.any(1)
    oldest = torch.where(decoded, bv, torch.iinfo(torch.long).max).amin(1) if bv.shape[1] else bv.new_zeros(B)
    if weight_version is None:
        if not bool(has.all()):
            row = int((~has).nonzero()[0])
            raise ValueError(f"LearnerBatch.block_versions: row {row} has no decoded block; give weight_version")
        return oldest
    wv = weight_version.long()
    bad = has & (wv.cpu() != oldest.cpu())
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"LearnerBatch.weight_version: row {row} has version {int(wv[row])} but its oldest decoded "
                         f"block is version {int(oldest[row])} (block_versions); they must be equal")
    return wv


def pad_block_versions(rows: list[list[int]], B: int, nb: int) -> torch.Tensor:
    """(B, nb) long: per-row block-version lists (index = absolute block) right-padded with -1. A row with a
    version for a block >= nb (no position of the batch) is refused."""
    if len(rows) != B:
        raise ValueError(f"block_versions: {len(rows)} lists for {B} rows")
    out = torch.full((B, nb), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        r = [int(v) for v in r]
        past = [nb + j for j, v in enumerate(r[nb:]) if v >= 0]
        if past:
            raise ValueError(f"block_versions: row {i} has a version for block {past[0]}, past the batch's {nb} "
                             "blocks")
        if r[:nb]:
            out[i, : min(len(r), nb)] = torch.tensor(r[:nb], dtype=torch.long)
    return out


def build_learner_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], advantages: torch.Tensor,
                        group_ids: torch.Tensor, pad_id: int, tail_ids: list[list[int]] | None = None,
                        weight_version: list[int] | None = None, lev_drafts: list | None = None,
                        turns: list[tuple[list[bool], list[int]] | None] | None = None,
                        block_size: int | None = None, block_versions: list[list[int]] | None = None) -> LearnerBatch:
    """Right-padded learner batch.

    prompt_ids[i], response_ids[i]: token ids (the response ends at its first EOS, EOS included, or is
    cut at max_new_tokens). tail_ids[i] (optional): what the sampler's canvas holds after the response up
    to the end of the response's last block (the rest of that block: tokens after the EOS, or past
    max_new_tokens for a cut response). The tail is appended and scored with the response, so the
    learner's sequence is the canvas the sampler really produced, block for block (docs/ebpo.md, "The
    last block"). Without tails, positions after the response are `pad_id` and not scored.
    weight_version[i] (optional): the weight version that sampled row i (asynchronous RL).
    lev_drafts[i] (optional): row i's pre-edit blocks, for L-EBPO (`learner.levenshtein`).
    turns[i] (optional; None for a single-turn row): `(generated, segment)` of a multi-turn row over its
    prompt + response (`rollout.trajectory.Trajectory`): only generated positions are scored, and a block
    holding model tokens with a later segment raises ValueError (`ebpo.core.likelihood.turn_response_mask`,
    which needs `block_size`).
    block_versions[i] (optional; partial rollouts): row i's weight version per absolute block from block 0 (the
    prompt's blocks included), -1 for a block no forward decoded; padded with -1 to nb = ceil(L / block_size)
    (needs `block_size`). An empty list (or None) means row i was decoded under weight_version[i] alone: its
    blocks holding scored positions get that version. weight_version may be left out when every row has a
    list: each row's is then its oldest decoded block's (`LearnerBatch.block_versions`).
    """
    B = len(prompt_ids)
    tails = tail_ids if tail_ids is not None else [[] for _ in range(B)]
    if len(tails) != B:
        raise ValueError(f"tail_ids: {len(tails)} tails for {B} responses")
    scored = [list(r) + list(t) for r, t in zip(response_ids, tails)]
    lens = [len(p) + len(r) for p, r in zip(prompt_ids, scored)]
    L = max(lens)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, scored)):
        input_ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if r:
            input_ids[i, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, len(p): len(p) + len(r)] = True
    if turns is not None and any(t is not None for t in turns):
        response_mask = _turn_masks(response_mask, turns, [len(p) + len(r) for p, r in zip(prompt_ids, scored)],
                                    block_size)
    bv = None
    if block_versions is not None:
        if block_size is None:
            raise ValueError("build_learner_batch: block_versions need block_size")
        bv = pad_block_versions([r or [] for r in block_versions], B, -(-L // block_size))
        one = [i for i, r in enumerate(block_versions) if not r]  # decoded under weight_version alone
        if one:
            if weight_version is None:
                raise ValueError(f"build_learner_batch: row {one[0]} has no block_versions; give weight_version")
            nb = bv.shape[1]
            scored = torch.nn.functional.pad(response_mask[one], (0, nb * block_size - L))
            has = scored.view(len(one), nb, block_size).any(-1)
            bv[one] = torch.where(has, torch.tensor([weight_version[i] for i in one])[:, None], -1)
    return LearnerBatch(
        input_ids=input_ids,
        prompt_lens=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_lens=torch.tensor([len(r) for r in response_ids], dtype=torch.long),
        response_mask=response_mask,
        advantages=advantages.float(),
        group_ids=group_ids.long(),
        weight_version=None if weight_version is None else torch.tensor(weight_version, dtype=torch.long),
        lev_drafts=lev_drafts,
        block_versions=bv,
    )


def _turn_masks(response_mask: torch.Tensor, turns: list, lens: list[int], block_size: int | None) -> torch.Tensor:
    """The response mask with multi-turn rows replaced by their generated tokens (checked for leaks)."""
    from ebpo.core.likelihood import turn_response_mask

    if block_size is None:
        raise ValueError("build_learner_batch: multi-turn rows need block_size")
    B, L = response_mask.shape
    generated = torch.zeros(B, L, dtype=torch.bool)
    segment = torch.full((B, L), -1, dtype=torch.long)
    rows = [i for i, t in enumerate(turns) if t is not None]
    for i in rows:
        gen, seg = turns[i]
        if len(gen) != lens[i] or len(seg) != lens[i]:
            raise ValueError(f"build_learner_batch: row {i}: generated/segment cover {len(gen)}/{len(seg)} tokens, "
                             f"the row has {lens[i]}")
        generated[i, : lens[i]] = torch.tensor(gen, dtype=torch.bool)
        segment[i, : lens[i]] = torch.tensor(seg, dtype=torch.long)
    checked = turn_response_mask(generated, segment, block_size)
    out = response_mask.clone()
    out[rows] = checked[rows]
    return out
