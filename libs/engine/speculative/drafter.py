"""The MTP passes of speculative decoding: catch up, then draft (DeepSeek-V3's MTP).

After a step is committed, the MTP layer (its own KV pages in the same blocks) runs over every
position the main model just made final, fed the main model's hidden state there and the token
after it (``eh_proj([enorm(emb); hnorm(h)])``, one decoder layer, the shared head). Its output
at the last position is draft 1; drafts 2..K chain the MTP layer on its own hidden state and
previous draft. A prompt chunk fills the MTP KV of its positions the same way, so prefix hits
and KV exported to another engine carry it. A request held for export after its first token (a
prefill's) is drafted for too: its drafts travel with the KV.

The passes run through their own CUDA graphs where the decode steps have them (the MTP layer
over decode rows, the head's argmax and probability per request); each depth's drafts stay on
the device as the next depth's input, and the host reads all depths once (:func:`read_drafts`),
when the next step first asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from ..model.attention import AttentionMetadata
from ..model.model import MTPLayer
from ..scheduler import Request, ScheduledSeq, Scheduler, Status, StepPlan
from .verify import SpecStep, row_offsets

if TYPE_CHECKING:
    from ..runner import ModelRunner

# Catch-ups up to this many positions run as single-token decode rows (see Drafter.draft);
# longer ones (a prompt the MTP layer covers after prefill) stay prompt chunks.
_CATCH_UP_ROWS_MAX = 16


def single_rows(
    seqs: list[ScheduledSeq], split: Callable[[ScheduledSeq], bool]
) -> list[ScheduledSeq]:
    """``seqs`` with each multi-token one that ``split`` picks replaced by single-token rows
    in order: row ``i`` at position ``start + i``, attending to the context up to itself, so
    the batched decode attention serves them all in one call (a prompt chunk would make one
    call per sequence and, in MLA, re-expand its whole context)."""
    out: list[ScheduledSeq] = []
    for s in seqs:
        if s.num_tokens == 1 or not split(s):
            out.append(s)
            continue
        # Built directly: dataclasses.replace took twice as long (2.3 against 1.2 ms for 1,024
        # rows on a 2-core CPU), on the host while the device waits.
        out.extend(
            ScheduledSeq(
                s.request_id,
                s.start + i,
                1,
                (s.token_ids[i],),
                s.block_table,
                s.sample,
                s.start + i + 1,
            )
            for i in range(s.num_tokens)
        )
    return out


def _draftable(req: Request) -> bool:
    """Drafted for after a step: a running request, or one held for export after its first
    token ran out its length (a prefill's: the drafts go with the hand-over)."""
    held = req.status is Status.FINISHED and req.hold_kv and req.finish_reason == "length"
    return req.status is Status.RUNNING or held


# One drafting depth on the device: each live request's draft, its confidence, and which
# requests (indices into the pass's list) those rows are.
_Depth = tuple[torch.Tensor, torch.Tensor, list[int]]

# The token id a deeper draft pass is prepared with; its real input (the previous depth's
# draft) is handed to the model as a device tensor.
_DRAFT_ON_DEVICE = 0


# One drafting pass, still on the device: its depths and the requests drafted for, in order.
Pending = tuple[list[_Depth], list[str]]


def read_drafts(pending: Pending, vocab_size: int) -> dict[str, tuple[list[int], list[float]]]:
    """A drafting pass read from the device: per request, its drafts and their confidences
    (the host waits here for the pass, once)."""
    picked, ids = pending
    toks = torch.cat([t for t, _, _ in picked]).tolist()
    probs = torch.cat([c for _, c, _ in picked]).tolist()
    if toks and not 0 <= min(toks) <= max(toks) < vocab_size:
        # The head's argmax cannot leave the vocabulary: memory was overwritten.
        raise RuntimeError(
            f"the MTP head drafted token ids outside [0, {vocab_size}) "
            f"(min {min(toks)}, max {max(toks)}): its outputs were overwritten on the "
            "device before they were read"
        )
    drafts: list[list[int]] = [[] for _ in ids]
    confs: list[list[float]] = [[] for _ in ids]
    at = 0
    for _, _, rows in picked:
        for w in rows:
            drafts[w].append(int(toks[at]))
            confs[w].append(float(probs[at]))
            at += 1
    return {rid: (drafts[w], confs[w]) for w, rid in enumerate(ids)}


class Drafter:
    """The MTP layer of ``runner``'s model over the positions a step made final, then up to
    ``num_tokens`` drafts per request (module doc). Registers its graph sets with the runner."""

    def __init__(self, runner: ModelRunner, num_tokens: int) -> None:
        model = runner.model
        self.runner = runner
        self.num_tokens = num_tokens
        self.mtp = cast(MTPLayer, model.mtp[0])
        self.mtp_cache = runner.cache.layers[model.cfg.num_hidden_layers]
        # The MTP passes through CUDA graphs where the decode steps have them: the layer over
        # decode rows (catch-up rows and each depth's drafts), and the head's pick per request.
        width = (model.cfg.hidden_size, self.mtp.embed_tokens.weight.dtype)
        # Optional: a capture that fails leaves them eager (logged), not the engine down.
        runner.add_graphs(
            "mtp", self._block_body, runner.max_graph_batch, x_in=width, optional=True
        )
        runner.add_graphs(
            "mtp_head",
            self._pick,
            max(1, runner.max_graph_batch // (1 + num_tokens)),
            rows=False,
            x_in=width,
            optional=True,
        )

    def _block_body(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, x: torch.Tensor
    ) -> tuple[torch.Tensor]:
        return (self.mtp.block(x, ids, positions, meta, self.mtp_cache),)

    def _pick(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft (the head's argmax) and its probability."""
        logits = self.mtp.head(state)
        top, tok = logits.max(-1)
        return tok, (top - logits.logsumexp(-1)).exp()

    def _block(
        self, rows: list[ScheduledSeq], x: torch.Tensor, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MTP layer over ``rows`` (its KV written), fed hidden states ``x`` and the rows'
        token ids (``ids`` on the device, if given): a graph replay when one holds them."""
        out = self.runner.replay("mtp", rows, x=x, ids=ids)
        if out is not None:
            return out[0]
        ids_h, pos, meta, _ = self.runner._prepare(rows, None)
        return self.mtp.block(x, ids_h if ids is None else ids, pos, meta, self.mtp_cache)

    def draft(
        self, plan: StepPlan, step: SpecStep, scheduler: Scheduler, depth: int
    ) -> Pending | None:
        """After the scheduler committed ``step``: the MTP layer over every position that became
        final (its KV), then ``depth`` drafts for each running request that may be drafted for;
        the pass, still on the device (None when nothing was drafted)."""
        runner = self.runner
        catch = self._catch_up_seqs(plan, scheduler)
        if not catch:
            return None
        # Drafts follow a sampled token: a prompt chunk that samples none (more of the prompt
        # to come) gets its MTP KV, not drafts that the next step would throw away.
        sampled = {s.request_id for s in plan.seqs if s.sample}
        want = [
            s
            for s in catch
            if self.num_tokens
            and s.request_id in sampled
            and _draftable(scheduler.requests[s.request_id])
        ]
        first = {s.request_id: s.start for s in catch}
        # A decode's catch-up (its accepted drafts and the bonus token, at most 1 + K) runs as
        # single-token rows through the absorbed decode path, as verification does: as a
        # prompt chunk it would re-expand the whole context through kv_b_proj every step.
        catch = single_rows(catch, lambda s: s.num_tokens <= _CATCH_UP_ROWS_MAX)
        if runner.use_kernels:
            catch.sort(key=lambda s: s.num_tokens == 1)  # decodes last, as the kernels read them
        # Index tensors go over pinned and non-blocking (runner._to_device): a plain copy to
        # the device would wait for the work queued before it.
        h_index = runner._to_device(
            np.concatenate(
                [
                    np.arange(s.num_tokens)
                    + step.rows[s.request_id]
                    + (s.start - first[s.request_id])
                    for s in catch
                ]
            ).astype(np.int64)
        )
        x = self._block(catch, step.hidden[h_index])
        if not want:
            return None
        # A request's rows stay contiguous and in order: its last row ends its last piece.
        last = {s.request_id: r + s.num_tokens - 1 for s, r in row_offsets(catch, 0)}
        index = runner._to_device(np.asarray([last[s.request_id] for s in want], dtype=np.int64))
        picked = self._draft_depths(x[index], want, scheduler, depth)
        return (picked, [s.request_id for s in want])

    @staticmethod
    def _catch_up_seqs(plan: StepPlan, scheduler: Scheduler) -> list[ScheduledSeq]:
        """Per seq of ``plan``: the positions it made final, as the MTP layer's input (each
        fed the token after it)."""
        catch: list[ScheduledSeq] = []
        for seq in plan.seqs:
            req = scheduler.requests.get(seq.request_id)
            # A finished request kept for export (prefill's hand-off) gets its MTP KV too.
            if (
                req is None
                or not req.blocks
                or (req.status is not Status.RUNNING and not req.hold_kv)
            ):
                continue
            c = req.num_computed - seq.start  # positions made final this step
            if c <= 0 or len(req.token_ids) < seq.start + c + 1:
                continue
            catch.append(
                ScheduledSeq(
                    seq.request_id,
                    seq.start,
                    c,
                    tuple(req.token_ids[seq.start + 1 : seq.start + c + 1]),
                    tuple(req.blocks),
                    sample=False,
                    sample_position=seq.start + c + 1,
                )
            )
        return catch

    def _draft_depths(
        self, state: torch.Tensor, want: list[ScheduledSeq], scheduler: Scheduler, depths: int
    ) -> list[_Depth]:
        """``depths`` drafts for each of ``want`` from the MTP layer's last hidden ``state``
        (one row each): each depth's drafts stay on the device, the next depth takes them as
        its input ids, and the host reads all depths once at the end (not one wait per depth)."""
        runner = self.runner
        picked: list[_Depth] = []
        live = list(range(len(want)))
        max_len = scheduler.config.max_model_len
        for depth in range(depths):
            graphed = runner.replay("mtp_head", len(live), x=state)
            if graphed is not None:  # the graph's outputs are overwritten by its next replay
                tok, conf = (t.clone() for t in graphed)
            else:
                tok, conf = self._pick(state)
            picked.append((tok, conf, live))
            if depth + 1 == depths:
                break
            # Next depth: the MTP layer at the draft's position, fed its own hidden state.
            nxt: list[ScheduledSeq] = []
            keep: list[int] = []
            for j, w in enumerate(live):
                req = scheduler.requests[want[w].request_id]
                p = req.num_computed + depth  # the position whose next token is drafted
                if p + 1 >= max_len or not scheduler._try_allocate(req, depth + 1):
                    continue
                nxt.append(
                    ScheduledSeq(
                        req.request_id,
                        p,
                        1,
                        (_DRAFT_ON_DEVICE,),  # replaced by the draft on the device below
                        tuple(req.blocks),
                        sample=False,
                        sample_position=p + 1,
                    )
                )
                keep.append(j)
            if not nxt:
                break
            sel = runner._to_device(np.asarray(keep, dtype=np.int64))
            state = self._block(nxt, state[sel], tok[sel])
            live = [live[j] for j in keep]
        return picked
