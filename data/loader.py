"""The prepared dataset as the trainer reads it, and the schedule that numbers its micro-batches.

`Data` loads a `datasets.save_to_disk` folder (data.prepare / data.merge) into flat numpy arrays, drops the rows that
cannot train (counted by reason) and plans the token-budget micro-batches (data/batching.py); `read_stats` and
`tokenizer_mismatches` check the folder's stats.json against the target's tokenizer. `Schedule` says which rank
makes and which consumes micro-batch g, which g an optimizer step takes, and the learning rate at g.
"""
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from data.batching import BatchPlan
from data.chat import template_hash
from data.prepare import tokenizer_hash


class DataError(ValueError):
    """A dataset or schedule the run cannot train on; the message names the fix."""


def read_arrow_dataset(path):
    """A `datasets.save_to_disk` folder as one pyarrow Table, read straight from its Arrow files (memory-mapped):
    training hosts need pyarrow, not the `datasets` package."""
    path = Path(path)
    state = path / "state.json"
    if not state.exists():
        from datasets import load_from_disk   # optional: some other layout, let datasets read it
        return load_from_disk(str(path)).flatten_indices().data.table
    files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files])


def read_stats(data_dir) -> dict:
    """DATA/stats.json as data.prepare wrote it ({} for a dataset made another way)."""
    path = Path(data_dir) / "stats.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except ValueError as e:
        raise DataError(f"{path} is not JSON ({e}); prepare DATA again with `python -m data.prepare`") from e


def tokenizer_mismatches(stats: dict, tok, data_dir, target) -> list[str]:
    """The dataset's token ids and loss masks mean what they should only under the tokenizer and chat template it was
    prepared with: compare the hashes data.prepare recorded (stats) with those of the target's tokenizer tok.
    data_dir, target: the DATA and TARGET folders, for the messages. -> one error line per mismatch."""
    errs = []
    fix = (f"prepare DATA again with `python -m data.prepare --tokenizer {target} ...`, or train the target it was "
           f"made for")
    made_with = stats.get("tokenizer", "?")
    if stats.get("tokenizer_hash") and stats["tokenizer_hash"] != tokenizer_hash(tok):
        errs.append(f"DATA={data_dir} was tokenized with the tokenizer of {made_with} (vocabulary hash "
                    f"{stats['tokenizer_hash'][:12]}), TARGET={target} has another one ({tokenizer_hash(tok)[:12]}): "
                    f"its token ids mean other tokens; {fix}")
    if stats.get("chat_template_hash") and stats["chat_template_hash"] != template_hash(tok):
        errs.append(f"DATA={data_dir} was rendered with the chat template of {made_with} (hash "
                    f"{stats['chat_template_hash'][:12]}), TARGET={target}'s template differs "
                    f"({template_hash(tok)[:12]}): the drafter would learn text laid out unlike what the target "
                    f"serves; {fix}")
    return errs


class Data:
    """The prepared dataset as flat numpy arrays (fast random access from any thread), rows that cannot train
    dropped with a count per reason, and the batch plan (token_budget, max_batch_size, seed: BatchPlan's)."""

    def __init__(self, path, vocab_rows, token_budget, max_batch_size, seed=0):
        try:
            table = read_arrow_dataset(path)
        except Exception as e:  # noqa: BLE001 - any unreadable folder gets the same advice
            raise DataError(f"cannot load the dataset at DATA={path} ({type(e).__name__}: {e}); prepare it with "
                            f"`python -m data.prepare`") from e
        missing = {"input_ids", "loss_mask"} - set(table.column_names)
        if missing:
            raise DataError(f"dataset {path} lacks column(s) {sorted(missing)}; prepare it with `python -m "
                            f"data.prepare`")
        ids_col, mask_col = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        self.offsets = ids_col.offsets.to_numpy().astype(np.int64)                        # [n+1]
        self.ids = ids_col.flatten().to_numpy().astype(np.int64)                         # [tokens]
        mask_offsets = mask_col.offsets.to_numpy().astype(np.int64)
        self.mask = mask_col.flatten().to_numpy().astype(np.uint8)
        n = len(self.offsets) - 1
        lengths = np.diff(self.offsets)
        h = hashlib.sha256()
        for arr in (self.offsets, self.ids, self.mask):
            h.update(np.ascontiguousarray(arr).tobytes())
        self.content_hash = h.hexdigest()
        self.num_rows = n

        # rows that cannot train are dropped here, counted by reason, never met at step 10,000
        reasons = {}
        ok = np.ones(n, dtype=bool)

        def drop(bad, why):
            nonlocal ok
            bad = bad & ok
            if bad.any():
                reasons[why] = int(bad.sum())
                ok &= ~bad
        same_len = np.diff(mask_offsets) == lengths
        drop(~same_len, "loss_mask_length_differs")
        if not same_len.all():   # the flat mask must line up with the flat ids; the dropped rows' masks are zeros
            aligned = np.zeros(len(self.ids), dtype=np.uint8)
            for r in np.nonzero(same_len)[0]:
                aligned[self.offsets[r]:self.offsets[r + 1]] = self.mask[mask_offsets[r]:mask_offsets[r + 1]]
            self.mask = aligned
        row_of_token = np.repeat(np.arange(n), lengths)
        bad_tok = np.zeros(n, dtype=bool)
        bad_tok[row_of_token[(self.ids < 0) | (self.ids >= vocab_rows)]] = True
        drop(bad_tok, f"token_id_outside_vocab_0..{vocab_rows - 1}")
        drop(lengths > token_budget, f"longer_than_TOKEN_BUDGET_{token_budget}")
        # valid anchor: mask[p] & mask[p+1] inside one row
        pair = np.zeros(len(self.mask), dtype=bool)
        if len(self.mask) > 1:
            pair[:-1] = (self.mask[:-1] > 0) & (self.mask[1:] > 0)
        last = self.offsets[1:] - 1
        pair[last[last >= 0]] = False
        has_anchor = np.zeros(n, dtype=bool)
        has_anchor[row_of_token[pair]] = True
        drop(~has_anchor, "no_two_consecutive_supervised_tokens")
        self.dropped = reasons
        self.rows = np.nonzero(ok)[0]                                                     # plan index -> row
        if len(self.rows) == 0:
            raise DataError(f"no trainable rows in {path} (dropped: {reasons})")
        self.plan = BatchPlan(lengths[self.rows].tolist(), token_budget, max_batch_size, seed=seed)

    def batch(self, g):
        """Padded CPU tensors of micro-batch g: input_ids, loss_mask, attention_mask [b, S]; lengths [b]."""
        rows = self.rows[self.plan.batch(g)]
        lens = [int(self.offsets[r + 1] - self.offsets[r]) for r in rows]
        S = max(lens)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        mask = torch.zeros(len(rows), S, dtype=torch.uint8)
        attn = torch.zeros(len(rows), S, dtype=torch.long)
        for i, (r, n) in enumerate(zip(rows, lens)):
            a = self.offsets[r]
            ids[i, :n] = torch.from_numpy(self.ids[a:a + n])
            mask[i, :n] = torch.from_numpy(self.mask[a:a + n])
            attn[i, :n] = 1
        return ids, mask, attn, torch.tensor(lens, dtype=torch.long)

    def fingerprint(self) -> dict:
        """What a checkpoint records of the data (checkpoint.resume_point compares it)."""
        return {"rows": self.num_rows, "num_batches": self.plan.num_batches, "content_hash": self.content_hash}


class Schedule:
    """Micro-batch g (global over epochs) is made by target g % n_targets. From the run's start g0 on, optimizer
    step i consumes g0 + i*per_step .. g0 + (i+1)*per_step - 1, and drafter d takes those with
    (g - g0) % per_step % n_drafters == d. The LR is a function of data progress g / planned_g (optim.lr_at), so a
    run resumed with another target:drafter split (another per_step) continues at the same micro-batch with the
    same LR.
    total_g: the LR schedule's length (a resume's planned_g); None plans max_steps optimizer steps when max_steps is
    set (the data repeats as often as that needs, as HF Trainer's max_steps overrides its epochs), else epochs x
    num_batches."""

    def __init__(self, num_batches, n_targets, n_drafters, grad_accum, epochs, max_steps=0, start_g=0, total_g=None):
        self.nb, self.T, self.D, self.g0 = num_batches, n_targets, n_drafters, start_g
        self.grad_accum = grad_accum
        self.per_step = n_drafters * grad_accum
        if total_g is None:   # a fresh plan (a resume keeps the checkpoint's, unless data or length settings changed)
            total_g = max_steps * self.per_step if max_steps else epochs * num_batches
        self.planned_g = total_g                                               # the LR schedule's length
        self.steps = (total_g - start_g) // self.per_step                      # optimizer steps left
        self.total_g = start_g + self.steps * self.per_step                    # last micro-batch consumed + 1
        if self.steps <= 0 and start_g:
            raise DataError(f"the checkpoint already finished its schedule ({total_g} micro-batches, "
                            f"{total_g / num_batches:.2f} epochs); raise EPOCHS or MAX_STEPS to train further")
        if self.steps <= 0:
            raise DataError(f"nothing to train: {num_batches} micro-batches per epoch x EPOCHS={epochs} "
                            f"(MAX_STEPS={max_steps}) gives {total_g} micro-batches, the run starts at micro-batch "
                            f"{start_g} and one optimizer step needs {self.per_step} (drafters x GRAD_ACCUM); add "
                            f"data, raise EPOCHS or lower TOKEN_BUDGET")

    def producer(self, g):
        return g % self.T

    def consumer(self, g):  # drafter index
        return (g - self.g0) % self.per_step % self.D

    def target_gs(self, rank):
        """The g's target rank `rank` makes, in order (a one-process run: rank 0 of 1 makes them all)."""
        return range(self.g0 + (rank - self.g0) % self.T, self.total_g, self.T)

    def drafter_gs(self, d):
        """The g's drafter d consumes, in order."""
        for i in range(self.steps):
            for m in range(self.grad_accum):
                yield self.g0 + i * self.per_step + m * self.D + d

    def g_at(self, i):
        """First micro-batch of the i-th optimizer step of this run (0 = its first)."""
        return self.g0 + i * self.per_step
